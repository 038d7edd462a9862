"""The worker: owns the device (model runner) and runs one round of work at a time.

A denoise round hands the algorithm the round's blocks and a `forward` over them; the
algorithm's base class runs the execution mode (sync / FDFO, wavefront), re-looping in place
until blocks can retire. The forward (a CUDA graph replay or an eager ForwardBatch, see
ModelRunner.denoise_forward) is prepared again only when the layout changes (a block opens).
Carried algorithm state travels as numpy per block; blocks that start now get a fresh state
from `init_step_state`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from dllm_serve.dllm.algorithms import DenoiseBatch, DllmAlgorithm, RoundMode
from dllm_serve.dllm.algorithms.base import RowState, State
from dllm_serve.managers.messages import DenoiseWork, PrefillDone, PrefillWork, RoundResult
from dllm_serve.model.runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, runner: ModelRunner, algorithm: DllmAlgorithm, mode: RoundMode) -> None:
        self.runner = runner
        self.algo = algorithm
        self.mode = mode

    @torch.inference_mode()
    def run(self, work: PrefillWork | DenoiseWork) -> PrefillDone | RoundResult:
        if isinstance(work, PrefillWork):
            self.runner.forward(self.runner.prefill_batch(work))
            return PrefillDone()
        return self.denoise(work)

    def denoise(self, work: DenoiseWork) -> RoundResult:
        batch = self._batch(work)
        state = collate_states(self.algo, batch.block_ids, work.states)
        self.runner.set_pages(work.req_slots, work.pages)
        cached: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []

        def forward(b: DenoiseBatch) -> torch.Tensor:
            if not cached or cached[0][0] is not b.block_ids:
                cached[:] = [(b.block_ids, self.runner.denoise_forward(work.req_slots, b))]
            return cached[0][1]()

        out = self.algo.run(forward, batch, state, self.mode)
        retired = np.zeros(out.batch.size, dtype=bool)
        for b, (n, r) in enumerate(zip(out.batch.num_blocks, out.retired, strict=True)):
            first = sum(out.batch.num_blocks[:b])
            retired[first:first + min(r, n)] = True
        edits = self.algo.edits(out.state) if out.state is not None else None
        return RoundResult(
            block_ids=out.batch.block_ids.cpu().numpy(), num_blocks=out.batch.num_blocks,
            retired=out.retired, states=split_states(out.state, retired),
            block_steps=out.batch.block_steps, done_steps=out.done_steps,
            forwards=out.forwards,
            block_edits=(np.zeros(out.batch.size, dtype=np.int64) if edits is None
                         else edits.cpu().numpy()))

    def _batch(self, work: DenoiseWork) -> DenoiseBatch:
        device = self.runner.device
        return DenoiseBatch(
            block_ids=torch.from_numpy(work.block_ids).to(device), num_blocks=work.num_blocks,
            first_starts=work.first_starts, limits=work.limits, temperatures=work.temperatures,
            top_ps=work.top_ps, seeds=work.seeds, params=self._params(work),
            block_steps=work.block_steps.copy(), top_ks=work.top_ks, min_ps=work.min_ps)

    def _params(self, work: DenoiseWork) -> dict[str, torch.Tensor]:
        """Per-request values (B,) of the settings any request overrides."""
        names = sorted({name for p in work.params for name in p})
        cfg = self.algo.config
        return {name: torch.tensor([p.get(name, getattr(cfg, name)) for p in work.params],
                                   dtype=torch.float32, device=self.runner.device)
                for name in names}


def collate_states(algo: DllmAlgorithm, block_ids: torch.Tensor,
                   rows: list[RowState | None]) -> State | None:
    """Batched state: fresh for blocks that start now, carried values for the rest."""
    state = algo.init_step_state(block_ids)
    if state is None:
        return None
    for i, row in enumerate(rows):
        if row is not None:
            for key, value in row.items():
                state[key][i] = torch.as_tensor(value, device=block_ids.device)
    return state


def split_states(state: State | None, drop: np.ndarray) -> list[RowState | None]:
    """Per-block numpy state for the blocks that stay; None where drop[i] (retired)."""
    if state is None:
        return [None] * len(drop)
    host = {key: value.cpu().numpy() for key, value in state.items()}
    return [None if d else {k: np.array(v[i]) for k, v in host.items()} for i, d in enumerate(drop)]
