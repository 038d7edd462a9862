"""`DllmConfig`: the block-diffusion facts of one served model + the chosen algorithm.

block_size and mask_id come from the architecture table below, overridden by config.json
(`mask_token_id`) and by the algorithm YAML (`block_size`, `mask_id`), in that order.
"""

from __future__ import annotations

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


ARCH_DEFAULTS: dict[str, ArchDefaults] = {
    "LLaDA2MoeModelLM": ArchDefaults(block_size=32, mask_id=156895, eos_id=156892),
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

    @staticmethod
    def build(model: ModelConfig, algorithm: str, config_file: str | None,
              fdfo: bool) -> DllmConfig:
        arch = arch_defaults(model.architecture)
        raw = load_algorithm_yaml(config_file)
        mask_id = model.token_id("mask_token_id")
        return DllmConfig(
            algorithm=algorithm,
            algorithm_config={k: v for k, v in raw.items() if k not in ENGINE_KEYS},
            block_size=int(raw.get("block_size", arch.block_size)),
            mask_id=int(raw.get("mask_id", arch.mask_id if mask_id is None else mask_id)),
            fdfo=fdfo,
        )


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
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--dllm-algorithm-config {path!r}: expected a mapping of settings")
    return data
