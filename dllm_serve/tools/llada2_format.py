"""LLaDA2.x's Hugging Face checkpoint format, spelled out once for every tool that writes one.

What a checkpoint folder holds besides the weights: config.json (every key of the real
LLaDA2.1-mini config, models.md §1.1, with the tokenizer's own special ids), the list of tensor
names and shapes a config implies (models.md §1.4; spelled out independently of our model code,
so that a checkpoint written from these names tests the loader's mapping),
generation_config.json, tokenizer_config.json (with LLaDA2's chat template) and
special_tokens_map.json. Used by the tiny random checkpoint builder and by the trainer of the
small default model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

BOS, EOS, MASK, ROLE_END = "<|startoftext|>", "<|endoftext|>", "<|mask|>", "<|role_end|>"
SPECIAL_TOKENS = (BOS, EOS, MASK, "<role>", "</role>", ROLE_END, "<|separator|>")

# LLaDA2's chat format: a SYSTEM turn (default 'detailed thinking off'), then HUMAN / ASSISTANT
# turns, each closed by <|role_end|>; the generation prompt opens an ASSISTANT turn.
CHAT_TEMPLATE = (
    "{%- set system = 'detailed thinking off' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- endif -%}"
    "<role>SYSTEM</role>{{ system }}<|role_end|>"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "<role>HUMAN</role>{{ message['content'] }}<|role_end|>"
    "{%- elif message['role'] == 'assistant' -%}"
    "<role>ASSISTANT</role>{{ message['content'] }}<|role_end|>"
    "{%- elif message['role'] == 'system' -%}"
    "{%- if not loop.first -%}{{ raise_exception('the system message must come first') }}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{ raise_exception('unsupported role ' ~ message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<role>ASSISTANT</role>{%- endif -%}"
)

# LLaDA2.1-mini's config.json (models.md §1.1), token ids and vocab_size filled in per build.
LLADA2_BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "auto_map": {
        "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
    },
    "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120,
    "moe_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
    "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "norm_topk_prob": True,
    "norm_softmax": False, "rope_theta": 600000, "rope_scaling": None,
    "partial_rotary_factor": 0.5, "rotary_dim": 64, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 32768, "max_window_layers": 28, "sliding_window": 4096,
    "attention_dropout": 0.0, "embedding_dropout": 0.0, "output_dropout": 0.0,
    "initializer_range": 0.02, "hidden_act": "silu", "norm_head": False,
    "output_router_logits": False, "pad_token_id": 156892, "tie_word_embeddings": False,
    "use_bias": False, "use_cache": False, "use_qkv_bias": False, "use_rmsnorm": True,
    "use_sliding_window": False, "using_split_qkv_in_self_attention": False,
    "vocab_size": 157184,
}
# Keys a build may add although the real config lacks them (the model reads them).
OPTIONAL_KEYS = ("use_qk_norm",)


def add_special_tokens(tok: HFTokenizer) -> None:
    """Append LLaDA2's special and role tokens (in `SPECIAL_TOKENS` order) after the vocab."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])


