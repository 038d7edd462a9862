"""`ModelConfig`: what the engine needs to know of a checkpoint folder, read from its config.json;
`RunnerConfig`: what the worker's model runner (model/runner.py) is built from.

The architecture is `architectures[0]` (never `model_type`). Model files read their own
hyper-parameters from `hf` (the raw config.json); `ModelConfig` holds only what the scheduler,
the worker and the front all need. Neither imports torch: the parent resolves both, and the
processes that never touch the model (the scheduler, the HTTP front) import this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllm_serve.utils.jsonfile import read_json_object

# Set to 1 to serve a --context-length beyond config.json's max_position_embeddings (positions
# the model was never trained on; SGLang's SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN)
ALLOW_LONGER_CONTEXT_ENV = "DLLM_SERVE_ALLOW_LONGER_CONTEXT_LEN"


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
        hf = read_json_object(cfg_file)
        archs = hf.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        if not archs:
            raise ValueError(f"{cfg_file}: 'architectures' is missing or empty")
        return ModelConfig(
            path=path,
            architecture=archs[0],
            hf=hf,
            vocab_size=_int(_require(hf, "vocab_size", cfg_file), "vocab_size", cfg_file),
            max_position_embeddings=_int(hf.get("max_position_embeddings", 4096),
                                         "max_position_embeddings", cfg_file),
        )

    def context_length(self, requested: int | None) -> int:
        """The served context: the flag's value, else max_position_embeddings. A value beyond
        max_position_embeddings raises ValueError unless ALLOW_LONGER_CONTEXT_ENV is 1."""
        if requested is None:
            return self.max_position_embeddings
        if (requested > self.max_position_embeddings
                and os.environ.get(ALLOW_LONGER_CONTEXT_ENV, "0") != "1"):
            raise ValueError(
                f"--context-length {requested} is longer than the model's "
                f"max_position_embeddings ({self.max_position_embeddings}, "
                f"{self.path / 'config.json'}): positions past it were never trained. Set "
                f"{ALLOW_LONGER_CONTEXT_ENV}=1 to serve it anyway")
        return requested

    def token_id(self, key: str) -> int | None:
        """An id named by config.json (e.g. 'mask_token_id'); the first one if it is a list."""
        value = self.hf.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        return None if value is None else int(value)

    def eos_token_ids(self) -> list[int]:
        """EOS ids from config.json, else from generation_config.json; may be empty."""
        for source in (self.hf, read_json_object(self.path / "generation_config.json")):
            value = source.get("eos_token_id")
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
        return []


def _require(hf: dict[str, Any], key: str, where: Path) -> Any:
    if key not in hf:
        raise ValueError(f"{where}: required key {key!r} is missing")
    return hf[key]


@dataclass(frozen=True)
class RunnerConfig:
    """What the worker's model runner needs, resolved once in the parent (devices, dtypes and
    backends already chosen)."""

    model: ModelConfig
    block_size: int
    mask_id: int
    device: str
    dtype: str
    attention_backend: str
    moe_backend: str
    load_format: str = "auto"
    random_seed: int = 0
    page_size: int | None = None
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    max_running_requests: int = 16
    admit_ahead: int = 0  # request slots past max_running_requests (admitted, waiting to join)
    cuda_graphs: bool = False
    graph_max_blocks: int = 16
    chunked_prefill_size: int = 4096  # the scheduler's prefill budget (model/buckets.py)


def _int(value: Any, key: str, cfg_file: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{cfg_file}: {key} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{cfg_file}: {key} must be an integer, got {value!r}") from None
