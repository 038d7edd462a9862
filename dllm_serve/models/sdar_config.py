"""`SDARConfig`: the hyper-parameters of an SDAR checkpoint (dense `sdar`, MoE `sdar_moe`).

SDAR keeps Qwen3's (and Qwen3-MoE's) config keys. Keys missing from config.json take the
defaults of the HF config classes (SDARConfig for both, plus Qwen3MoeConfig's for the MoE keys).
Settings this implementation does not reproduce raise instead of being ignored. `block_size` and
`mask_token_id`, when a checkpoint has them, are the engine's business (dllm/config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm_serve.layers.moe_router import RoutingParams
from dllm_serve.models.decoder import DecoderSpec, check_rope_scaling

HF_DEFAULTS: dict[str, Any] = {
    "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "use_sliding_window": False,
    # Qwen3MoeConfig
    "decoder_sparse_step": 1, "norm_topk_prob": False, "mlp_only_layers": [],
}
Getter = Callable[[str], Any]  # config key -> value, or its class default
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size")
REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class SDARConfig:
    decoder: DecoderSpec
    intermediate_size: int  # dense MLP layers
    num_experts: int  # 0: the dense model
    moe_intermediate_size: int
    decoder_sparse_step: int  # layer L is sparse when (L + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...]  # ... and L is not listed here
    routing: RoutingParams | None

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @staticmethod
    def from_hf(hf: dict[str, Any], moe: bool) -> SDARConfig:
        """Parse a raw config.json dict (`moe`: SDARMoeForCausalLM); raises ValueError naming
        the offending key."""
        missing = [k for k in REQUIRED + (REQUIRED_MOE if moe else ()) if hf.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")

        get = _getter(hf)
        _check_supported(get)
        num_experts = int(hf["num_experts"]) if moe else 0
        return SDARConfig(
            decoder=_decoder_spec(hf, get), intermediate_size=int(hf["intermediate_size"]),
            num_experts=num_experts,
            moe_intermediate_size=int(hf["moe_intermediate_size"]) if moe else 0,
            decoder_sparse_step=int(get("decoder_sparse_step")),
            mlp_only_layers=tuple(int(i) for i in get("mlp_only_layers")),
            routing=_routing(hf, get, num_experts) if moe else None)


def _getter(hf: dict[str, Any]) -> Getter:
    return lambda key: hf[key] if key in hf else HF_DEFAULTS[key]


def _decoder_spec(hf: dict[str, Any], get: Getter) -> DecoderSpec:
    head_dim = int(get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    bias = bool(get("attention_bias"))
    return DecoderSpec(
        vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=int(hf["num_key_value_heads"]), head_dim=head_dim, rotary_dim=head_dim,
        rope_theta=float(get("rope_theta")), rms_norm_eps=float(get("rms_norm_eps")),
        qkv_bias=bias, o_bias=bias, qk_norm=True,
        tie_word_embeddings=bool(get("tie_word_embeddings")))


def _check_supported(get: Getter) -> None:
    if get("hidden_act") != "silu":
        raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported (only 'silu')")
    check_rope_scaling(get("rope_scaling"))
    if get("use_sliding_window"):
        raise ValueError("use_sliding_window true is not supported (SDAR attends block-causally "
                         "over the whole context)")
    if int(get("decoder_sparse_step")) < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {get('decoder_sparse_step')}")


def _routing(hf: dict[str, Any], get: Getter, num_experts: int) -> RoutingParams:
    top_k = int(hf["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
    return RoutingParams(top_k=top_k, score_function="softmax", n_group=0, topk_group=0,
                         renormalize=bool(get("norm_topk_prob")), scaling=1.0)
