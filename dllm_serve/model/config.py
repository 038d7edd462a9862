"""`ModelConfig`: what the engine needs to know of a checkpoint folder, read from its config.json.

The architecture is `architectures[0]` (never `model_type`). Model files read their own
hyper-parameters from `hf` (the raw config.json); this class holds only what the scheduler,
the worker and the front all need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    hf: dict[str, Any]
    vocab_size: int
    max_position_embeddings: int

    @staticmethod
    def load(path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(path)!r}")
        hf = json.loads(cfg_file.read_text())
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_file}: 'architectures' is missing or empty")
        return ModelConfig(
            path=path,
            architecture=archs[0],
            hf=hf,
            vocab_size=int(_require(hf, "vocab_size", cfg_file)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        )

    def context_length(self, requested: int | None) -> int:
        """The served context: the flag's value, else max_position_embeddings."""
        return requested if requested is not None else self.max_position_embeddings

    def token_id(self, key: str) -> int | None:
        """An id named by config.json (e.g. 'mask_token_id'); the first one if it is a list."""
        value = self.hf.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        return None if value is None else int(value)

    def eos_token_ids(self) -> list[int]:
        """EOS ids from config.json, else from generation_config.json; may be empty."""
        for source in (self.hf, _read_json(self.path / "generation_config.json")):
            value = source.get("eos_token_id")
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
        return []


def _require(hf: dict[str, Any], key: str, where: Path) -> Any:
    if key not in hf:
        raise ValueError(f"{where}: required key {key!r} is missing")
    return hf[key]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
