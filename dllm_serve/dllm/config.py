"""`DllmConfig`: the block-diffusion facts of one served model + the chosen algorithm.

block_size and mask_id come from the architecture table below, overridden by config.json
(`block_size`, `mask_token_id`) and by the algorithm YAML (`block_size`, `mask_id`), in that
order. An architecture may also set default settings for an algorithm (SDAR's own generate.py
runs LowConfidence at threshold 0.9); the YAML overrides those too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dllm_serve.model.config import ModelConfig


@dataclass(frozen=True)
class ArchDefaults:
    block_size: int
    mask_id: int
    eos_id: int
    # algorithm name -> its settings for this architecture, under the user's YAML
    algorithm_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


SDAR_DEFAULTS = ArchDefaults(block_size=4, mask_id=151669, eos_id=151643,
                             algorithm_settings={"LowConfidence": {"threshold": 0.9}})
ARCH_DEFAULTS: dict[str, ArchDefaults] = {
    "LLaDA2MoeModelLM": ArchDefaults(block_size=32, mask_id=156895, eos_id=156892),
    # <|im_end|> (151645) also stops: the tokenizer's end-of-turn token (dllm_serve/tokenizer.py)
    "SDARForCausalLM": SDAR_DEFAULTS,
    "SDARMoeForCausalLM": SDAR_DEFAULTS,
}

# Keys of the algorithm YAML that belong to the engine, not to the algorithm's own config.
ENGINE_KEYS = ("block_size", "mask_id")


@dataclass(frozen=True)
class DllmConfig:
    algorithm: str
    algorithm_config: dict[str, Any] = field(default_factory=dict)
    block_size: int = 32
    mask_id: int = 156895
    fdfo: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @staticmethod
    def build(model: ModelConfig, algorithm: str, config_file: str | None,
              fdfo: bool) -> DllmConfig:
        arch = arch_defaults(model.architecture)
        raw = load_algorithm_yaml(config_file)
        mask_id = model.token_id("mask_token_id")
        block_size = model.hf.get("block_size")
        settings = {k: v for k, v in raw.items() if k not in ENGINE_KEYS}
        config = DllmConfig(
            algorithm=algorithm,
            algorithm_config={**arch.algorithm_settings.get(algorithm, {}), **settings},
            block_size=int(raw.get("block_size", arch.block_size if block_size is None
                                   else block_size)),
            mask_id=int(raw.get("mask_id", arch.mask_id if mask_id is None else mask_id)),
            fdfo=fdfo,
        )
        if not 0 <= config.mask_id < model.vocab_size:  # else the first request's embedding fails
            raise ValueError(f"mask id {config.mask_id} is outside the vocabulary (vocab_size "
                             f"{model.vocab_size}): see mask_token_id in config.json or mask_id "
                             f"in --dllm-algorithm-config")
        return config


def arch_defaults(architecture: str) -> ArchDefaults:
    if architecture not in ARCH_DEFAULTS:
        known = ", ".join(sorted(ARCH_DEFAULTS))
        raise ValueError(f"unknown diffusion LLM architecture {architecture!r}; known: {known}")
    return ARCH_DEFAULTS[architecture]


def load_algorithm_yaml(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--dllm-algorithm-config: no such file {path!r}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--dllm-algorithm-config {path!r}: not valid YAML "
                         f"({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--dllm-algorithm-config {path!r}: expected a mapping of settings")
    return data
