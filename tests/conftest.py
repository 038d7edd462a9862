"""Shared fixtures: one tiny LLaDA2 checkpoint per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

# A KV page or request slot leaked when the scheduler goes idle is fatal in tests.
os.environ.setdefault("DLLM_SERVE_STRICT_MEM_CHECK", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaDA2 checkpoint (seed 0, default preset); tests must not modify it."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llada2"), seed=0)
