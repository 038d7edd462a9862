"""Build a small random checkpoint in exactly a real model's HF layout, in seconds on the CPU.

Architectures: "llada2_moe" (LLaDA2.x: the real LLaDA2.1-mini config keys, a tiny tokenizer
whose special ids config.json names) and "sdar" / "sdar_moe" (SDAR dense and MoE: the real
config keys, a Qwen-style tokenizer with SDAR's special tokens at their real ids, so the model
keeps the real vocab_size 151936). Written files: config.json, model.safetensors (the real
tensor names), tokenizer.json, tokenizer_config.json (with the family's chat template),
special_tokens_map.json, generation_config.json (and SDAR's added_tokens.json). Each format
(config keys, tensor names spelled out independently of our model code, tokenizer files) lives
in llada2_format.py / sdar_format.py, so loading these checkpoints tests the loader's name
mapping. Same seed => byte-identical files. Presets at the real shapes (weights=False, then
`--load-format dummy`) serve speed work on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from dllm_serve.tools import llada2_format, sdar_format
from dllm_serve.tools.llada2_format import Spec
from dllm_serve.tools.tiny_tokenizer import build_qwen_tokenizer, build_tokenizer

logger = logging.getLogger(__name__)

LLADA2_PRESETS: dict[str, dict[str, Any]] = {
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
        "vocab_size": 157184,  # the real vocabulary (ids past the tiny tokenizer's are unused)
    },
}
SDAR_TINY = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
             "max_position_embeddings": 4096, "max_window_layers": 3}
SDAR_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": SDAR_TINY,
    "sdar-8b-shape": {},  # the base config: SDAR-8B-Chat's shapes
}
SDAR_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**SDAR_TINY, "moe_intermediate_size": 32, "num_experts": 8,
             "num_experts_per_tok": 2},
    "sdar-30b-a3b-shape": {},  # the base config: Qwen3-30B-A3B's shapes
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class CheckpointFormat:
    """How to write one architecture's checkpoint."""

    tokenizer: Callable[[], HFTokenizer]
    config: Callable[[HFTokenizer, dict[str, Any], dict[str, Any]], dict[str, Any]]
    tensor_specs: Callable[[dict[str, Any]], Iterator[Spec]]
    metadata: Callable[[Path, HFTokenizer, dict[str, Any]], None]
    presets: dict[str, dict[str, Any]]
    dtype_key: str  # the config key naming the weights' dtype


FORMATS: dict[str, CheckpointFormat] = {
    "llada2_moe": CheckpointFormat(
        build_tokenizer, llada2_format.llada2_config, llada2_format.llada2_tensor_specs,
        llada2_format.write_metadata_files, LLADA2_PRESETS, "dtype"),
    **{arch: CheckpointFormat(
        build_qwen_tokenizer, partial(sdar_format.sdar_config, arch),
        sdar_format.sdar_tensor_specs, sdar_format.write_metadata_files, presets, "torch_dtype")
       for arch, presets in (("sdar", SDAR_PRESETS), ("sdar_moe", SDAR_MOE_PRESETS))},
}
ARCHES = tuple(FORMATS)
PRESETS = sorted({name for f in FORMATS.values() for name in f.presets})


def preset_arch(preset: str, arch: str | None = None) -> str:
    """`arch` if given, else the architecture whose preset this is ("tiny", which every
    architecture has, means llada2_moe)."""
    if arch is not None:
        return arch
    owners = [a for a, f in FORMATS.items() if preset in f.presets]
    if not owners:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    return owners[0]


def checkpoint_format(arch: str, preset: str) -> CheckpointFormat:
    """The format of `arch`; an unknown arch or a preset it lacks raises ValueError."""
    if arch not in FORMATS:
        raise ValueError(f"unknown tiny-checkpoint arch {arch!r}; known: {', '.join(ARCHES)}")
    fmt = FORMATS[arch]
    if preset not in fmt.presets:
        raise ValueError(f"unknown preset {preset!r} for {arch}; known: "
                         f"{', '.join(sorted(fmt.presets))}")
    return fmt


def checkpoint_config(arch: str = "llada2_moe", preset: str = "tiny",
                      **overrides: Any) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer and config.json a build of `arch` / `preset` writes (no files)."""
    fmt = checkpoint_format(arch, preset)
    tok = fmt.tokenizer()
    return tok, fmt.config(tok, fmt.presets[preset], overrides)


def build_tiny_checkpoint(out: str | Path, arch: str = "llada2_moe", seed: int = 0,
                          preset: str = "tiny", init_std: float = 0.02, device: str = "cpu",
                          weights: bool = True, **config_overrides: Any) -> Path:
    """Write a random checkpoint folder for `arch` at `out` and return its path.

    `config_overrides` replace config.json values after the preset (e.g. num_hidden_layers=2,
    tie_word_embeddings=True, dtype="float32" for LLaDA2 / torch_dtype="float32" for SDAR); an
    unknown key raises. `device` draws the random values there ("cuda" for real shapes; the
    same seed gives other values than "cpu"). weights=False writes config and tokenizer files
    only, for `--load-format dummy`.
    """
    fmt = checkpoint_format(arch, preset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok, config = checkpoint_config(arch, preset, **config_overrides)
    fmt.metadata(out, tok, config)
    if not weights:
        logger.info("wrote %s config and tokenizer (no weights) to %s", arch, out)
        return out
    gen = torch.Generator(device).manual_seed(seed)
    tensors = random_tensors(fmt.tensor_specs(config), DTYPES[config[fmt.dtype_key]], gen,
                             init_std)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote tiny %s checkpoint (%d tensors) to %s", arch, len(tensors), out)
    return out


def random_tensors(specs: Iterator[Spec], dtype: torch.dtype, gen: torch.Generator,
                   std: float) -> dict[str, torch.Tensor]:
    """Random weights under the specs' names: norms 1 + N(0, 0.1), biases N(0, 0.05), matrices
    N(0, std); LLaDA2's expert_bias stays fp32, the rest takes `dtype`."""
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind in specs:
        if kind == "norm":
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=gen.device)
        else:
            value = (0.05 if kind == "bias" else std) * torch.randn(shape, generator=gen,
                                                                    device=gen.device)
        tensors[name] = (value if name.endswith("expert_bias") else value.to(dtype)).cpu()
    return tensors
