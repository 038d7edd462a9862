"""The algorithm registry: classes register under their class name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dllm_serve.utils.registry import Registry

if TYPE_CHECKING:
    from dllm_serve.dllm.algorithms.base import DllmAlgorithm

ALGORITHMS: Registry[type[DllmAlgorithm]] = Registry("dLLM algorithm")
