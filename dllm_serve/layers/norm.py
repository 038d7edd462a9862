"""RMSNorm as LLaDA2 / Llama define it: fp32 statistics, weight applied in the input dtype.

`RMSNorm` computes in plain PyTorch (the oracle) unless its `kernel_backend` names a fused
kernel registered in `NORM_KERNELS` ("triton": dllm_serve.kernels.norm); see layers/fused.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dllm_serve.utils.registry import Registry

# (x (..., dim), weight (dim,), eps, residual (..., dim) | None) -> normed, or with a residual
# (normed, residual + x): the same values as `RMSNorm`'s plain path.
NormKernel = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None],
                      torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
NORM_KERNELS: Registry[NormKernel] = Registry("norm kernel backend")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim (the reference).

    The variance is computed in fp32 and the normalised value is cast back to the input dtype
    *before* the weight is applied, as in the HF models (this order matters in bf16).
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """`rms_norm` with a learned weight; with a residual, the residual add is fused in."""

    kernel_backend = "torch"  # "torch" (plain PyTorch) or a NORM_KERNELS name

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (..., dim) -> (..., dim), same dtype as x. With `residual`: h = residual + x,
        returns (norm(h), h)."""
        if self.kernel_backend != "torch":
            return NORM_KERNELS.get(self.kernel_backend)(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        h = residual + x
        return rms_norm(h, self.weight, self.eps), h
