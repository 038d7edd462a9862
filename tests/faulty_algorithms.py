"""Test-only algorithm plugins that fail on chosen requests (picked by their sampling seed):
`--dllm-algorithm faulty_algorithms:Poisoned` etc. Not in the engine's registry."""

from __future__ import annotations

import torch

from dllm_serve.dllm.algorithms import ALGORITHMS, StepOutput
from dllm_serve.dllm.algorithms.base import State
from dllm_serve.dllm.algorithms.low_confidence import LowConfidence
from dllm_serve.dllm.batch import DenoiseBatch

NAN_SEED, RAISE_SEED, STUCK_SEED, LATE_NAN_SEED = 666, 667, 668, 669
LATE = 64  # LATE_NAN_SEED requests get NaN logits from this position on


def rows_of(batch: DenoiseBatch, seed: int) -> torch.Tensor:
    """(N,) bool: the rows of requests whose seed is `seed`."""
    marked = [batch.seeds[b] == seed for b in batch.row_requests()]
    return torch.tensor(marked, device=batch.block_ids.device)


@ALGORITHMS.register()
class Poisoned(LowConfidence):
    """NaN logits for the rows of requests with seed NAN_SEED, and for blocks at LATE or
    later of requests with seed LATE_NAN_SEED."""

    graph_safe = False  # reads the batch's host lists

    def step(self, batch: DenoiseBatch, full_logits: torch.Tensor,
             state: State | None) -> StepOutput:
        late = torch.tensor([s >= LATE for s in batch.block_starts()],
                            device=batch.block_ids.device)
        rows = rows_of(batch, NAN_SEED) | (rows_of(batch, LATE_NAN_SEED) & late)
        if rows.any():
            full_logits = full_logits.clone().view(batch.size, batch.block_size, -1)
            full_logits[rows] = float("nan")
            full_logits = full_logits.view(-1, full_logits.shape[-1])
        return super().step(batch, full_logits, state)


@ALGORITHMS.register()
class Raising(LowConfidence):
    """Raises whenever a request with seed RAISE_SEED is among the rows stepped."""

    graph_safe = False
    def step(self, batch: DenoiseBatch, full_logits: torch.Tensor,
             state: State | None) -> StepOutput:
        if rows_of(batch, RAISE_SEED).any():
            raise ValueError("this plugin fails on seed 667")
        return super().step(batch, full_logits, state)


@ALGORITHMS.register()
class Stuck(LowConfidence):
    """Never unmasks anything in the rows of requests with seed STUCK_SEED."""

    graph_safe = False
    def step(self, batch: DenoiseBatch, full_logits: torch.Tensor,
             state: State | None) -> StepOutput:
        rows = rows_of(batch, STUCK_SEED)
        before = batch.block_ids.clone()
        out = super().step(batch, full_logits, state)
        batch.block_ids[rows] = before[rows]
        return out
