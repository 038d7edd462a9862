"""The step's readout in one launch (dllm/denoise_step.py packs it; oracle `pack_readout_torch`).

    readout (N, K + 6) int64 = [ids (K) | converged | ready | bad | done | edits | gated]

bad: a non-finite confidence in the row; gated: the row still waits for its predecessor
(dllm/wavefront.py `open_gates`; 0 where the batch has no gates), and then its converged,
ready and done are reported 0. `flags_out` (N,) int64, when given, receives each row's flags as
the next step's gates read them: converged | ready << 1 (the wavefront's CONVERGED = 1,
READY = 2), after that masking. Packed with torch the readout took
eleven launches a step (the finite test, its row reduction, five casts, a stack and a cat), each a
microsecond or two at any batch: on the built-in model's rounds of ~0.35 ms a few percent of the
round. One program per row (ROWS rows per program in the interpreter, where each program costs a
Python loop). Graph-capturable: shapes only, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dllm_serve.kernels.runtime import cdiv, check_device, interpreted, next_pow2
from dllm_serve.kernels.triton_utils import row_block

FLAG_COLUMNS = 6  # converged, ready, bad, done, edits, gated


def pack_readout_torch(ids: torch.Tensor, confidence: torch.Tensor, converged: torch.Tensor,
                       ready: torch.Tensor | None, done: torch.Tensor,
                       edits: torch.Tensor | None, gated: torch.Tensor | None = None,
                       flags_out: torch.Tensor | None = None) -> torch.Tensor:
    """ids (N, K) int64, confidence (N, K) float, converged / ready / done / gated (N,) bool,
    edits (N,) int (None: zeros, as ready and gated) -> readout (N, K + 6) int64; the rows
    `gated` report no converged / ready / done; `flags_out` (N,) int64 := converged | ready << 1
    (in place, any stride). The reference and the CPU path."""
    if gated is not None:
        converged, done = converged & ~gated, done & ~gated
        ready = None if ready is None else ready & ~gated
    if flags_out is not None:
        flags_out.copy_(converged.long() if ready is None
                        else converged.long() | ready.long() << 1)
    zeros = torch.zeros_like(done, dtype=torch.int64)
    bad = ~torch.isfinite(confidence).all(1)
    flags = torch.stack([converged.long(), zeros if ready is None else ready.long(), bad.long(),
                         done.long(), zeros if edits is None else edits.long(),
                         zeros if gated is None else gated.long()], 1)
    return torch.cat([ids, flags], 1)


def pack_readout(ids: torch.Tensor, confidence: torch.Tensor, converged: torch.Tensor,
                 ready: torch.Tensor | None, done: torch.Tensor,
                 edits: torch.Tensor | None, gated: torch.Tensor | None = None,
                 flags_out: torch.Tensor | None = None) -> torch.Tensor:
    """`pack_readout_torch` in one Triton launch (same arguments, same result)."""
    check_device(ids, "pack_readout")
    n, k = ids.shape
    out = torch.empty(n, k + FLAG_COLUMNS, dtype=torch.int64, device=ids.device)
    if n == 0:
        return out
    ids, confidence = ids.contiguous(), confidence.contiguous()
    converged, done = converged.contiguous(), done.contiguous()  # (the kernel reads unit stride)
    flags = [done if t is None else t.contiguous() for t in (ready, edits, gated)]  # None: unread
    rows = min(next_pow2(n), 32) if interpreted() else 1
    _readout_kernel[(cdiv(n, rows),)](
        ids, confidence, converged, done, *flags, out, done if flags_out is None else flags_out,
        n, 0 if flags_out is None else flags_out.stride(0), K=k, BLOCK_K=next_pow2(k),
        ROWS=rows, HAS_READY=ready is not None, HAS_EDITS=edits is not None,
        HAS_GATED=gated is not None, HAS_FLAGS_OUT=flags_out is not None, num_warps=1)
    return out


@triton.jit
def _readout_kernel(Ids, Conf, Converged, Done, Ready, Edits, Gated, Out, FlagsOut, n_rows,
                    flags_stride, K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                    HAS_READY: tl.constexpr, HAS_EDITS: tl.constexpr, HAS_GATED: tl.constexpr,
                    HAS_FLAGS_OUT: tl.constexpr):
    r, c, live, mask, at = row_block(n_rows, K, BLOCK_K, ROWS)
    ids = tl.load(Ids + at, mask=mask, other=0)
    conf = tl.load(Conf + at, mask=mask, other=0.0).to(tl.float32)
    finite = (conf == conf) & (tl.abs(conf) != float("inf"))
    bad = tl.max(tl.where(mask & ~finite, 1, 0), 1)  # (ROWS,)
    if HAS_GATED:
        gated = tl.load(Gated + r, mask=live, other=0).to(tl.int64)
    else:
        gated = tl.zeros([ROWS], tl.int64)
    keep = 1 - gated  # a waiting row reports no converged / ready / done
    converged = tl.load(Converged + r, mask=live, other=0).to(tl.int64) * keep
    if HAS_READY:
        ready = tl.load(Ready + r, mask=live, other=0).to(tl.int64) * keep
    else:
        ready = tl.zeros([ROWS], tl.int64)
    row = Out + r.to(tl.int64) * (K + 6)
    tl.store(row[:, None] + c[None, :], ids.to(tl.int64), mask=mask)
    tl.store(row + K, converged, mask=live)
    tl.store(row + K + 1, ready, mask=live)
    tl.store(row + K + 2, bad.to(tl.int64), mask=live)
    tl.store(row + K + 3, tl.load(Done + r, mask=live, other=0).to(tl.int64) * keep, mask=live)
    if HAS_EDITS:
        edits = tl.load(Edits + r, mask=live, other=0).to(tl.int64)
    else:
        edits = tl.zeros([ROWS], tl.int64)
    tl.store(row + K + 4, edits, mask=live)
    tl.store(row + K + 5, gated, mask=live)
    if HAS_FLAGS_OUT:
        tl.store(FlagsOut + r * flags_stride, converged | (ready << 1), mask=live)
