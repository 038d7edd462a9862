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
