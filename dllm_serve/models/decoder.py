"""The pre-norm decoder-only transformer that every model file here is built from.

Per layer: h += SelfAttention(RMSNorm(h)); h += MLP(RMSNorm(h)), the MLP chosen per layer by
the model file (dense SwiGLU, or a sparse MoE block). SelfAttention: one packed QKV projection
split by heads as [H | KV | KV], optional per-head RMSNorm of q and k before NeoX RoPE (on all
of each head or on its first `rotary_dim` dims), GQA through the attention backend
(`fb.attn`), an output projection. Logits are not shifted: row j scores the token at row j.

Parameter names follow Qwen3's HF checkpoints (model.embed_tokens, model.layers.L.self_attn.
{qkv_proj, q_norm, k_norm, o_proj}, mlp, input_layernorm, post_attention_layernorm, model.norm,
lm_head); each model file's `WeightMap` maps its own checkpoint's tensor names onto them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dllm_serve.layers.attention import KvTarget
from dllm_serve.layers.norm import RMSNorm
from dllm_serve.layers.rotary import QK_ROPE_KERNELS, RotaryEmbedding, apply_rotary
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.models.weights import WeightMap


def check_rope_scaling(value: object) -> None:
    """ValueError unless config.json's rope_scaling means plain RoPE: null, or Hugging Face's
    {"rope_type": "default"} (older files: "type"), which is the same."""
    if value is None or (isinstance(value, dict) and set(value) <= {"rope_type", "type"}
                         and set(value.values()) == {"default"}):
        return
    raise ValueError(f"rope_scaling {value!r} is not supported (only null or "
                     f"{{'rope_type': 'default'}})")


@dataclass(frozen=True)
class DecoderSpec:
    """The shapes and switches shared by every architecture's attention and backbone."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that RoPE rotates (head_dim: all of them)
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and in (0, head_dim "
                             f"{self.head_dim}]")


class SelfAttention(nn.Module):
    kernel_backend = "torch"  # q/k norm + RoPE: plain PyTorch or a QK_ROPE_KERNELS name

    def __init__(self, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads, spec.num_kv_heads, spec.head_dim)
        qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, qkv_rows, bias=spec.qkv_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size,
                                bias=spec.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """x (T, hidden), cos/sin (T, rotary_dim) -> (T, hidden)."""
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # (T, H+2KVH, D)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        # The fused q/k kernel also stores k and v where the backend keeps them
        target = fb.attn.kv_target(self.layer_id, fb) if self.kernel_backend != "torch" else None
        q, k = self.norm_rope(q, k, cos, sin, v, target)  # (T, H, D), (T, KVH, D)
        out = fb.attn.forward(self.layer_id, q, k, v, fb, stored=target is not None)  # (T, H*D)
        return self.o_proj(out)

    def norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, v: torch.Tensor | None = None,
                  target: KvTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k (when the model has it), then RoPE on [0, rotary_dim).
        A fused kernel also stores the resulting k and v at `target` (when given).

        The plain path (which stores nothing) is the oracle of the fused kernels in
        QK_ROPE_KERNELS."""
        if self.kernel_backend != "torch":
            qw, kw, eps = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                           if self.qk_norm else (None, None, 0.0))
            return QK_ROPE_KERNELS.get(self.kernel_backend)(q, k, qw, kw, eps, cos, sin, v,
                                                            target)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_id: int, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(spec, layer_id)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """h (T, hidden) residual stream, x = input_layernorm(h) -> (h', next_norm(h')): the
        next layer's input (or the model's final norm) comes from the MLP, whose fused kernels
        may compute it in their last pass."""
        a = self.self_attn(x, cos, sin, fb)
        x, h = self.post_attention_layernorm(a, residual=h)  # h += a; x = norm(h)
        return self.mlp(x, residual=h, norm=next_norm)  # h + mlp(x); a MoE adds h at the end


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, make_mlp(i))
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.rotary_dim, spec.rope_theta)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """fb.input_ids (T,) -> final-normed hidden states (T, hidden)."""
        h = self.embed_tokens(fb.input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb(fb.positions, h.dtype)  # (T, rotary_dim) each
        x = self.layers[0].input_layernorm(h)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms, strict=True):
            h, x = layer(h, x, cos, sin, fb, next_norm)
        return x


class DecoderLM(nn.Module):
    """The whole LM: what the runner and the loader use of any architecture.

    `forward` never touches the KV cache itself: every layer hands q (T, H, D) and k, v (T,
    KVH, D), after qk-norm and RoPE at `fb.positions`, to `fb.attn.forward`, which stores and
    attends (with fused kernels the q/k kernel stores them at `fb.attn.kv_target`'s slots).
    Subclasses (one per architecture) parse their config and pass the spec, the per-layer MLP
    and the weight map; `self.config` is their parsed config (it has `vocab_size`).
    """

    def __init__(self, spec: DecoderSpec, make_mlp: Callable[[int], nn.Module],
                 weight_map: WeightMap, init_std: float) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, make_mlp)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.weight_map = weight_map
        init_weights(self, init_std)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm; `fb.attn.prepare(fb)` ran before."""
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """hidden (N, hidden) -> logits (N, vocab) in fp32; row j scores the token at row j.
        `out` (N, vocab): write them there instead (a CUDA graph's static output), in its
        dtype; in hidden's dtype the LM head's GEMM writes them directly, else they are
        copied (either way the values of the LM head's output, as returned without `out`)."""
        w = self.lm_head.weight
        if out is not None and out.dtype == hidden.dtype == w.dtype:
            return torch.mm(hidden, w.t(), out=out)
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def kv_spec(self) -> tuple[int, int, int, int]:
        """(num_layers, num_heads, num_kv_heads, head_dim) for sizing the KV cache."""
        s = self.spec
        return s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim

    @property
    def attn_scale(self) -> float:
        return self.spec.head_dim ** -0.5


TIED_LM_HEAD = (("lm_head.weight", "model.embed_tokens.weight"),)


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
