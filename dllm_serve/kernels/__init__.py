"""Triton kernels for the GPU hot path, each tested against its plain-PyTorch reference.

- block_attention / triton_attention: block-diffusion paged attention (`--attention-backend
  triton`); oracle `layers.attention.TorchAttention`.
- moe_route, moe_sort, fused_moe, moe_sum: device routing (summing the router's partial logits
  in the kernel), expert-sorted blocks (two or three short launches), grouped GEMMs (their
  launch table: moe_launch) and the weighted choice sum with the layer's addends and next
  norm (`--moe-backend triton`); oracles `layers.moe_router.route`,
  `moe_align.align_by_expert` and `moe_reference`.
- step: argmax and confidence over the vocabulary for greedy rows; oracle
  `DllmAlgorithm.predict`'s torch path.
- readout, commit, wavefront_flags: the step's glue in one launch each (the readout's packing,
  the algorithms' commits, the wavefront's reopen and readiness flags); oracles
  `pack_readout_torch`, the algorithms' `commit`, `dllm.wavefront.wavefront_flags_torch`.
- lm_head: the LM head's GEMM with that argmax and confidence in its epilogue (no logits
  tensor; the rows an algorithm does not read skipped), for the forward + step graphs; oracle
  `reference_head_greedy`.
- row_inbox: the worker's staged row writes applied in one launch inside the forward's graph;
  oracle `apply_rows_reference`.
- row_meta: a denoise forward's metadata computed from its rows' request keys and starts
  inside the forward's graph; oracle `write_row_meta_reference` (and graph_layout.fill_meta).
- norm, rope, silu_mul, kv_store: fused RMSNorm (with the residual add), q/k RMSNorm + partial
  RoPE (which also stores the layer's K/V when the attention backend names a `kv_target`),
  the SwiGLU activation silu(gate) * up, and the K/V store into the paged cache
  (`layers.fused.set_kernel_backend(model, "triton")`, and the Triton attention's store when
  no fused kernel stored them);
  oracles `layers.norm`, `SelfAttention.norm_rope`, `layers.mlp.silu_and_mul`,
  `AttentionBackend.store`.
- launch_fit (host side): of a launch table row's launches, the first the device's shared
  memory holds (the tables are tuned on an H100 / H200).

Importing this package registers the "triton" backends. Kernels run compiled on CUDA, or in
Triton's interpreter on the CPU when TRITON_INTERPRET=1 was set before this import.
"""

from __future__ import annotations

from dllm_serve.kernels import (
    fused_moe,  # noqa: F401 (registers "triton" MoE)
    norm,  # noqa: F401 (registers the "triton" norm kernels)
    rope,  # noqa: F401 (registers the "triton" q/k norm + RoPE kernel)
    silu_mul,  # noqa: F401 (registers the "triton" SwiGLU activation kernel)
    triton_attention,  # noqa: F401 (registers "triton" attention)
)
