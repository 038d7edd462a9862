"""One denoise round: forward -> step until the execution mode says to hand back.

Modes, independent of the algorithm:
- sync: run until every request can retire its leftmost block;
- FDFO: re-loop in place while no request can retire a block; hand back as soon as one can.
With a wavefront (size W > 1) each request may also open its next block inside the round
(see wavefront.py), and when a block's tokens change, the later blocks of its request are
reopened (their convergence was judged against the old tokens).
A block is retirable when it and every block to its left reported done on entry, so each
committed block's cached KV was computed from its final tokens and final left context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.wavefront import (
    WavefrontConfig,
    earlier_block_changed,
    readiness,
    retire_counts,
    spawn_mask,
)

if TYPE_CHECKING:
    from dllm_serve.dllm.algorithms.base import DllmAlgorithm, State

Forward = Callable[[DenoiseBatch], torch.Tensor]  # batch -> logits (N * K, V)


@dataclass(frozen=True)
class RoundMode:
    fdfo: bool = True
    wavefront: WavefrontConfig = field(default_factory=WavefrontConfig)


@dataclass
class RoundOutput:
    """batch/state: the final layout (blocks opened this round included); retired (B,): leading
    blocks each request commits; done_steps (N,): block_steps when each block's current run of
    done reports began, 0 if not done."""

    batch: DenoiseBatch
    state: State | None
    forwards: int
    retired: np.ndarray
    done_steps: np.ndarray


def run_round(algo: DllmAlgorithm, forward: Forward, batch: DenoiseBatch, state: State | None,
              mode: RoundMode) -> RoundOutput:
    wf = mode.wavefront
    tau = wf.token_threshold
    if tau is None:
        tau = float(getattr(algo.config, "threshold", 0.9))
    done_steps = np.zeros(batch.size, dtype=np.int64)
    for forwards in range(1, algo.max_steps(batch.block_size) + 1):
        before = batch.block_ids.clone()
        done = algo.step(batch, forward(batch), state)
        batch.block_steps += 1
        flags = [done]
        if wf.size > 1:
            algo.reopen(state, earlier_block_changed((batch.block_ids != before).any(1),
                                                     batch.row_req))
            masked = before == algo.mask_id
            flags.append(readiness(masked, batch.confidence, tau) > wf.spawn_threshold)
        host = torch.stack(flags).cpu().numpy()  # the one host sync per forward
        done_steps = np.where(host[0], np.where(done_steps > 0, done_steps, batch.block_steps), 0)
        retired = retire_counts(host[0], batch.num_blocks)
        if wf.size > 1:  # open blocks first: a block retiring now frees its window slot
            spawn = spawn_mask(host[1], batch.num_blocks, retired, batch.room(), wf)
            if spawn.any():
                batch, state, done_steps = open_blocks(algo, batch, state, done_steps, spawn)
        if retired.all() or (mode.fdfo and not wf.lockstep and retired.any()):
            return RoundOutput(batch, state, forwards, retired, done_steps)
    raise RuntimeError(f"{type(algo).__name__}: a leftmost block was not done after "
                       f"{algo.max_steps(batch.block_size)} steps")


def open_blocks(algo: DllmAlgorithm, batch: DenoiseBatch, state: State | None,
                done_steps: np.ndarray, spawn: np.ndarray,
                ) -> tuple[DenoiseBatch, State | None, np.ndarray]:
    """Append an all-mask block (with fresh algorithm state) to each request where spawn[b]."""
    new, order = batch.with_new_blocks(spawn, algo.mask_id)
    fresh_rows = new.block_ids[order >= batch.size]
    done_steps = np.concatenate([done_steps, np.zeros(len(fresh_rows), np.int64)])
    done_steps = done_steps[order.cpu().numpy()]
    if state is None:
        return new, None, done_steps
    fresh = algo.init_step_state(fresh_rows)
    assert fresh is not None
    state = {k: torch.cat([v, fresh[k]])[order] for k, v in state.items()}
    return new, state, done_steps
