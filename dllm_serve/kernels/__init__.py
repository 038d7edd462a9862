"""Triton kernels for the GPU hot path, each tested against its plain-PyTorch reference.

- block_attention / triton_attention: block-diffusion paged attention (`--attention-backend
  triton`); oracle `layers.attention.TorchAttention`.
- moe_route, moe_align, fused_moe: device routing, expert-sorted blocks and grouped GEMMs
  (`--moe-backend triton`); oracles `layers.moe.route` and `moe_reference`.
- step: argmax and confidence over the vocabulary for greedy rows; oracle
  `DllmAlgorithm.predict`'s torch path.

Importing this package registers the "triton" backends. Kernels run compiled on CUDA, or in
Triton's interpreter on the CPU when TRITON_INTERPRET=1 was set before this import.
"""

from __future__ import annotations

from dllm_serve.kernels import (
    fused_moe,  # noqa: F401 (registers "triton" MoE)
    triton_attention,  # noqa: F401 (registers "triton" attention)
)
