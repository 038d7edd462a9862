"""The model registry: architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from dllm_serve.utils.registry import Registry

MODELS: Registry[type[nn.Module]] = Registry("model architecture")
