"""`DenoiseBatch`: the active blocks of one round, grouped by request.

Layout invariant: `block_ids` (N, K) holds the N active blocks ordered by request and, within a
request, by position. Request b owns num_blocks[b] consecutive rows: blocks at absolute
positions first_starts[b], first_starts[b] + K, ... So `block_ids.view(-1)` is exactly the
concatenation of every request's active tokens, in the order the forward batch lays them out.
With one block per request (wavefront size 1) N == B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DenoiseBatch:
    """block_ids: (N, K) int64 on the device, edited in place by the algorithm's step().

    Per request (B of them, host): num_blocks, first_starts (absolute position of the leftmost
    active block), limits (end position up to which blocks may be opened), temperatures
    (0 = greedy), top_ps, seeds, top_ks and min_ps (empty: off for every request); params:
    per-request values (B,) on the device of the settings a request may override. Per block
    (host): block_steps (N,), forwards each block has had since it opened. confidence (N, K):
    set by the last predict(), the confidence of each predicted token (the wavefront's spawn
    gate reads it).
    """

    block_ids: torch.Tensor
    num_blocks: list[int]
    first_starts: list[int]
    limits: list[int]
    temperatures: list[float]
    top_ps: list[float]
    seeds: list[int]
    params: dict[str, torch.Tensor]
    block_steps: np.ndarray
    confidence: torch.Tensor | None = None
    _row_req: torch.Tensor | None = field(default=None, repr=False)
    top_ks: list[int] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.block_ids.shape[0]

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[1]

    @property
    def sampled(self) -> bool:
        return any(t > 0 for t in self.temperatures)

    @property
    def row_req(self) -> torch.Tensor:
        """(N,) int64 on the device: the request of each block row."""
        if self._row_req is None:
            counts = torch.as_tensor(self.num_blocks, device=self.block_ids.device)
            self._row_req = torch.repeat_interleave(
                torch.arange(len(self.num_blocks), device=self.block_ids.device), counts)
        return self._row_req

    def row_requests(self) -> list[int]:
        """Host copy of row_req."""
        return [b for b, n in enumerate(self.num_blocks) for _ in range(n)]

    def block_starts(self) -> list[int]:
        k = self.block_size
        return [s + j * k for s, n in zip(self.first_starts, self.num_blocks, strict=True)
                for j in range(n)]

    def room(self) -> list[bool]:
        """Per request: may a block still open after its frontier (within its limit)?"""
        k = self.block_size
        return [s + (n + 1) * k <= lim for s, n, lim in
                zip(self.first_starts, self.num_blocks, self.limits, strict=True)]

    def with_new_blocks(self, spawn: np.ndarray, mask_id: int) -> tuple[DenoiseBatch,
                                                                        torch.Tensor]:
        """A copy with one all-mask block appended to each request where spawn[b].

        Returns the new batch and `order` (N',) indexing rows of cat([old rows, new rows]),
        so that callers can rearrange per-block state the same way.
        """
        old_n = self.size
        order, fresh, counts = [], 0, []
        for b, (start, n) in enumerate(zip(self._offsets(), self.num_blocks, strict=True)):
            order.extend(range(start, start + n))
            if spawn[b]:
                order.append(old_n + fresh)
                fresh += 1
            counts.append(n + int(spawn[b]))
        dev = self.block_ids.device
        new_rows = torch.full((fresh, self.block_size), mask_id, dtype=torch.int64, device=dev)
        idx = torch.as_tensor(order, device=dev)
        steps = np.concatenate([self.block_steps, np.zeros(fresh, dtype=np.int64)])[order]
        batch = DenoiseBatch(
            torch.cat([self.block_ids, new_rows])[idx], counts, self.first_starts, self.limits,
            self.temperatures, self.top_ps, self.seeds, self.params, steps,
            top_ks=self.top_ks, min_ps=self.min_ps)
        return batch, idx

    def _offsets(self) -> list[int]:
        return np.concatenate([[0], np.cumsum(self.num_blocks)[:-1]]).astype(int).tolist()
