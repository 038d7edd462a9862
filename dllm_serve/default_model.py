"""The model served when no --model-path is given: the small trained dLLM shipped in the package
(dllm_serve/assets/default_model/, see its README for how it was trained and how good it is)."""

from __future__ import annotations

from pathlib import Path

PACKAGED = Path(__file__).parent / "assets" / "default_model"


def resolve_model_path(path: str | None) -> str:
    return path if path is not None else str(default_model_path())


def default_model_path() -> Path:
    if not (PACKAGED / "config.json").is_file():
        raise FileNotFoundError(f"the built-in model is missing from {PACKAGED} (a broken "
                                f"install?); pass --model-path")
    return PACKAGED
