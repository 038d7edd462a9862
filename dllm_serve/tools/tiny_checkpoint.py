"""Build a small random checkpoint in exactly the HF layout of LLaDA2.x, in about a second on CPU.

Written files: config.json (every key of the real LLaDA2.1-mini config, small shapes, plus the
tiny tokenizer's `mask_token_id` / `eos_token_id` / `pad_token_id`), model.safetensors (the real
tensor names: per-expert weights, fused query_key_value, fp32 expert_bias), tokenizer.json,
tokenizer_config.json (with LLaDA2's chat template), special_tokens_map.json and
generation_config.json. The format itself (config keys, tensor names spelled out independently
of our model code, tokenizer files) lives in llada2_format.py, so loading this checkpoint tests
the loader's name mapping. Same seed => byte-identical files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dllm_serve.tools.llada2_format import (
    llada2_config,
    llada2_tensor_specs,
    write_metadata_files,
)
from dllm_serve.tools.tiny_tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

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
                          weights: bool = True, **config_overrides: Any) -> Path:
    """Write a random checkpoint folder for `arch` at `out` and return its path.

    `config_overrides` replace config.json values after the preset (e.g. num_hidden_layers=2,
    tie_word_embeddings=True, dtype="float32"); an unknown key raises. `device` draws the
    random values there ("cuda" for real shapes; the same seed gives other values than "cpu").
    weights=False writes config and tokenizer files only, for `--load-format dummy`.
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
    write_metadata_files(out, tok, config)
    if not weights:
        logger.info("wrote %s config and tokenizer (no weights) to %s", arch, out)
        return out
    tensors = llada2_tensors(config, torch.Generator(device).manual_seed(seed), init_std)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote tiny %s checkpoint (%d tensors) to %s", arch, len(tensors), out)
    return out


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
