"""One switch for a model's fused elementwise kernels (RMSNorm, residual add + RMSNorm, q/k
RMSNorm + partial RoPE, the SwiGLU activation).

A module that has a fused variant declares `kernel_backend = "torch"` (plain PyTorch, the
oracle: the default, and the path on the CPU); `set_kernel_backend(model, "triton")` switches
every such module to the kernels registered under that name in `layers.norm.NORM_KERNELS`,
`layers.rotary.QK_ROPE_KERNELS` and `layers.mlp.SILU_MUL_KERNELS` (dllm_serve.kernels
registers "triton").
"""

from __future__ import annotations

from torch import nn

from dllm_serve.layers.mlp import SILU_MUL_KERNELS
from dllm_serve.layers.norm import NORM_KERNELS
from dllm_serve.layers.rotary import QK_ROPE_KERNELS


def set_kernel_backend(model: nn.Module, name: str) -> None:
    """Run every fusable op of `model` with backend `name` ("torch" or a registered kernel
    backend); unknown names raise KeyError listing the known ones."""
    if name != "torch":
        NORM_KERNELS.get(name)
        QK_ROPE_KERNELS.get(name)
        SILU_MUL_KERNELS.get(name)
    for module in model.modules():
        if hasattr(module, "kernel_backend"):
            module.kernel_backend = name
