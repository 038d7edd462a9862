"""The algorithms' commits in one launch each, from the predictions x (N, K) and confidences p
(N, K) of a step (oracles: `LowConfidence.commit` and `JointThreshold.commit`, their CPU paths,
dllm/algorithms/). In torch a commit was fourteen (LowConfidence) or about thirty
(JointThreshold) launches a step, each a microsecond or two at any batch; here one program per
block row (ROWS rows per program in the interpreter, where each program costs a Python loop).

M2T, both algorithms: masked = ids == mask_id; conf = p where masked, else -inf; unmask where
conf > threshold; a row with masks and no such position unmasks its first argmax of conf
(torch.argmax's pick: NaN counts as the largest, ties go to the first). A threshold is the
config's, or per row params[row_req[n]] where requests may override it (a graph's batch always
carries them). JointThreshold also rewrites written, non-prompt positions whose prediction
differs with p > edit_threshold (T2T), counts its steps without masks, and finishes a block that
changes nothing or exceeds max_post_edit_steps; its state tensors are edited in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import cdiv, check_device, interpreted, next_pow2
from dllm_serve.kernels.triton_utils import row_block


@dataclass(frozen=True)
class Threshold:
    """A threshold: `value` for every row, or params[row_req] per row when params is given."""

    value: float
    params: torch.Tensor | None = None  # (R,) float
    row_req: torch.Tensor | None = None  # (N,) int64

    def args(self, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
        """(params, row_req, value, per_row) for a launch (unused pointers: `fallback`)."""
        if self.params is None:
            return fallback, fallback, float(self.value), False
        if self.row_req is None:
            raise ValueError("per-request thresholds need row_req")
        return self.params.contiguous(), self.row_req.contiguous(), float(self.value), True


class RowParams(Protocol):
    """What `threshold_of` reads of a batch (dllm/batch.py's DenoiseBatch)."""

    params: dict[str, torch.Tensor]  # {name: (R,)} per-request values

    @property
    def row_req(self) -> torch.Tensor: ...  # (N,) int64: each row's index into them


def threshold_of(batch: RowParams, name: str, value: float) -> Threshold:
    """A batch's setting `name`: per row when its requests carry it, else `value`."""
    params = batch.params.get(name)
    return Threshold(value) if params is None else Threshold(value, params, batch.row_req)


def commit_confident(ids: torch.Tensor, x: torch.Tensor, p: torch.Tensor, mask_id: int,
                     threshold: Threshold) -> torch.Tensor:
    """ids (N, K) int64 (edited in place), x (N, K) int64, p (N, K) float -> done (N,) bool
    (no mask on entry), as `LowConfidence.commit`."""
    check_device(ids, "commit_confident")
    n, k = ids.shape
    done = torch.empty(n, dtype=torch.bool, device=ids.device)
    if n == 0:
        return done
    work = ids if ids.is_contiguous() else ids.contiguous()
    params, row_req, value, per_row = threshold.args(work)
    rows = _rows_per_program(n)
    _confident_kernel[(cdiv(n, rows),)](
        work, x.contiguous(), p.contiguous(), params, row_req, done, n, mask_id, value,
        K=k, BLOCK_K=next_pow2(k), ROWS=rows, PER_ROW=per_row, num_warps=1)
    if work is not ids:
        ids.copy_(work)
    return done


def commit_joint(ids: torch.Tensor, x: torch.Tensor, p: torch.Tensor, mask_id: int,
                 state: dict[str, torch.Tensor], threshold: Threshold, edit_threshold: Threshold,
                 max_post_edit_steps: int) -> torch.Tensor:
    """ids (N, K) int64 and JointThreshold's state (prompt_mask (N, K) bool, post_edit_steps,
    finished, t2t_edits (N,)) edited in place, x (N, K) int64, p (N, K) float -> done (N,)
    bool (finished on entry), as `JointThreshold.commit`."""
    check_device(ids, "commit_joint")
    n, k = ids.shape
    done = torch.empty(n, dtype=torch.bool, device=ids.device)
    if n == 0:
        return done
    edited = [ids] + [state[key] for key in ("post_edit_steps", "finished", "t2t_edits")]
    work = [t if t.is_contiguous() else t.contiguous() for t in edited]
    thr, thr_req, thr_value, thr_per_row = threshold.args(work[0])
    edit, edit_req, edit_value, edit_per_row = edit_threshold.args(work[0])
    rows = _rows_per_program(n)
    _joint_kernel[(cdiv(n, rows),)](
        work[0], x.contiguous(), p.contiguous(), state["prompt_mask"].contiguous(), *work[1:],
        thr, thr_req, edit, edit_req, done, n, mask_id, thr_value, edit_value,
        max_post_edit_steps, K=k, BLOCK_K=next_pow2(k), ROWS=rows, THR_PER_ROW=thr_per_row,
        EDIT_PER_ROW=edit_per_row, num_warps=1)
    for t, w in zip(edited, work, strict=True):
        if w is not t:
            t.copy_(w)
    return done


def _rows_per_program(n: int) -> int:
    return min(next_pow2(n), 32) if interpreted() else 1


@triton.jit
def _threshold(Params, RowReq, r, live, value, PER_ROW: tl.constexpr, ROWS: tl.constexpr):
    """(ROWS,) fp32: params[row_req[r]] or `value`."""
    if PER_ROW:
        req = tl.load(RowReq + r, mask=live, other=0)
        return tl.load(Params + req, mask=live, other=0.0).to(tl.float32)
    return tl.zeros([ROWS], tl.float32) + value


@triton.jit
def _m2t(conf, masked, inside, thr, c, BLOCK_K: tl.constexpr):
    """Unmask: conf > thr, or the first argmax of conf in a row with masks and none above."""
    transfer = conf > thr[:, None]
    nan = conf != conf
    key = tl.where(inside, tl.where(nan, float("inf"), conf), float("-inf"))
    top = tl.max(key, 1)  # (ROWS,)
    nan_row = tl.max(tl.where(inside & nan, 1, 0), 1) > 0
    hit = tl.where(nan_row[:, None], nan, key == top[:, None]) & inside
    first = tl.min(tl.where(hit, c[None, :], BLOCK_K), 1)  # (ROWS,)
    has_mask = tl.max(masked.to(tl.int32), 1) > 0
    need = has_mask & (tl.max(transfer.to(tl.int32), 1) == 0)
    return (transfer | ((c[None, :] == first[:, None]) & need[:, None])) & masked


@triton.jit
def _confident_kernel(Ids, X, P, Params, RowReq, Done, n_rows, mask_id, threshold,
                      K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                      PER_ROW: tl.constexpr):
    r, c, live, inside, at = row_block(n_rows, K, BLOCK_K, ROWS)
    ids = tl.load(Ids + at, mask=inside, other=0)
    masked = (ids == mask_id) & inside
    p = tl.load(P + at, mask=inside, other=0.0).to(tl.float32)
    conf = tl.where(masked, p, float("-inf"))
    thr = _threshold(Params, RowReq, r, live, threshold, PER_ROW, ROWS)
    transfer = _m2t(conf, masked, inside, thr, c, BLOCK_K)
    x = tl.load(X + at, mask=inside, other=0)
    tl.store(Ids + at, tl.where(transfer, x, ids), mask=inside)
    tl.store(Done + r, tl.max(masked.to(tl.int32), 1) == 0, mask=live)


@triton.jit
def _joint_kernel(Ids, X, P, PromptMask, PostSteps, Finished, Edits, ThrParams, ThrReq,
                  EditParams, EditReq, Done, n_rows, mask_id, threshold, edit_threshold,
                  max_post, K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                  THR_PER_ROW: tl.constexpr, EDIT_PER_ROW: tl.constexpr):
    r, c, live_row, inside, at = row_block(n_rows, K, BLOCK_K, ROWS)
    ids = tl.load(Ids + at, mask=inside, other=0)
    x = tl.load(X + at, mask=inside, other=0)
    p = tl.load(P + at, mask=inside, other=0.0).to(tl.float32)
    prompt = tl.load(PromptMask + at, mask=inside, other=0) != 0
    done = tl.load(Finished + r, mask=live_row, other=0) != 0  # (ROWS,) finished on entry
    masked = (ids == mask_id) & inside
    has_mask = tl.max(masked.to(tl.int32), 1) > 0
    post = ~done & ~has_mask
    steps = tl.load(PostSteps + r, mask=live_row, other=0) + post.to(tl.int64)
    over = post & (steps > max_post)
    live = ~done & ~over
    conf = tl.where(masked, p, float("-inf"))
    thr = _threshold(ThrParams, ThrReq, r, live_row, threshold, THR_PER_ROW, ROWS)
    m2t = _m2t(conf, masked, inside, thr, c, BLOCK_K)
    edit = _threshold(EditParams, EditReq, r, live_row, edit_threshold, EDIT_PER_ROW, ROWS)
    t2t = (p > edit[:, None]) & (ids != x) & ~masked & ~prompt & inside
    transfer = (m2t | t2t) & live[:, None]
    changed = tl.max(transfer.to(tl.int32), 1) > 0
    edits = tl.sum((t2t & live[:, None]).to(tl.int64), 1)
    tl.store(Ids + at, tl.where(transfer, x, ids), mask=inside)
    tl.store(PostSteps + r, steps, mask=live_row)
    tl.store(Finished + r, done | over | (live & ~changed), mask=live_row)
    tl.store(Edits + r, tl.load(Edits + r, mask=live_row, other=0) + edits, mask=live_row)
    tl.store(Done + r, done, mask=live_row)
