"""`RowStorage`: fixed device buffers that hold the resident batch's rows.

The active blocks always live in rows [0, N) of these buffers, so a CUDA graph captured once
over them (the forward and the greedy step together, model/denoise_graphs.py) reads and writes the
live batch directly. Buffers, `capacity` rows each:
  ids (capacity, K) int64                 block tokens (also the graphs' static input ids)
  state {key: (capacity, ...)}            the algorithm's per-block state
  row_req, row_start, row_seed (capacity,) int64: each row's request index, block start and
                                          its request's sampling seed
  req_params {name: (capacity,)} float32  per-request values of the algorithm's request_params
                                          (indexed by row_req), the config default where unset
Rows at N and past (graph padding) hold garbage that nothing reads back.
"""

from __future__ import annotations

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm, State
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.utils.device import to_device


class RowStorage:
    def __init__(self, algo: DllmAlgorithm, capacity: int, block_size: int,
                 device: torch.device) -> None:
        self.algo, self.capacity, self.k, self.device = algo, capacity, block_size, device
        self.ids = torch.full((capacity, block_size), algo.mask_id, dtype=torch.int64,
                              device=device)
        self.state = algo.init_step_state(self.ids)
        self.rows_meta = torch.zeros(3, capacity, dtype=torch.int64, device=device)
        self.row_req, self.row_start, self.row_seed = self.rows_meta.unbind(0)
        self.defaults = np.array([float(getattr(algo.config, n)) for n in algo.request_params],
                                 dtype=np.float32)
        self.params = torch.tensor(self.defaults, device=device)[:, None].repeat(1, capacity)

    @property
    def req_params(self) -> dict[str, torch.Tensor]:
        return {n: self.params[i] for i, n in enumerate(self.algo.request_params)}

    def write(self, ids: torch.Tensor, state: State | None) -> None:
        """Rows [0, N) := ids (N, K) and state (N, ...) (new tensors, not views of these)."""
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        if state is not None and self.state is not None:
            for key, value in state.items():
                self.state[key][:n].copy_(value)

    def write_rows(self, at: np.ndarray, ids: torch.Tensor, state: State | None,
                   starts: np.ndarray) -> None:
        """Rows `at` (M,) := ids (M, K), state (M, ...) and block starts (M,); the rest stay."""
        idx = to_device(at.astype(np.int64), self.device)
        self.ids[idx] = ids
        if state is not None and self.state is not None:
            for key, value in state.items():
                self.state[key][idx] = value
        self.row_start[idx] = to_device(starts.astype(np.int64), self.device)

    def write_meta(self, row_req: np.ndarray, row_start: np.ndarray, row_seed: np.ndarray,
                   params: np.ndarray) -> None:
        """Per-row request index, block start and seed (N,); per-request params (P, B)."""
        n, b = len(row_req), params.shape[1]
        meta = np.stack([row_req, row_start, row_seed]).astype(np.int64)
        self.rows_meta[:, :n].copy_(to_device(meta, self.device))
        self.row_req[n:] = b  # padding rows: a request of their own (never read back)
        if params.size:
            self.params[:, :b].copy_(to_device(params, self.device))

    def views(self, n: int) -> tuple[torch.Tensor, State | None]:
        """ids (n, K) and state views of rows [0, n)."""
        state = None if self.state is None else {k: v[:n] for k, v in self.state.items()}
        return self.ids[:n], state

    def graph_batch(self, n: int) -> DenoiseBatch:
        """A greedy DenoiseBatch over rows [0, n) made only of these buffers: what a captured
        step sees (its per-request lists are placeholders a greedy step never reads)."""
        batch = DenoiseBatch(
            block_ids=self.ids[:n], num_blocks=[1] * n, first_starts=[0] * n,
            temperatures=[0.0] * n, top_ps=[1.0] * n, seeds=[0] * n,
            params={name: v for name, v in self.req_params.items()},
            block_steps=np.zeros(n, dtype=np.int64))
        batch.bind_rows(self.row_req[:n], self.row_start[:n], self.row_seed[:n])
        return batch
