"""Decoding algorithms, registered by class name (`--dllm-algorithm NAME`)."""

from __future__ import annotations

from dllm_serve.dllm.algorithms import joint_threshold, low_confidence  # noqa: F401 (register)
from dllm_serve.dllm.algorithms.base import DllmAlgorithm
from dllm_serve.dllm.algorithms.registry import ALGORITHMS
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.dllm.rounds import RoundMode, RoundOutput


def algorithm_class(name: str) -> type[DllmAlgorithm]:
    """The class registered as `name`; unknown names raise ValueError listing the known ones."""
    try:
        return ALGORITHMS.get(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from None


def build_algorithm(config: DllmConfig) -> DllmAlgorithm:
    cls = algorithm_class(config.algorithm)
    return cls.from_dict(config.algorithm_config, config.block_size, config.mask_id)


__all__ = ["ALGORITHMS", "DenoiseBatch", "DllmAlgorithm", "RoundMode", "RoundOutput",
           "algorithm_class", "build_algorithm"]
