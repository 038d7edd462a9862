"""SDAR's Hugging Face checkpoint format (dense `sdar` and MoE `sdar_moe`), spelled out once.

What a checkpoint folder holds besides the weights: config.json (the keys of JetLM's SDAR-*-Chat
configs, models.md §3: Qwen3's keys plus SDAR's training flags; for the MoE model Qwen3-MoE's
expert keys), the tensor names and shapes a config implies (Qwen3's names, spelled out here
independently of our model code, so that a checkpoint written from them tests the loader's
mapping), generation_config.json, tokenizer_config.json (Qwen2-style, with a Qwen3-format chat
template), special_tokens_map.json and added_tokens.json. The dense base config has
SDAR-8B-Chat's shapes; the MoE base has Qwen3-30B-A3B's (SDAR-30B-A3B's own config.json was not
available to check).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dllm_serve.tools.llada2_format import Spec, mlp_specs, write_json

EOS, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
FIRST_SPECIAL_ID = 151643
# Qwen3's added tokens from id 151643 on, then SDAR's mask (151669): (content, special).
QWEN_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    *((t, True) for t in (
        EOS, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
        "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")),
    *((t, False) for t in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
        "<think>", "</think>")),
    (MASK, True),
)
ADDITIONAL_SPECIAL = (*(t for t, _ in QWEN_SPECIAL_TOKENS[1:14]), MASK)

# Qwen3's chat format: an optional leading system turn, then user / assistant turns, each
# "<|im_start|>ROLE\n...<|im_end|>\n"; an assistant turn keeps only what follows "</think>";
# the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'system' and not loop.first -%}"
    "{{ raise_exception('the system message must come first') }}"
    "{%- elif message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- elif message['role'] not in ('system', 'user', 'assistant') -%}"
    "{{ raise_exception('unsupported role ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

SDAR_TRAINING_FLAGS: dict[str, Any] = {
    "attn_implementation": "flex_attention", "debug": False, "ep_size": 1,
    "fuse_cross_entropy": True, "micro_forward": False, "skip_checkpoint": False,
    "use_deepep": False,
}
# SDAR-8B-Chat's config.json (models.md §3), token ids as in the real file.
SDAR_BASE_CONFIG: dict[str, Any] = {
    "architectures": ["SDARForCausalLM"], "model_type": "sdar",
    "auto_map": {
        "AutoConfig": "configuration_sdar.SDARConfig",
        "AutoModel": "modeling_sdar.SDARModel",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
    },
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 32768,
    "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": False,
    "use_sliding_window": False, "vocab_size": 151936, **SDAR_TRAINING_FLAGS,
}
# The MoE model: Qwen3-MoE's keys at Qwen3-30B-A3B's shapes.
SDAR_MOE_BASE_CONFIG: dict[str, Any] = {
    **SDAR_BASE_CONFIG, "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
    "auto_map": {
        "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
        "AutoModel": "modeling_sdar_moe.SDARMoeModel",
        "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
    },
    "hidden_size": 2048, "intermediate_size": 6144, "max_window_layers": 48,
    "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}
BASE_CONFIGS = {"sdar": SDAR_BASE_CONFIG, "sdar_moe": SDAR_MOE_BASE_CONFIG}
# Keys a build may add although the real configs lack them (the engine reads them).
OPTIONAL_KEYS = ("block_size", "mask_token_id")


def sdar_config(arch: str, tok: HFTokenizer, preset: dict[str, Any],
                overrides: dict[str, Any]) -> dict[str, Any]:
    """The full config.json for `arch` ("sdar" | "sdar_moe"): base keys <- preset <- overrides.

    An unknown override key, or a vocab_size below the tokenizer's size, raises ValueError."""
    base = BASE_CONFIGS[arch]
    unknown = sorted(set(overrides) - set(base) - set(OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known: {sorted(base)}")
    config = {**base, **preset, **overrides}
    size = tok.get_vocab_size(with_added_tokens=True)
    if config["vocab_size"] < size:
        raise ValueError(f"vocab_size {config['vocab_size']} < tokenizer size {size}")
    return config


def sdar_tensor_specs(cfg: dict[str, Any]) -> Iterator[Spec]:
    """Every tensor of an SDAR (Qwen3 / Qwen3-MoE) HF checkpoint with this config, in order."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, hidden), "weight"
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (hidden,), "norm"
        yield from _attention_specs(cfg, f"{p}.self_attn")
        yield f"{p}.post_attention_layernorm.weight", (hidden,), "norm"
        if _is_sparse(cfg, layer):
            yield from _moe_specs(cfg, f"{p}.mlp")
        else:
            yield from mlp_specs(f"{p}.mlp", hidden, cfg["intermediate_size"])
    yield "model.norm.weight", (hidden,), "norm"
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, hidden), "weight"


def _is_sparse(cfg: dict[str, Any], layer: int) -> bool:
    return (cfg.get("num_experts", 0) > 0 and layer not in cfg["mlp_only_layers"]
            and (layer + 1) % cfg["decoder_sparse_step"] == 0)


def _attention_specs(cfg: dict[str, Any], p: str) -> Iterator[Spec]:
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    rows = {"q_proj": cfg["num_attention_heads"] * d, "k_proj": cfg["num_key_value_heads"] * d,
            "v_proj": cfg["num_key_value_heads"] * d}
    for name, n in rows.items():
        yield f"{p}.{name}.weight", (n, hidden), "weight"
        if cfg["attention_bias"]:
            yield f"{p}.{name}.bias", (n,), "bias"
    yield f"{p}.o_proj.weight", (hidden, rows["q_proj"]), "weight"
    if cfg["attention_bias"]:
        yield f"{p}.o_proj.bias", (hidden,), "bias"
    yield f"{p}.q_norm.weight", (d,), "norm"
    yield f"{p}.k_norm.weight", (d,), "norm"


def _moe_specs(cfg: dict[str, Any], p: str) -> Iterator[Spec]:
    hidden, experts = cfg["hidden_size"], cfg["num_experts"]
    yield f"{p}.gate.weight", (experts, hidden), "weight"
    for e in range(experts):
        yield from mlp_specs(f"{p}.experts.{e}", hidden, cfg["moe_intermediate_size"])


def generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """SDAR-*-Chat's generation_config.json (Qwen3's sampling defaults; both turn ends stop)."""
    return {"bos_token_id": cfg["bos_token_id"], "do_sample": True,
            "eos_token_id": [FIRST_SPECIAL_ID + 2, cfg["eos_token_id"]],
            "pad_token_id": cfg["eos_token_id"], "temperature": 0.6, "top_k": 20,
            "top_p": 0.95, "transformers_version": "4.51.0"}


def _added_token(content: str, special: bool) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}


def tokenizer_config(tok: HFTokenizer) -> dict[str, Any]:
    decoder = {str(tok.token_to_id(t)): _added_token(t, s) for t, s in QWEN_SPECIAL_TOKENS}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": list(ADDITIONAL_SPECIAL), "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": EOS, "mask_token": MASK, "errors": "replace", "model_max_length": 131072,
        "pad_token": EOS, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def special_tokens_map() -> dict[str, Any]:
    def entry(content: str) -> dict[str, Any]:
        return {k: v for k, v in _added_token(content, True).items() if k != "special"}

    return {"additional_special_tokens": list(ADDITIONAL_SPECIAL), "eos_token": entry(EOS),
            "mask_token": entry(MASK), "pad_token": entry(EOS)}


def write_metadata_files(out: Path, tok: HFTokenizer, config: dict[str, Any]) -> None:
    """Everything but the weights: tokenizer.json, config.json, generation_config.json,
    tokenizer_config.json, special_tokens_map.json, added_tokens.json (same inputs => same
    bytes)."""
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "config.json", config, sort_keys=True)
    write_json(out / "generation_config.json", generation_config(config))
    write_json(out / "tokenizer_config.json", tokenizer_config(tok))
    write_json(out / "special_tokens_map.json", special_tokens_map())
    write_json(out / "added_tokens.json", {t: tok.token_to_id(t) for t, _ in
                                           sorted(QWEN_SPECIAL_TOKENS)})
