"""`DenoiseBatch`: what one denoise step sees of the active blocks, grouped by request.

Layout invariant: `block_ids` (N, K) holds the N active blocks as B segments in row order:
segment b owns num_blocks[b] consecutive rows, blocks at absolute positions first_starts[b],
first_starts[b] + K, ... So `block_ids.view(-1)` is exactly the concatenation of the segments'
tokens, in the order the forward lays them out. A segment is one request's blocks, or some of
them: the worker gives every block a segment of its own (num_blocks all 1, N == B) and ties a
request's rows together through row_req, its key, which the wavefront's step groups by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dllm_serve.utils.device import to_device


@dataclass
class DenoiseBatch:
    """block_ids: (N, K) int64 on the device, edited in place by the algorithm's step().

    Per request (B of them, host): num_blocks, first_starts (absolute position of the leftmost
    active block), temperatures (0 = greedy), top_ps, seeds, top_ks and min_ps (empty: off for
    every request); params: per-request values on the device of the settings a request may
    override, indexed through row_req. Per block (host): block_steps (N,), forwards each block
    has had since it opened (the step being taken not counted); (device) row_req, row_start,
    row_seed: its request's key (equal for the blocks of one request: its index here, or the
    worker's request slot), its position and seed; gates: None, or (gate, flag) (N,) int64 of
    rows that may wait for their predecessor (dllm/wavefront.py `open_gates`).
    The worker makes a new DenoiseBatch whenever its rows change and steps the same one until
    then.
    """

    block_ids: torch.Tensor
    num_blocks: list[int]
    first_starts: list[int]
    temperatures: list[float]
    top_ps: list[float]
    seeds: list[int]
    params: dict[str, torch.Tensor]
    block_steps: np.ndarray
    _row_req: torch.Tensor | None = field(default=None, repr=False)
    _row_start: torch.Tensor | None = field(default=None, repr=False)
    _row_seed: torch.Tensor | None = field(default=None, repr=False)
    top_ks: list[int] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    gates: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind_rows(self, row_req: torch.Tensor, row_start: torch.Tensor,
                  row_seed: torch.Tensor) -> None:
        """Use these device tensors (N,) as row_req / row_start / row_seed (the worker's
        static buffers) instead of building them from the host lists."""
        self._row_req, self._row_start, self._row_seed = row_req, row_start, row_seed

    @property
    def size(self) -> int:
        return self.block_ids.shape[0]

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[1]

    @property
    def sampled(self) -> bool:
        """Whether any row samples (temperature > 0; verified temperatures are finite and
        >= 0). Asked at every launch: one builtin max over the rows, not a Python loop."""
        return max(self.temperatures, default=0.0) > 0

    @property
    def row_req(self) -> torch.Tensor:
        """(N,) int64 on the device: the request of each block row."""
        if self._row_req is None:
            rows = np.repeat(np.arange(len(self.num_blocks)), self.num_blocks)
            self._row_req = to_device(rows.astype(np.int64), self.block_ids.device)
        return self._row_req

    @property
    def row_start(self) -> torch.Tensor:
        """(N,) int64 on the device: the absolute position of each block."""
        if self._row_start is None:
            self._row_start = to_device(np.array(self.block_starts(), dtype=np.int64),
                                        self.block_ids.device)
        return self._row_start

    @property
    def row_seed(self) -> torch.Tensor:
        """(N,) int64 on the device: the sampling seed of each block's request."""
        if self._row_seed is None:
            seeds = np.array([self.seeds[b] for b in self.row_requests()], dtype=np.int64)
            self._row_seed = to_device(seeds, self.block_ids.device)
        return self._row_seed

    def row_requests(self) -> list[int]:
        """Host copy of row_req."""
        return [b for b, n in enumerate(self.num_blocks) for _ in range(n)]

    def block_starts(self) -> list[int]:
        k = self.block_size
        return [s + j * k for s, n in zip(self.first_starts, self.num_blocks, strict=True)
                for j in range(n)]

    def row_offsets(self) -> list[int]:
        """First row of each request."""
        return np.concatenate([[0], np.cumsum(self.num_blocks)[:-1]]).astype(int).tolist()

    def select(self, request: int) -> tuple[DenoiseBatch, slice]:
        """The batch of one request's rows (views of this batch's tensors) and its row slice."""
        first = self.row_offsets()[request]
        rows = slice(first, first + self.num_blocks[request])
        one = DenoiseBatch(
            self.block_ids[rows], [self.num_blocks[request]], [self.first_starts[request]],
            [self.temperatures[request]], [self.top_ps[request]], [self.seeds[request]],
            {k: v[self.row_req[first:first + 1]] for k, v in self.params.items()},
            self.block_steps[rows],
            top_ks=self.top_ks[request:request + 1], min_ps=self.min_ps[request:request + 1])
        return one, rows
