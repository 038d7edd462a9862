"""Rotary position embedding (NeoX "rotate half" layout), optionally on a leading part of a head.

With `rotary_dim < head_dim` only the first `rotary_dim` dims of each head rotate; the rest pass
through unchanged ("partial rotary", LLaDA2 uses 64 of 128). Frequencies are those of the
transformers "default" rope: inv_freq[i] = 1 / theta^(2i / rotary_dim).
`QK_ROPE_KERNELS` holds fused per-head RMSNorm + RoPE kernels for q and k ("triton":
dllm_serve.kernels.rope), used by attention modules whose `kernel_backend` names one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from dllm_serve.utils.registry import Registry

if TYPE_CHECKING:
    from dllm_serve.layers.attention import KvTarget


class QkRopeKernel(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, v: torch.Tensor | None = None,
                 target: KvTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, D), k (T, KVH, D), the q / k norm weights (D,) or None, cos / sin (T, R)
        -> (q, k) normed (when weights are given) then rotated; the kernel may write into q and
        k in place. With v (T, KVH, D) and a target it also stores the resulting k and v at
        the target's slots."""
        ...


QK_ROPE_KERNELS: Registry[QkRopeKernel] = Registry("q/k norm + RoPE kernel backend")


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for absolute positions; holds no loadable weights."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device: torch.device | None) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device)
        return 1.0 / (self.theta ** (exponent.float() / self.rotary_dim))  # (rotary_dim/2,)

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute `inv_freq` (fp32) on `device`; called after building on the meta device."""
        self.inv_freq = self._inv_freq(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int -> cos, sin (T, rotary_dim), computed in fp32, cast to `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, rotary_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, rotary_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., 2n) -> (..., 2n): [x1, x2] -> [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, N, D), cos/sin (T, R) with R <= D -> (T, N, D); dims [R, D) pass through."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, R)
    rot, rest = x[..., :rd], x[..., rd:]
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1)
