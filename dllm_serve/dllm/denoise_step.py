"""One denoise step over the device batch, and the one tensor the worker reads back of it.

`denoise_step` runs the algorithm's step on a forward's logits, then (wavefront) reopens blocks
whose left context changed and measures the frontier's readiness, and packs per block row:

    readout (N, K + 6) int64 = [ids after the step (K) | converged | ready | bad | done | edits
                                | gated]

converged: the next step reports the block done on entry (its next forward is its final one);
ready: its readiness exceeds the spawn threshold (wavefront only, else 0); bad: a non-finite
confidence (NaN / inf logits: the row's request must fail); done: done on entry this step;
edits: T2T edits the block has had; gated: the row still waits for its predecessor (a batch
with gates: dllm/wavefront.py `open_gates`; such a row leaves the step as it entered it, and
its flags are 0). One device-to-host copy of `readout` per forward is all the
host needs. Nothing here synchronises with the host. On CUDA the readout is packed in one
launch (kernels/readout.py; `pack_readout_torch` elsewhere, its oracle: with gates it also
masks the waiting rows' flags and writes the flags the next step's gates read), and the
wavefront's flags (reopen, readiness) and the gates' opening come from one launch each
(kernels/wavefront_flags.py; `wavefront_flags_torch` and `open_gates` elsewhere).

If the step raises, the batch is restored from a snapshot and stepped one request at a time, so
only the requests whose step raises fail (their rows come back unchanged and `bad`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm, State, StepOutput
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.wavefront import open_gates, wavefront_flags_torch
from dllm_serve.kernels.readout import FLAG_COLUMNS, pack_readout, pack_readout_torch
from dllm_serve.kernels.wavefront_flags import open_gates_fused, wavefront_flags
from dllm_serve.model.head import Scores, as_logits

logger = logging.getLogger(__name__)

FLAGS = ("converged", "ready", "bad", "done", "edits", "gated")  # readout columns K, K + 1, ...
assert len(FLAGS) == FLAG_COLUMNS


@dataclass(frozen=True)
class StepSpec:
    wavefront: bool  # W > 1: reopen later blocks on a change, measure readiness
    token_threshold: float = 0.9  # tau
    spawn_threshold: float = 0.6  # theta


def denoise_step(algo: DllmAlgorithm, batch: DenoiseBatch, logits: Scores,
                 state: State | None, spec: StepSpec, isolate: bool = True,
                 gates_open: bool = False) -> tuple[torch.Tensor, list[int]]:
    """logits (N * K, V) or a HeadInput -> (readout (N, K + 6) int64, requests whose step
    raised).
    isolate=False (a step being captured in a CUDA graph): an exception propagates.
    gates_open: the caller knows no row of a batch with gates waits (every gate is 0): the
    gates are not tested and nothing is held (the rows' flags are still written for the gates
    placed later)."""
    ids = batch.block_ids
    before = ids.clone() if spec.wavefront or isolate else None  # (a graph's step: no restore)
    gates = open_gates_fused if ids.is_cuda else open_gates
    waiting = None if batch.gates is None or gates_open else gates(
        *batch.gates, batch.row_req, batch.row_start, batch.block_size)  # (N,) bool
    saved = (None if state is None or not (isolate or waiting is not None)
             else {k: v.clone() for k, v in state.items()})
    failed: list[int] = []
    try:
        out = algo.step(batch, logits, state)
    except Exception:
        if not isolate:
            raise
        logger.exception("the decoding step raised; stepping request by request")
        assert before is not None
        out, failed = step_each_request(algo, batch, logits, state, before, saved)
    ready = None
    if spec.wavefront:
        assert before is not None
        flags = wavefront_flags if ids.is_cuda else wavefront_flags_torch
        changed, ready = flags(ids, before, out.confidence, batch.row_req, batch.row_start,
                               algo.mask_id, spec.token_threshold, spec.spawn_threshold)
        algo.reopen(state, changed)
    if waiting is not None:  # waiting rows leave as they entered: all masks, their state
        hold(ids, state, saved, waiting, algo.mask_id)
    converged = algo.converged(batch, state)
    pack = pack_readout if ids.is_cuda else pack_readout_torch
    # waiting rows report no flags; the next step's gates read the flags the pack writes
    return pack(ids, out.confidence, converged, ready, out.done, algo.edits(state), waiting,
                None if batch.gates is None else batch.gates[1]), failed


def hold(ids: torch.Tensor, state: State | None, saved: State | None, waiting: torch.Tensor,
         mask_id: int) -> None:
    """Rows `waiting` (N,) bool := all masks and their state before the step (`saved`)."""
    ids.masked_fill_(waiting[:, None], mask_id)
    for key, value in (state or {}).items():
        assert saved is not None
        keep = waiting.view(-1, *[1] * (value.dim() - 1))
        torch.where(keep, saved[key], value, out=value)  # (one launch: out is value itself)


def step_each_request(algo: DllmAlgorithm, batch: DenoiseBatch, logits: Scores,
                      state: State | None, before: torch.Tensor, saved: State | None,
                      ) -> tuple[StepOutput, list[int]]:
    """The step run per request on the same logits (after restoring the snapshot); requests
    whose step raises keep their rows unchanged and get NaN confidences."""
    restore(batch.block_ids, state, before, saved)
    n, k = batch.size, batch.block_size
    done = torch.zeros(n, dtype=torch.bool, device=batch.block_ids.device)
    conf = torch.full((n, k), float("nan"), device=batch.block_ids.device)
    rows_logits = as_logits(logits).view(n, k, -1)
    failed = []
    for b in range(len(batch.num_blocks)):
        one, rows = batch.select(b)
        sub = None if state is None else {key: v[rows] for key, v in state.items()}
        try:
            out = algo.step(one, rows_logits[rows].reshape(-1, rows_logits.shape[-1]), sub)
        except Exception:
            logger.exception("the decoding step raised for request row %d", b)
            failed.append(b)
            restore(batch.block_ids, state, before, saved, rows)
            continue
        if state is not None and sub is not None:
            for key, value in sub.items():
                state[key][rows] = value
        done[rows], conf[rows] = out.done, out.confidence
    return StepOutput(done, conf), failed


def restore(ids: torch.Tensor, state: State | None, before: torch.Tensor, saved: State | None,
            rows: slice = slice(None)) -> None:
    ids[rows] = before[rows]
    if state is not None and saved is not None:
        for key, value in saved.items():
            state[key][rows] = value[rows]
