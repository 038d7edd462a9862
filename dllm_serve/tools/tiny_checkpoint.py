"""Build a small random checkpoint in exactly the HF layout of LLaDA2.x, in about a second on CPU.

Written files: config.json (every key of the real LLaDA2.1-mini config, small shapes, plus the
tiny tokenizer's `mask_token_id` / `eos_token_id` / `pad_token_id`), model.safetensors (the real
tensor names: per-expert weights, fused query_key_value, fp32 expert_bias), tokenizer.json,
tokenizer_config.json (with LLaDA2's chat template), special_tokens_map.json and
generation_config.json. The tensor names here are spelled out independently of our model code,
so loading this checkpoint tests the loader's name mapping. Same seed => byte-identical files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from dllm_serve.tools.tiny_tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    MASK,
    SPECIAL_TOKENS,
    build_tokenizer,
)

logger = logging.getLogger(__name__)

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

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5, "rotary_dim": 8,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 4, "topk_group": 2, "max_position_embeddings": 4096, "max_window_layers": 3,
    },
    # LLaDA2.0-mini's exact shapes (models.md §1.1), random weights: for speed work on a GPU.
    "llada2-mini-shape": {
        "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "partial_rotary_factor": 0.5, "rotary_dim": 64,
        "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 256,
        "num_experts_per_tok": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 8, "topk_group": 4, "max_position_embeddings": 16384,
    },
}
# Presets with the real model's vocabulary size (ids past the tiny tokenizer's are unused).
PRESET_VOCAB = {"llada2-mini-shape": 157184}
ARCHES = ("llada2_moe",)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def build_tiny_checkpoint(out: str | Path, arch: str = "llada2_moe", seed: int = 0,
                          preset: str = "tiny", init_std: float = 0.02, device: str = "cpu",
                          **config_overrides: Any) -> Path:
    """Write a random checkpoint folder for `arch` at `out` and return its path.

    `config_overrides` replace config.json values after the preset (e.g. num_hidden_layers=2,
    tie_word_embeddings=True, dtype="float32"); an unknown key raises. `device` draws the
    random values there ("cuda" for real shapes; the same seed gives other values than "cpu").
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown tiny-checkpoint arch {arch!r}; known: {', '.join(ARCHES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = llada2_config(tok, PRESETS[preset], {**preset_overrides(preset),
                                                  **config_overrides})
    tensors = llada2_tensors(config, torch.Generator(device).manual_seed(seed), init_std)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", config, sort_keys=True)
    _write_json(out / "generation_config.json", generation_config(config))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tok, config))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    logger.info("wrote tiny %s checkpoint (%d tensors) to %s", arch, len(tensors), out)
    return out


def llada2_config(tok: HFTokenizer, preset: dict[str, Any],
                  overrides: dict[str, Any]) -> dict[str, Any]:
    """The full config.json: base keys <- preset <- token ids, vocab <- overrides."""
    unknown = sorted(set(overrides) - set(LLADA2_BASE_CONFIG) - set(OPTIONAL_KEYS)
                     - {"mask_token_id", "eos_token_id"})
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known: {sorted(LLADA2_BASE_CONFIG)}")
    eos, mask = tok.token_to_id(EOS), tok.token_to_id(MASK)
    size = tok.get_vocab_size(with_added_tokens=True)
    ids = {"eos_token_id": eos, "mask_token_id": mask, "pad_token_id": eos,
           "vocab_size": -(-size // 64) * 64}
    config = {**LLADA2_BASE_CONFIG, **preset, **ids, **overrides}
    if config["vocab_size"] < size:
        raise ValueError(f"vocab_size {config['vocab_size']} < tokenizer size {size}")
    return config


def preset_overrides(preset: str) -> dict[str, Any]:
    """Config values a preset sets past the tokenizer-derived ones (its vocabulary size)."""
    return {"vocab_size": PRESET_VOCAB[preset]} if preset in PRESET_VOCAB else {}


def llada2_tensors(cfg: dict[str, Any], gen: torch.Generator,
                   std: float) -> dict[str, torch.Tensor]:
    """Random weights under LLaDA2's HF tensor names; expert_bias is fp32, the rest cfg dtype."""
    dtype = DTYPES[cfg["dtype"]]
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind in llada2_tensor_specs(cfg):
        if kind == "norm":
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=gen.device)
        else:
            value = (0.05 if kind == "bias" else std) * torch.randn(shape, generator=gen,
                                                                    device=gen.device)
        tensors[name] = (value if name.endswith("expert_bias") else value.to(dtype)).cpu()
    return tensors


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
            yield from _mlp_specs(f"{p}.mlp", hidden, cfg["intermediate_size"])
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


def _mlp_specs(p: str, hidden: int, inter: int) -> Iterator[Spec]:
    yield f"{p}.gate_proj.weight", (inter, hidden), "weight"
    yield f"{p}.up_proj.weight", (inter, hidden), "weight"
    yield f"{p}.down_proj.weight", (hidden, inter), "weight"


def _moe_specs(cfg: dict[str, Any], p: str) -> Iterator[Spec]:
    hidden, experts, inter = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    yield f"{p}.gate.weight", (experts, hidden), "weight"
    if cfg["moe_router_enable_expert_bias"]:
        yield f"{p}.gate.expert_bias", (experts,), "bias"
    for e in range(experts):
        yield from _mlp_specs(f"{p}.experts.{e}", hidden, inter)
    if cfg["num_shared_experts"]:
        yield from _mlp_specs(f"{p}.shared_experts", hidden, inter * cfg["num_shared_experts"])


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


def _write_json(path: Path, data: dict[str, Any], sort_keys: bool = False) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n")
