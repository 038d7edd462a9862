"""Triton device functions shared by several kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, F32: tl.constexpr):
    """tl.dot with fp32 accumulation; F32 upcasts the operands first (the CPU interpreter's
    bf16 dot is wrong, see runtime.py); on the GPU bf16 operands stay bf16."""
    if F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b)


@triton.jit
def row_block(n_rows, K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """This program's ROWS rows of a row-major (n_rows, K) tensor: rows r (ROWS,), columns c
    (BLOCK_K,), live rows (ROWS,), the in-bounds mask (ROWS, BLOCK_K) and offsets `at`."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_K)
    live = r < n_rows
    inside = live[:, None] & (c < K)[None, :]
    at = r.to(tl.int64)[:, None] * K + c[None, :]
    return r, c, live, inside, at
