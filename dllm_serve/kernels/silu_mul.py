"""The SwiGLU activation silu(gate) * up in one launch (SILU_MUL_KERNELS "triton"); oracle
`layers.mlp.silu_and_mul` (F.silu, then a multiply: two launches).

It computes what PyTorch computes, in the same roundings: silu(g) = g / (1 + exp(-g)) in fp32
(CUDA's expf and an IEEE division: libdevice's exp and div_rn, not Triton's approximate
tl.exp and division), rounded to the input dtype as F.silu's output is; then the product of
that and up in fp32, rounded once. On the GPU the result should equal the oracle bit for bit
(tested by the `gpu` tests; the product of two bf16 values is exact in fp32; Triton builds
libdevice with flush-to-zero, which only touches exp(-g) where that is subnormal, g > 87,
where 1 + exp(-g) is 1 either way). The interpreter has no libdevice (np.exp there) and casts
to bf16 toward zero, so on the CPU bf16 results are within a bf16 step or two of the oracle's.
Rows are contiguous in their last dim; ROWS rows per program (1 on the GPU; many in the
interpreter, where each program costs a Python loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dllm_serve.kernels.runtime import as_rows, cdiv, check_device, interpreted, next_pow2
from dllm_serve.layers.mlp import SILU_MUL_KERNELS

MAX_BLOCK = 1024  # columns per program


@SILU_MUL_KERNELS.register("triton")
def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (..., 2I) = [gate | up] -> silu(gate) * up (..., I) in gate_up's dtype."""
    check_device(gate_up, "fused_silu_mul")
    inter = gate_up.shape[-1] // 2
    rows = as_rows(gate_up)  # (R, 2I)
    n = rows.shape[0]
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n and inter:
        per_program = min(next_pow2(n), 32) if interpreted() else 1
        block = min(next_pow2(inter), MAX_BLOCK)
        _silu_mul_kernel[(cdiv(n, per_program), cdiv(inter, block))](
            rows, out, n, rows.stride(0), inter, BLOCK=block, ROWS=per_program,
            LIBDEVICE=not interpreted(), num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def _silu_mul_kernel(GateUp, Out, n_rows, stride, inter, BLOCK: tl.constexpr,
                     ROWS: tl.constexpr, LIBDEVICE: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # (ROWS,)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = (r < n_rows)[:, None] & (c < inter)[None, :]
    at = GateUp + r[:, None] * stride + c[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + inter, mask=mask, other=0.0)
    if LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e).to(up.dtype)  # F.silu's output, in the input dtype
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(Out + r[:, None] * inter + c[None, :], out.to(Out.dtype.element_ty), mask=mask)
