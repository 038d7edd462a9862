"""The model served when no --model-path is given.

Until a trained small model ships inside the package, this is a tiny random LLaDA2 checkpoint
built on first use into a cache folder ($DLLM_SERVE_CACHE, default ~/.cache/dllm-serve).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PACKAGED = Path(__file__).parent / "assets" / "default_model"
TINY_NAME = "default-tiny-v1"


def resolve_model_path(path: str | None) -> str:
    return path if path is not None else str(default_model_path())


def default_model_path() -> Path:
    if (PACKAGED / "config.json").is_file():
        return PACKAGED
    cache = Path(os.environ.get("DLLM_SERVE_CACHE", Path.home() / ".cache" / "dllm-serve"))
    target = cache / TINY_NAME
    if not (target / "config.json").is_file():
        _build_atomically(target)
    return target


def _build_atomically(target: Path) -> None:
    from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        build_tiny_checkpoint(tmp, seed=0)
        try:
            tmp.rename(target)
        except OSError:  # another process built it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
