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

from functools import cached_property

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm, State
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.managers.messages import RowState
from dllm_serve.utils.device import copy_to_device, to_device


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
        # rows written by write_rows, staged here: indexes, request, start, seed, ids
        self.upload = torch.empty(capacity * (4 + block_size), dtype=torch.int64, device=device)
        self._uploads: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor | None]] = {}
        self._padding = (-1, -1)  # (rows, reqs) of write_params' last fill of padding rows
        self._cache: dict[int, tuple[torch.Tensor, State | None,
                                     tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    @cached_property
    def req_params(self) -> dict[str, torch.Tensor]:
        """{name: (capacity,) view of its row of `params`} (fixed views, made once)."""
        return {n: self.params[i] for i, n in enumerate(self.algo.request_params)}

    def write(self, ids: torch.Tensor, state: State | None) -> None:
        """Rows [0, N) := ids (N, K) and state (N, ...) (new tensors, not views of these)."""
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        if state is not None and self.state is not None:
            for key, value in state.items():
                self.state[key][:n].copy_(value)

    def write_rows(self, at: np.ndarray, ids: np.ndarray | None,
                   states: list[RowState | None] | None, starts: np.ndarray, reqs: np.ndarray,
                   seeds: np.ndarray) -> None:
        """Rows `at` (M,) := block starts, request indexes and seeds (M,) (rows_meta's order:
        request, start, seed) and, unless ids is None, ids (M, K) (host) with fresh state (or
        a resumed block's own, from states); the other rows stay. One host-to-device copy.
        The one way rows' metadata is written: every row on a compaction (ids None: they
        were gathered on the device), the changed rows on a patch."""
        m = len(at)
        if m == 0:
            return
        parts = [at, reqs, starts, seeds] + ([] if ids is None else [ids.reshape(-1)])
        flat, idx, meta, new_ids = self._upload_views(m, ids is not None)
        copy_to_device(flat, np.concatenate(parts).astype(np.int64, copy=False))
        self.rows_meta.index_copy_(1, idx, meta)
        if new_ids is None:
            return
        self.ids.index_copy_(0, idx, new_ids)
        state = self.fresh_state(new_ids, states or [None] * m)
        if state is not None and self.state is not None:
            for key, value in state.items():
                self.state[key].index_copy_(0, idx, value)

    def _upload_views(self, m: int, with_ids: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor, torch.Tensor | None]:
        """Views of `upload` for m rows (made once per m): the whole (m * (4 [+ K]),), the row
        indexes (m,), their metadata (3, m) and, with ids, their ids (m, K). The upload buffer
        is reused by every write: a later copy into it is queued after the reads of the one
        before (stream order)."""
        key = (m, with_ids)
        views = self._uploads.get(key)
        if views is None:
            flat = self.upload[:m * (4 + (self.k if with_ids else 0))]
            views = self._uploads[key] = (flat, flat[:m], flat[m:4 * m].view(3, m),
                                          flat[4 * m:].view(m, self.k) if with_ids else None)
        return views

    def write_params(self, at: np.ndarray, params: np.ndarray, rows: int, reqs: int) -> None:
        """Requests `at` (M,) := per-request params (P, M); rows [rows, capacity) (padding)
        become a request of their own, index `reqs` (past every real one)."""
        if params.size:  # one copy: the indexes' bytes, then the values'
            m = len(at)
            packed = to_device(np.concatenate([at.astype(np.int64).view(np.uint8),
                                               params.astype(np.float32).reshape(-1)
                                               .view(np.uint8)]), self.device)
            self.params.index_copy_(1, packed[:8 * m].view(torch.int64),
                                    packed[8 * m:].view(torch.float32).view(params.shape))
        if self._padding != (rows, reqs):  # usually unchanged: a joiner took a hole
            self.row_req[rows:].fill_(reqs)
            self._padding = (rows, reqs)

    def fresh_state(self, ids: torch.Tensor, states: list[RowState | None]) -> State | None:
        """State for new rows with ids (M, K): fresh from the algorithm, carried values where
        a resumed block brought its own (states[i] not None)."""
        state = self.algo.init_step_state(ids)
        if state is None:
            return None
        for i, carried in enumerate(states):
            for key, value in (carried or {}).items():
                state[key][i] = to_device(np.asarray(value), ids.device)
        return state

    def views(self, n: int) -> tuple[torch.Tensor, State | None]:
        """ids (n, K) and state views of rows [0, n) (made once per n: a view costs a
        dispatch, and a layout change asks for them every forward)."""
        return self._views(n)[:2]

    def row_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """row_req, row_start, row_seed views (n,) of rows [0, n)."""
        return self._views(n)[2]

    def _views(self, n: int) -> tuple[torch.Tensor, State | None,
                                      tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        cached = self._cache.get(n)
        if cached is None:
            state = None if self.state is None else {k: v[:n] for k, v in self.state.items()}
            rows = (self.row_req[:n], self.row_start[:n], self.row_seed[:n])
            cached = self._cache[n] = (self.ids[:n], state, rows)
        return cached

    def graph_batch(self, n: int) -> DenoiseBatch:
        """A greedy DenoiseBatch over rows [0, n) made only of these buffers: what a captured
        step sees (its per-request lists are placeholders a greedy step never reads)."""
        batch = DenoiseBatch(
            block_ids=self.ids[:n], num_blocks=[1] * n, first_starts=[0] * n,
            temperatures=[0.0] * n, top_ps=[1.0] * n, seeds=[0] * n,
            params={name: v for name, v in self.req_params.items()},
            block_steps=np.zeros(n, dtype=np.int64))
        batch.bind_rows(*self.row_views(n))
        return batch
