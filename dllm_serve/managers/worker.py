"""The worker: owns the device (model runner) and runs one round of work at a time.

A denoise round hands the algorithm the round's block ids and a `forward` callable over a
ForwardBatch built once; the algorithm's base class runs sync or FDFO (re-looping in place
while no block is done). Carried algorithm state travels as numpy per row; rows whose block
just started get a fresh state from `init_step_state`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from dllm_serve.dllm.algorithms import DenoiseBatch, DllmAlgorithm
from dllm_serve.dllm.algorithms.base import RowState, State
from dllm_serve.managers.messages import (
    DenoiseWork,
    PrefillDone,
    PrefillWork,
    RoundResult,
)
from dllm_serve.model.runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, runner: ModelRunner, algorithm: DllmAlgorithm) -> None:
        self.runner = runner
        self.algo = algorithm

    @torch.inference_mode()
    def run(self, work: PrefillWork | DenoiseWork) -> PrefillDone | RoundResult:
        if isinstance(work, PrefillWork):
            self.runner.forward(self.runner.prefill_batch(work))
            return PrefillDone()
        return self.denoise(work)

    def denoise(self, work: DenoiseWork) -> RoundResult:
        device = self.runner.device
        block_ids = torch.from_numpy(work.block_ids).to(device)  # (B, K)
        batch = DenoiseBatch(
            block_ids=block_ids, params=self._row_params(work), temperatures=work.temperatures,
            top_ps=work.top_ps, seeds=work.seeds, block_starts=work.block_starts,
            block_steps=work.block_steps.copy())
        state = collate_states(self.algo, block_ids, work.states)
        fb = self.runner.denoise_batch(work, block_ids)
        out = self.algo.run(lambda: self.runner.forward(fb), batch, state, work.fdfo)
        return RoundResult(
            block_ids=block_ids.cpu().numpy(), done=out.done,
            states=split_states(state, out.done), block_steps=batch.block_steps,
            forwards=out.forwards, finished_at=out.finished_at)

    def _row_params(self, work: DenoiseWork) -> dict[str, torch.Tensor]:
        """Per-row values of the settings any row overrides (others use the config)."""
        names = sorted({name for p in work.params for name in p})
        cfg = self.algo.config
        return {name: torch.tensor([p.get(name, getattr(cfg, name)) for p in work.params],
                                   dtype=torch.float32, device=self.runner.device)
                for name in names}


def collate_states(algo: DllmAlgorithm, block_ids: torch.Tensor,
                   rows: list[RowState | None]) -> State | None:
    """Batched state: fresh for rows whose block starts now, carried values for the rest."""
    state = algo.init_step_state(block_ids)
    if state is None:
        return None
    for i, row in enumerate(rows):
        if row is not None:
            for key, value in row.items():
                state[key][i] = torch.from_numpy(value).to(block_ids.device)
    return state


def split_states(state: State | None, done: np.ndarray) -> list[RowState | None]:
    """Per-row numpy state for the rows still denoising; None for committed rows."""
    if state is None:
        return [None] * len(done)
    host = {key: value.cpu().numpy() for key, value in state.items()}
    return [None if d else {k: np.array(v[i]) for k, v in host.items()} for i, d in enumerate(done)]
