"""`LLaDA2Config`: the hyper-parameters of an LLaDA2.x (`llada2_moe`) checkpoint, from config.json.

Keys missing from config.json take the defaults of HF's `LLaDA2MoeConfig` class (note: the class
default `use_bias=True` differs from the checkpoints, which say false; the key wins). Settings
this implementation does not reproduce exactly raise instead of being ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm_serve.layers.moe_router import RoutingParams
from dllm_serve.models.decoder import DecoderSpec, check_rope_scaling

# LLaDA2MoeConfig class defaults, used when config.json lacks the key.
HF_DEFAULTS: dict[str, Any] = {
    "use_qkv_bias": False, "use_qk_norm": True, "use_bias": True, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
    "num_experts": 16, "num_shared_experts": 0, "num_experts_per_tok": 2, "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 0, "head_dim": None,
    "partial_rotary_factor": 0.5, "hidden_act": "silu", "score_function": "sigmoid",
    "router_dtype": "fp32", "norm_topk_prob": True, "moe_intermediate_size": None,
}
Getter = Callable[[str], Any]  # config key -> value, or its class default
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size")


@dataclass(frozen=True)
class LLaDA2Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that RoPE rotates
    rope_theta: float
    rms_norm_eps: float
    intermediate_size: int  # dense MLP layers
    use_qkv_bias: bool
    use_qk_norm: bool
    use_bias: bool  # bias of attention.dense (the output projection)
    tie_word_embeddings: bool
    num_experts: int  # 0: every layer is dense
    first_k_dense_replace: int  # layers [0, k) are dense, the rest MoE
    moe_intermediate_size: int  # each routed expert; shared experts use this * num_shared
    num_shared_experts: int
    expert_bias: bool  # the router has `expert_bias` (sigmoid routing)
    router_fp32: bool  # router weight and logits in fp32
    routing: RoutingParams

    def __post_init__(self) -> None:
        self.decoder_spec  # noqa: B018 (checks heads and rotary dim)
        if self.num_experts:
            self._check_moe()

    @property
    def decoder_spec(self) -> DecoderSpec:
        return DecoderSpec(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rotary_dim=self.rotary_dim, rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps, qkv_bias=self.use_qkv_bias, o_bias=self.use_bias,
            qk_norm=self.use_qk_norm, tie_word_embeddings=self.tie_word_embeddings)

    def _check_moe(self) -> None:
        p, e = self.routing, self.num_experts
        if (p.score_function == "sigmoid") != self.expert_bias:
            raise ValueError("LLaDA2 routing is either sigmoid with expert bias or softmax without;"
                             f" got score_function {p.score_function!r}, "
                             f"moe_router_enable_expert_bias {self.expert_bias}")
        if self.moe_intermediate_size <= 0:
            raise ValueError("MoE layers need a positive moe_intermediate_size")
        if p.n_group and (e % p.n_group or not 0 < p.topk_group <= p.n_group):
            raise ValueError(f"bad expert groups: num_experts {e}, n_group {p.n_group}, "
                             f"topk_group {p.topk_group}")
        eligible = p.topk_group * (e // p.n_group) if p.n_group else e
        if not 0 < p.top_k <= eligible:
            raise ValueError(f"num_experts_per_tok {p.top_k} must be in [1, {eligible}]")

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts > 0 and layer_id >= self.first_k_dense_replace

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> LLaDA2Config:
        """Parse a raw config.json dict; raises ValueError naming the offending key."""
        missing = [k for k in REQUIRED if hf.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")
        get = _getter(hf)
        _check_supported(get)
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        head_dim = int(get("head_dim") or hidden // heads)
        return LLaDA2Config(
            vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(hf["num_key_value_heads"]), head_dim=head_dim,
            rotary_dim=_rotary_dim(hf, head_dim, get), rope_theta=float(get("rope_theta")),
            rms_norm_eps=float(get("rms_norm_eps")), intermediate_size=int(hf["intermediate_size"]),
            use_qkv_bias=bool(get("use_qkv_bias")), use_qk_norm=bool(get("use_qk_norm")),
            use_bias=bool(get("use_bias")), tie_word_embeddings=bool(get("tie_word_embeddings")),
            num_experts=int(get("num_experts") or 0),
            first_k_dense_replace=int(get("first_k_dense_replace") or 0),
            moe_intermediate_size=int(get("moe_intermediate_size") or 0),
            num_shared_experts=int(get("num_shared_experts") or 0),
            expert_bias=bool(hf.get("moe_router_enable_expert_bias",
                                    get("score_function") == "sigmoid")),
            router_fp32=get("router_dtype") == "fp32",
            routing=_routing(get),
        )


def _getter(hf: dict[str, Any]) -> Getter:
    return lambda key: hf[key] if key in hf else HF_DEFAULTS[key]


def _check_supported(get: Getter) -> None:
    if get("hidden_act") != "silu":
        raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported (only 'silu')")
    check_rope_scaling(get("rope_scaling"))


def _rotary_dim(hf: dict[str, Any], head_dim: int, get: Getter) -> int:
    """HF computes int(head_dim * partial_rotary_factor); a `rotary_dim` key must agree with it."""
    from_factor = int(head_dim * float(get("partial_rotary_factor")))
    explicit = hf.get("rotary_dim")
    if explicit is None:
        return from_factor
    if "partial_rotary_factor" in hf and int(explicit) != from_factor:
        raise ValueError(f"rotary_dim {explicit} disagrees with head_dim {head_dim} * "
                         f"partial_rotary_factor {hf['partial_rotary_factor']} = {from_factor}")
    return int(explicit)


def _routing(get: Getter) -> RoutingParams:
    return RoutingParams(
        top_k=int(get("num_experts_per_tok")), score_function=str(get("score_function")),
        n_group=int(get("n_group") or 0), topk_group=int(get("topk_group") or 0),
        renormalize=bool(get("norm_topk_prob")),
        scaling=float(get("routed_scaling_factor")))
