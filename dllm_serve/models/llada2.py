"""LLaDA2.x (`LLaDA2MoeModelLM`, model_type `llada2_moe`): a block-diffusion MoE transformer.

The shared decoder (models/decoder.py) with LLaDA2's choices: a fused `query_key_value`
projection, per-head RMSNorm on q and k before partial NeoX RoPE, GQA; per layer a dense SwiGLU
for layers < first_k_dense_replace, else a routed MoE (sigmoid scores, expert bias for
selection, group-limited top-k) plus shared experts. `WEIGHTS` maps LLaDA2's HF tensor names
onto the decoder's parameters.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dllm_serve.layers.mlp import SwiGLUMLP
from dllm_serve.layers.moe import SparseMoeBlock
from dllm_serve.models.decoder import TIED_LM_HEAD, DecoderLM
from dllm_serve.models.llada2_config import LLaDA2Config
from dllm_serve.models.registry import MODELS
from dllm_serve.models.weights import PackedWeight, WeightMap

# HF tensor names -> the decoder's parameters (everything else loads by its own name).
PACKED_WEIGHTS = (
    PackedWeight("embed_tokens.weight", ("word_embeddings.weight",)),
    PackedWeight("self_attn.qkv_proj.weight", ("attention.query_key_value.weight",)),
    PackedWeight("self_attn.qkv_proj.bias", ("attention.query_key_value.bias",)),
    PackedWeight("self_attn.q_norm.weight", ("attention.query_layernorm.weight",)),
    PackedWeight("self_attn.k_norm.weight", ("attention.key_layernorm.weight",)),
    PackedWeight("self_attn.o_proj.weight", ("attention.dense.weight",)),
    PackedWeight("self_attn.o_proj.bias", ("attention.dense.bias",)),
    PackedWeight("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),
    PackedWeight("experts.w13", ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight")),
    PackedWeight("experts.w2", ("experts.{e}.down_proj.weight",)),
)
IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)
# The router weight stays fp32 when router_dtype is "fp32" (HF computes router logits in fp32);
# expert_bias always does: it only shifts fp32 scores, and bf16 would blur near-tied choices.
ROUTER_FP32 = ("mlp.gate.weight",)
ALWAYS_FP32 = ("mlp.gate.expert_bias",)


def llada2_mlp(cfg: LLaDA2Config, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s MLP: dense SwiGLU, or routed experts + shared experts."""
    if not cfg.is_moe_layer(layer_id):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                          cfg.routing, cfg.expert_bias, cfg.router_fp32,
                          cfg.moe_intermediate_size * cfg.num_shared_experts)


def llada2_weight_map(cfg: LLaDA2Config) -> WeightMap:
    return WeightMap(packed=PACKED_WEIGHTS, tied=TIED_LM_HEAD if cfg.tie_word_embeddings else (),
                     ignored=IGNORED_WEIGHTS,
                     fp32=ALWAYS_FP32 + (ROUTER_FP32 if cfg.router_fp32 else ()))


@MODELS.register("LLaDA2MoeModelLM")
class LLaDA2MoeModelLM(DecoderLM):
    """The whole LM, built from the raw config.json dict; weights come from the loader."""

    def __init__(self, hf: dict[str, Any]) -> None:
        cfg = LLaDA2Config.from_hf(hf)
        super().__init__(cfg.decoder_spec, lambda i: llada2_mlp(cfg, i), llada2_weight_map(cfg),
                         init_std=float(hf.get("initializer_range", 0.02)))
        self.config = cfg
