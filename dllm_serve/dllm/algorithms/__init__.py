"""Decoding algorithms, registered by class name (`--dllm-algorithm NAME`).

A plugin outside the package is named `package.module:ClassName`: the module is imported (it
registers its class with `@ALGORITHMS.register()`), then the class is looked up like any other;
benchmarks and tests register their own algorithms this way, without the engine shipping them.
"""

from __future__ import annotations

import importlib

from dllm_serve.dllm.algorithms import joint_threshold, low_confidence  # noqa: F401 (register)
from dllm_serve.dllm.algorithms.base import DllmAlgorithm, StepOutput
from dllm_serve.dllm.algorithms.registry import ALGORITHMS
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.config import DllmConfig


def algorithm_class(name: str) -> type[DllmAlgorithm]:
    """The class registered as `name` (or `module:Class` after importing the module); unknown
    names raise ValueError listing the known ones."""
    if ":" in name:
        module, name = name.rsplit(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"cannot import the algorithm plugin module {module!r}: {e}"
                             ) from None
    try:
        return ALGORITHMS.get(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from None


def build_algorithm(config: DllmConfig) -> DllmAlgorithm:
    cls = algorithm_class(config.algorithm)
    return cls.from_dict(config.algorithm_config, config.block_size, config.mask_id)


__all__ = ["ALGORITHMS", "DenoiseBatch", "DllmAlgorithm", "StepOutput", "algorithm_class",
           "build_algorithm"]