def llada2_config(tok: HFTokenizer, preset: dict[str, Any],
                  overrides: dict[str, Any]) -> dict[str, Any]:
    """The full config.json: base keys <- token ids, vocab <- preset <- overrides.

    vocab_size is the tokenizer's size rounded up to a multiple of 64 unless the preset or the
    overrides set it; an unknown override key or a vocab_size below the tokenizer's size raises
    ValueError.
    """
    unknown = sorted(set(overrides) - set(LLADA2_BASE_CONFIG) - set(OPTIONAL_KEYS)
                     - {"mask_token_id", "eos_token_id"})
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known: {sorted(LLADA2_BASE_CONFIG)}")
    eos, mask = tok.token_to_id(EOS), tok.token_to_id(MASK)
    size = tok.get_vocab_size(with_added_tokens=True)
    ids = {"eos_token_id": eos, "mask_token_id": mask, "pad_token_id": eos,
           "vocab_size": -(-size // 64) * 64}
    config = {**LLADA2_BASE_CONFIG, **ids, **preset, **overrides}
    if config["vocab_size"] < size:
        raise ValueError(f"vocab_size {config['vocab_size']} < tokenizer size {size}")
    return config


Spec = tuple[str, tuple[int, ...], str]  # (name, shape, kind: "weight" | "norm" | "bias")


def llada2_tensor_specs(cfg: dict[str, Any]) -> Iterator[Spec]:
    """Every tensor of an LLaDA2 HF checkpoint with this config (models.md §1.4), in order."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    yield "model.word_embeddings.weight", (vocab, hidden), "weight"
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (hidden,), "norm"
        yield from _attention_specs(cfg, f"{p}.attention")
        yield f"{p}.post_attention_layernorm.weight", (hidden,), "norm"
        if layer < cfg["first_k_dense_replace"] or not cfg["num_experts"]:
            yield from mlp_specs(f"{p}.mlp", hidden, cfg["intermediate_size"])
        else:
            yield from _moe_specs(cfg, f"{p}.mlp")
    yield "model.norm.weight", (hidden,), "norm"
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, hidden), "weight"


def _attention_specs(cfg: dict[str, Any], p: str) -> Iterator[Spec]:
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["head_dim"]
    yield f"{p}.query_key_value.weight", ((heads + 2 * kv) * head_dim, hidden), "weight"
    if cfg["use_qkv_bias"]:
        yield f"{p}.query_key_value.bias", ((heads + 2 * kv) * head_dim,), "bias"
    if cfg.get("use_qk_norm", True):
        yield f"{p}.query_layernorm.weight", (head_dim,), "norm"
        yield f"{p}.key_layernorm.weight", (head_dim,), "norm"
    yield f"{p}.dense.weight", (hidden, heads * head_dim), "weight"
    if cfg["use_bias"]:
        yield f"{p}.dense.bias", (hidden,), "bias"


def mlp_specs(p: str, hidden: int, inter: int) -> Iterator[Spec]:
    """A gated MLP's three projections (an expert's, a shared expert's, a dense layer's)."""
    yield f"{p}.gate_proj.weight", (inter, hidden), "weight"
    yield f"{p}.up_proj.weight", (inter, hidden), "weight"
    yield f"{p}.down_proj.weight", (hidden, inter), "weight"


def _moe_specs(cfg: dict[str, Any], p: str) -> Iterator[Spec]:
    hidden, experts, inter = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    yield f"{p}.gate.weight", (experts, hidden), "weight"
    if cfg["moe_router_enable_expert_bias"]:
        yield f"{p}.gate.expert_bias", (experts,), "bias"
    for e in range(experts):
        yield from mlp_specs(f"{p}.experts.{e}", hidden, inter)
    if cfg["num_shared_experts"]:
        yield from mlp_specs(f"{p}.shared_experts", hidden, inter * cfg["num_shared_experts"])


def generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
            "transformers_version": cfg["transformers_version"]}


def _added_token(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def tokenizer_config(tok: HFTokenizer, cfg: dict[str, Any]) -> dict[str, Any]:
    decoder = {str(tok.token_to_id(t)): _added_token(t) for t in SPECIAL_TOKENS}
    return {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]), "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": EOS, "mask_token": MASK, "model_max_length": cfg["max_position_embeddings"],
        "pad_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map() -> dict[str, Any]:
    def entry(content: str) -> dict[str, Any]:
        return {k: v for k, v in _added_token(content).items() if k != "special"}

    return {"additional_special_tokens": list(SPECIAL_TOKENS[3:]), "bos_token": entry(BOS),
            "eos_token": entry(EOS), "mask_token": entry(MASK), "pad_token": entry(EOS)}


def write_metadata_files(out: Path, tok: HFTokenizer, config: dict[str, Any]) -> None:
    """Everything but the weights: tokenizer.json, config.json, generation_config.json,
    tokenizer_config.json, special_tokens_map.json (same inputs => same bytes)."""
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "config.json", config, sort_keys=True)
    write_json(out / "generation_config.json", generation_config(config))
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, config))
    write_json(out / "special_tokens_map.json", special_tokens_map())


def parse_config_override(text: str) -> tuple[str, Any]:
    """KEY=VALUE for a config.json key; VALUE is read as JSON when it parses (numbers,
    true/false, null), else kept as a string. Raises ValueError without '='."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def write_json(path: Path, data: dict[str, Any], sort_keys: bool = False) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n")
