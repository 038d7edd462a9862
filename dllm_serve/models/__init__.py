"""Model implementations, registered by their HF `architectures[0]` name."""

from __future__ import annotations

from torch import nn

from dllm_serve.models import llada2, sdar  # noqa: F401  (register their architectures)
from dllm_serve.models.registry import MODELS

__all__ = ["MODELS", "get_model_class"]


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class registered for `architecture`; an unknown name raises listing the known ones."""
    return MODELS.get(architecture)
