"""SDAR (`SDARForCausalLM`, `SDARMoeForCausalLM`): Qwen3 and Qwen3-MoE turned block-diffusion.

The shared decoder (models/decoder.py) with Qwen3's choices: separate q/k/v projections (packed
here into one `qkv_proj`), per-head RMSNorm on q and k before RoPE over the whole head, GQA,
SwiGLU MLPs. The MoE model's sparse layers route Qwen3-MoE's way: softmax over every expert,
top-k, renormalised when `norm_topk_prob`, no shared expert; the router's logits are computed
in the model dtype (HF's plain nn.Linear gate). Tensor names are Qwen3's; attention is
block-causal and logits are not shifted (row j scores the token at row j).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dllm_serve.layers.mlp import SwiGLUMLP
from dllm_serve.layers.moe import SparseMoeBlock
from dllm_serve.models.decoder import TIED_LM_HEAD, DecoderLM
from dllm_serve.models.registry import MODELS
from dllm_serve.models.sdar_config import SDARConfig
from dllm_serve.models.weights import PackedWeight, WeightMap

QKV_SOURCES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# HF tensor names -> the decoder's parameters (everything else loads by its own name).
MLP_WEIGHTS = (
    PackedWeight("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),
    PackedWeight("experts.w13", ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight")),
    PackedWeight("experts.w2", ("experts.{e}.down_proj.weight",)),
)
IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


def qkv_weights(cfg: SDARConfig) -> tuple[PackedWeight, ...]:
    """q_proj, k_proj, v_proj (weights, and biases with attention_bias) -> qkv_proj: rows of
    q (H * D), then k and v (KVH * D each)."""
    d = cfg.decoder
    sizes = (d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim)
    return tuple(PackedWeight(f"self_attn.qkv_proj.{kind}",
                              tuple(f"{s}.{kind}" for s in QKV_SOURCES), sizes)
                 for kind in ("weight", "bias"))


def sdar_mlp(cfg: SDARConfig, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s MLP: dense SwiGLU, or Qwen3-MoE routed experts."""
    if not cfg.is_moe_layer(layer_id):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
    assert cfg.routing is not None
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                          cfg.routing, expert_bias=False, router_fp32=False)


class SDARBase(DecoderLM):
    moe = False

    def __init__(self, hf: dict[str, Any]) -> None:
        cfg = SDARConfig.from_hf(hf, moe=self.moe)
        weights = WeightMap(packed=qkv_weights(cfg) + MLP_WEIGHTS, ignored=IGNORED_WEIGHTS,
                            tied=TIED_LM_HEAD if cfg.decoder.tie_word_embeddings else ())
        super().__init__(cfg.decoder, lambda i: sdar_mlp(cfg, i), weights,
                         init_std=float(hf.get("initializer_range", 0.02)))
        self.config = cfg


@MODELS.register("SDARForCausalLM")
class SDARForCausalLM(SDARBase):
    """Dense SDAR (SDAR-1.7B/4B/8B-Chat): Qwen3 with block-diffusion attention."""


@MODELS.register("SDARMoeForCausalLM")
class SDARMoeForCausalLM(SDARBase):
    """SDAR-30B-A3B: Qwen3-MoE with block-diffusion attention."""

    moe = True
