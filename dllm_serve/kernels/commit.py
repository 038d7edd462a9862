"""LowConfidence's commit in one launch: unmask every masked position whose confidence clears
the row's threshold, or the most confident one when none does (oracle: `LowConfidence.commit`,
dllm/algorithms/low_confidence.py, its CPU path).

Per row of ids (N, K) with predictions x (N, K) and confidences p (N, K): masked = ids ==
mask_id; conf = p where masked, else -inf; transfer = conf > threshold; a row with masks and no
transfer takes its first argmax of conf (torch.argmax's pick: NaN counts as the largest, ties go
to the first); ids = x where transfer and masked. Returns done (N,) bool = the row had no mask on
entry. The threshold is the config's, or per row params[row_req[n]] (requests that override it).
In torch this was fourteen launches a step; here one program per row (ROWS in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import cdiv, check_device, interpreted, next_pow2


def commit_confident(ids: torch.Tensor, x: torch.Tensor, p: torch.Tensor, mask_id: int,
                     threshold: float, params: torch.Tensor | None = None,
                     row_req: torch.Tensor | None = None) -> torch.Tensor:
    """ids (N, K) int64 (edited in place), x (N, K) int64, p (N, K) float -> done
    (N,) bool, as `LowConfidence.commit`; the threshold per row is params[row_req] when params
    (R,) is given, else `threshold`."""
    check_device(ids, "commit_confident")
    n, k = ids.shape
    done = torch.empty(n, dtype=torch.bool, device=ids.device)
    if n == 0:
        return done
    per_row = params is not None
    if per_row and row_req is None:
        raise ValueError("commit_confident: per-request thresholds need row_req")
    work = ids if ids.is_contiguous() else ids.contiguous()
    rows = min(next_pow2(n), 32) if interpreted() else 1
    _commit_kernel[(cdiv(n, rows),)](
        work, x.contiguous(), p.contiguous(), params if per_row else p,
        row_req if per_row else work, done, n, mask_id, float(threshold), K=k,
        BLOCK_K=next_pow2(k), ROWS=rows, PER_ROW=per_row, num_warps=1)
    if work is not ids:
        ids.copy_(work)
    return done


@triton.jit
def _commit_kernel(Ids, X, P, Params, RowReq, Done, n_rows, mask_id, threshold,
                   K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                   PER_ROW: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    c = tl.arange(0, BLOCK_K)
    live = r < n_rows
    inside = live[:, None] & (c < K)[None, :]
    at = r.to(tl.int64)[:, None] * K + c[None, :]
    ids = tl.load(Ids + at, mask=inside, other=0)
    masked = (ids == mask_id) & inside
    p = tl.load(P + at, mask=inside, other=0.0).to(tl.float32)
    conf = tl.where(masked, p, float("-inf"))
    if PER_ROW:
        req = tl.load(RowReq + r, mask=live, other=0)
        thr = tl.load(Params + req, mask=live, other=0.0).to(tl.float32)
    else:
        thr = tl.zeros([ROWS], tl.float32) + threshold
    transfer = conf > thr[:, None]
    # torch.argmax: NaN is the largest, the first of equal maxima wins
    key = tl.where(conf != conf, float("inf"), conf)
    key = tl.where(inside, key, float("-inf"))
    top = tl.max(key, 1)  # (ROWS,)
    nan_row = tl.max(tl.where(inside & (conf != conf), 1, 0), 1) > 0
    hit = tl.where(nan_row[:, None], conf != conf, key == top[:, None]) & inside
    first = tl.min(tl.where(hit, c[None, :], BLOCK_K), 1)  # (ROWS,)
    has_mask = tl.max(masked.to(tl.int32), 1) > 0
    need = has_mask & (tl.max(transfer.to(tl.int32), 1) == 0)
    transfer = (transfer | ((c[None, :] == first[:, None]) & need[:, None])) & masked
    x = tl.load(X + at, mask=inside, other=0)
    tl.store(Ids + at, tl.where(transfer, x, ids), mask=inside)
    tl.store(Done + r, ~has_mask, mask=live)
