"""LLaDA2.x (`LLaDA2MoeModelLM`, model_type `llada2_moe`): a block-diffusion MoE transformer.

Module names follow the HF checkpoint so that most tensors load by name; the fused and stacked
parameters are declared in `WEIGHTS` below. Per layer: pre-norm attention (fused QKV split by
heads as [H | KV | KV], per-head RMSNorm on q and k before partial NeoX RoPE, GQA) and a pre-norm
MLP: dense SwiGLU for layers < first_k_dense_replace, else a routed MoE (sigmoid scores, expert
bias for selection, group-limited top-k) plus shared experts. Logits are not shifted: row j scores
the token at position j.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dllm_serve.layers.mlp import SwiGLUMLP
from dllm_serve.layers.moe import Experts, Router
from dllm_serve.layers.norm import RMSNorm
from dllm_serve.layers.rotary import QK_ROPE_KERNELS, RotaryEmbedding, apply_rotary
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.models.llada2_config import LLaDA2Config
from dllm_serve.models.registry import MODELS
from dllm_serve.models.weights import PackedWeight, WeightMap

# HF tensor names -> our packed parameters (everything else loads by its own name).
PACKED_WEIGHTS = (
    PackedWeight("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),
    PackedWeight("experts.w13", ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight")),
    PackedWeight("experts.w2", ("experts.{e}.down_proj.weight",)),
)
TIED_WEIGHTS = (("lm_head.weight", "model.word_embeddings.weight"),)
IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)
# The router weight stays fp32 when router_dtype is "fp32" (HF computes router logits in fp32);
# expert_bias always does: it only shifts fp32 scores, and bf16 would blur near-tied choices.
ROUTER_FP32 = ("mlp.gate.weight",)
ALWAYS_FP32 = ("mlp.gate.expert_bias",)


class LLaDA2Attention(nn.Module):
    kernel_backend = "torch"  # q/k norm + RoPE: plain PyTorch or a QK_ROPE_KERNELS name

    def __init__(self, cfg: LLaDA2Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_rows, bias=cfg.use_qkv_bias)
        if cfg.use_qk_norm:
            self.query_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.use_qk_norm = cfg.use_qk_norm
        self.dense = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.use_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """x (T, hidden), cos/sin (T, rotary_dim) -> (T, hidden)."""
        qkv = self.query_key_value(x).view(x.shape[0], -1, self.head_dim)  # (T, H+2KVH, D)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = self.norm_rope(q, k, cos, sin)  # (T, H, D), (T, KVH, D)
        out = fb.attn.forward(self.layer_id, q, k, v, fb)  # (T, H * D)
        return self.dense(out)

    def norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k (when the config has it), then partial RoPE."""
        if self.kernel_backend != "torch":
            qw, kw, eps = ((self.query_layernorm.weight, self.key_layernorm.weight,
                            self.query_layernorm.eps) if self.use_qk_norm else (None, None, 0.0))
            return QK_ROPE_KERNELS.get(self.kernel_backend)(q, k, qw, kw, eps, cos, sin)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class LLaDA2SparseMoe(nn.Module):
    """Routed experts (weighted) plus shared experts (unweighted)."""

    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.routing = cfg.routing
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.expert_bias, cfg.router_fp32)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared = cfg.moe_intermediate_size * cfg.num_shared_experts
        self.shared_experts = SwiGLUMLP(cfg.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        y = self.experts(x, self.gate(x), self.gate.expert_bias, self.routing)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = LLaDA2Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (LLaDA2SparseMoe(cfg) if cfg.is_moe_layer(layer_id)
                               else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """h (T, hidden) residual stream -> (T, hidden)."""
        a = self.attention(self.input_layernorm(h), cos, sin, fb)
        x, h = self.post_attention_layernorm(a, residual=h)  # h += a; x = norm(h)
        return h + self.mlp(x)


class LLaDA2Backbone(nn.Module):
    def __init__(self, cfg: LLaDA2Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LLaDA2DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """fb.input_ids (T,) -> final-normed hidden states (T, hidden)."""
        h = self.word_embeddings(fb.input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb(fb.positions, h.dtype)  # (T, rotary_dim) each
        for layer in self.layers:
            h = layer(h, cos, sin, fb)
        return self.norm(h)


@MODELS.register("LLaDA2MoeModelLM")
class LLaDA2MoeModelLM(nn.Module):
    """The whole LM. Built from the raw config.json dict; weights come from the loader.

    `forward` never touches the KV cache: every layer hands q (T, H, D) and k, v (T, KVH, D),
    after qk-norm and RoPE at `fb.positions`, to `fb.attn.forward`, which stores and attends.
    """

    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        self.config = cfg = LLaDA2Config.from_hf(hf)
        self.model = LLaDA2Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.word_embeddings.weight
        self.weight_map = WeightMap(
            packed=PACKED_WEIGHTS, tied=TIED_WEIGHTS if cfg.tie_word_embeddings else (),
            ignored=IGNORED_WEIGHTS, fp32=ALWAYS_FP32 + (ROUTER_FP32 if cfg.router_fp32 else ()))
        init_weights(self, std=float(hf.get("initializer_range", 0.02)))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm; `fb.attn.prepare(fb)` ran before."""
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) in fp32; row j scores the token at row j.
        `out` (N, vocab) fp32: write them there (a CUDA graph's static output)."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def kv_spec(self) -> tuple[int, int, int, int]:
        """(num_layers, num_heads, num_kv_heads, head_dim) for sizing the KV cache."""
        c = self.config
        return c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim

    @property
    def attn_scale(self) -> float:
        return self.config.head_dim ** -0.5


@torch.no_grad()
def init_weights(model: nn.Module, std: float) -> None:
    """Random init for checkpoint-free use: norms 1, biases 0, matrices N(0, std)."""
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        if param.dim() > 1:
            param.normal_(0.0, std)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.zero_()
