"""Shared fixtures: one tiny checkpoint per architecture per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run in the numpy interpreter without CUDA. Set before any kernel module is
# imported: `triton.jit` picks compiled or interpreted when the decorator runs.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

# A KV page or request slot leaked when the scheduler goes idle is fatal in tests.
os.environ.setdefault("DLLM_SERVE_STRICT_MEM_CHECK", "1")
# The tiny models gain nothing from intra-op threads, and test processes (engine children
# included: they inherit the variable) oversubscribe the 2-core CI machine without this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaDA2 checkpoint (seed 0, default preset); tests must not modify it."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llada2"), seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped when CUDA is missing."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense SDAR checkpoint (seed 0, default preset); tests must not modify it."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_sdar"), arch="sdar", seed=0)


@pytest.fixture(scope="session")
def tiny_sdar_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SDAR-MoE checkpoint (seed 0, default preset); tests must not modify it."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_sdar_moe"), arch="sdar_moe",
                                 seed=0)
