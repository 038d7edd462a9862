"""The wavefront's per-step flags and its gates, one launch each (dllm/denoise_step.py; oracles
`dllm.wavefront.wavefront_flags_torch` and `dllm.wavefront.open_gates`).

For N block rows of K tokens after a step (ids), before it (before) and the step's confidences:

    changed_earlier (N,) bool: some block of the same request (row_req) at an earlier position
                               (row_start) had a token change in this step;
    ready (N,) bool: readiness rho = (masked positions before the step whose confidence >= tau)
                     / (masked positions before the step), 1 with none masked, exceeds theta.

Computed with torch these took about eighteen launches a step at W > 1 (a clone's compare and
row reduction, the (N, N) request / position comparisons, the readiness sums, division and
threshold), ~25-30 us of a built-in-model forward of ~0.28 ms on an H200: what W = 2 cost per
forward over W = 1 even where it never spawned. Each program takes ROWS rows and walks every
row's change flag in BLOCK_J chunks (N x K loads a program; N is a few hundred at most).

`open_gates_fused`: before a step with gated rows, which rows still wait for their predecessor
(`dllm.wavefront.open_gates`: the (N, N) predecessor match and the gate test, about ten launches
with torch), the opened rows' gates cleared in place. Graph-capturable: shapes only, no host
sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import cdiv, check_device, next_pow2

ROWS = 16  # rows a program decides (fewer when the batch has fewer)
BLOCK_J = 32  # rows whose change flags / flags one inner step reads


def wavefront_flags(ids: torch.Tensor, before: torch.Tensor, confidence: torch.Tensor,
                    row_req: torch.Tensor, row_start: torch.Tensor, mask_id: int, tau: float,
                    theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, before (N, K) int, confidence (N, K) float, row_req / row_start (N,) int ->
    (changed_earlier, ready), each (N,) bool: `wavefront_flags_torch`'s result in one launch."""
    check_device(ids, "wavefront_flags")
    n, k = ids.shape
    changed = torch.empty(n, dtype=torch.uint8, device=ids.device)
    ready = torch.empty(n, dtype=torch.uint8, device=ids.device)
    if n:
        rows = min(next_pow2(n), ROWS)
        _flags_kernel[(cdiv(n, rows),)](
            ids.contiguous(), before.contiguous(), confidence.contiguous(),
            row_req.contiguous(), row_start.contiguous(), changed, ready, n, mask_id,
            float(tau), float(theta), K=k, BLOCK_K=next_pow2(k), ROWS=rows, BLOCK_J=BLOCK_J,
            num_warps=4)
    return changed.view(torch.bool), ready.view(torch.bool)


@triton.jit
def _flags_kernel(Ids, Before, Conf, RowReq, RowStart, Changed, Ready, n, mask_id, tau, theta,
                  K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_J: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_K)
    live = i < n
    inside = live[:, None] & (c < K)[None, :]
    at = i.to(tl.int64)[:, None] * K + c[None, :]
    masked = inside & (tl.load(Before + at, mask=inside, other=0) == mask_id)
    confident = tl.load(Conf + at, mask=inside, other=0.0).to(tl.float32) >= tau
    n_masked = tl.sum(masked.to(tl.int32), 1)
    n_ready = tl.sum((masked & confident).to(tl.int32), 1)
    rho = tl.where(n_masked > 0, n_ready.to(tl.float32) / tl.maximum(n_masked, 1).to(tl.float32),
                   1.0)
    tl.store(Ready + i, (rho > theta).to(tl.uint8), mask=live)
    req = tl.load(RowReq + i, mask=live, other=-1)
    start = tl.load(RowStart + i, mask=live, other=0)
    hit = tl.zeros([ROWS], tl.int32)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_live = j < n
        j_inside = j_live[:, None] & (c < K)[None, :]
        j_at = j.to(tl.int64)[:, None] * K + c[None, :]
        diff = (tl.load(Ids + j_at, mask=j_inside, other=0)
                != tl.load(Before + j_at, mask=j_inside, other=0))
        changed_j = tl.max(diff.to(tl.int32), 1) > 0  # (BLOCK_J,)
        req_j = tl.load(RowReq + j, mask=j_live, other=-1)
        start_j = tl.load(RowStart + j, mask=j_live, other=0)
        earlier = ((req[:, None] == req_j[None, :]) & (start_j[None, :] < start[:, None])
                   & changed_j[None, :] & j_live[None, :])  # (ROWS, BLOCK_J)
        hit = tl.maximum(hit, tl.max(earlier.to(tl.int32), 1))
    tl.store(Changed + i, hit.to(tl.uint8), mask=live)


def open_gates_fused(gate: torch.Tensor, flag: torch.Tensor, row_req: torch.Tensor,
                     row_start: torch.Tensor, block_size: int) -> torch.Tensor:
    """`dllm.wavefront.open_gates` in one launch: gate / flag (N,) int64, any stride (gate
    cleared in place where the row opens), row_req / row_start (N,) -> waiting (N,) bool."""
    check_device(gate, "open_gates_fused")
    n = gate.shape[0]
    waiting = torch.empty(n, dtype=torch.uint8, device=gate.device)
    if n:
        rows = min(next_pow2(n), ROWS)
        _gates_kernel[(cdiv(n, rows),)](gate, flag, row_req.contiguous(), row_start.contiguous(),
                                        waiting, n, block_size, gate.stride(0), flag.stride(0),
                                        ROWS=rows, BLOCK_J=BLOCK_J, num_warps=4)
    return waiting.view(torch.bool)


@triton.jit
def _gates_kernel(Gate, Flag, RowReq, RowStart, Waiting, n, block_size, gate_stride,
                  flag_stride, ROWS: tl.constexpr, BLOCK_J: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = i < n
    gate = tl.load(Gate + i * gate_stride, mask=live, other=0)
    req = tl.load(RowReq + i, mask=live, other=-1)
    want = tl.load(RowStart + i, mask=live, other=0) - block_size  # the predecessor's start
    has_pred = tl.zeros([ROWS], tl.int32)
    hit = tl.zeros([ROWS], tl.int32)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_live = j < n
        pred = ((req[:, None] == tl.load(RowReq + j, mask=j_live, other=-1)[None, :])
                & (tl.load(RowStart + j, mask=j_live, other=0)[None, :] == want[:, None])
                & j_live[None, :])  # (ROWS, BLOCK_J): j is the block before i
        opens = (tl.load(Flag + j * flag_stride, mask=j_live, other=0)[None, :]
                 & gate[:, None]) != 0
        has_pred = tl.maximum(has_pred, tl.max(pred.to(tl.int32), 1))
        hit = tl.maximum(hit, tl.max((pred & opens).to(tl.int32), 1))
    waiting = (gate != 0) & (has_pred > 0) & (hit == 0)
    tl.store(Waiting + i, waiting.to(tl.uint8), mask=live)
    tl.store(Gate + i * gate_stride, gate * waiting.to(gate.dtype), mask=live)
