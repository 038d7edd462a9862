"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused in one weight.

`SwiGLUMLP` computes the activation silu(gate) * up in plain PyTorch (`silu_and_mul`, the
oracle) unless its `kernel_backend` names a kernel registered in `SILU_MUL_KERNELS` ("triton":
dllm_serve.kernels.silu_mul, one launch instead of two); see layers/fused.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.utils.registry import Registry

# gate_up (..., 2I) = [gate | up] -> (..., I) in gate_up's dtype: the values of `silu_and_mul`.
SiluMulKernel = Callable[[torch.Tensor], torch.Tensor]

SILU_MUL_KERNELS: Registry[SiluMulKernel] = Registry("SwiGLU activation kernel backend")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (..., 2I) = [gate | up] -> silu(gate) * up (..., I), the reference: silu
    computed in fp32 and rounded to the dtype, then the product computed in fp32 and rounded
    (what two PyTorch elementwise ops do in bf16)."""
    gate, up = gate_up.chunk(2, dim=-1)  # (..., I) each
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           act: SiluMulKernel = silu_and_mul) -> torch.Tensor:
    """x (N, hidden), gate_up (2I, hidden) = [gate rows | up rows], down (hidden, I).

    Returns (N, hidden); `act` computes silu(gate) * up (`silu_and_mul` or a fused kernel).
    """
    return F.linear(act(F.linear(x, gate_up)), down)


class SwiGLUMLP(nn.Module):
    """Bias-free SwiGLU MLP; `gate_up_proj.weight` (2I, hidden) = HF gate_proj over up_proj."""

    kernel_backend = "torch"  # "torch" (plain PyTorch) or a SILU_MUL_KERNELS name

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                norm: nn.Module | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (T, hidden); with residual (T, hidden): residual + that. With
        `norm` (the next layer's input norm): (out, norm(out))."""
        y = swiglu(x, self.gate_up_proj.weight, self.down_proj.weight, self._act())
        out = y if residual is None else residual + y
        return out if norm is None else (out, norm(out))

    def _act(self) -> SiluMulKernel:
        """The activation of `kernel_backend`: the oracle or a registered kernel."""
        return (silu_and_mul if self.kernel_backend == "torch"
                else SILU_MUL_KERNELS.get(self.kernel_backend))
