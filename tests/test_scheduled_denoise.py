"""The benchmark-only ScheduledDenoise plugin: its forward counts follow the configured
distribution, and a block takes exactly its drawn count through the real worker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from local_engine import FakeRunner

from benchmarks.scheduled_denoise import ScheduledConfig, ScheduledDenoise
from dllm_serve.dllm.algorithms import algorithm_class
from dllm_serve.dllm.modes import RoundMode
from dllm_serve.managers.messages import AddPages, Admit, ReqSettings
from dllm_serve.managers.worker import Worker

K, M = 32, 15


def test_registered_as_a_plugin_by_module_path() -> None:
    assert algorithm_class("benchmarks.scheduled_denoise:ScheduledDenoise") is ScheduledDenoise
    with pytest.raises(ValueError, match="cannot import"):
        algorithm_class("no_such_module:X")
    with pytest.raises(ValueError, match="known"):
        algorithm_class("benchmarks.scheduled_denoise:Nope")


def test_lognormal_and_histogram_draws() -> None:
    algo = ScheduledDenoise(ScheduledConfig(), K, M)
    draws = np.array([algo.forwards(seed, 32 * j) for seed in range(50) for j in range(40)])
    assert draws.min() >= 2 and draws.max() <= 32
    assert 11.0 < draws.mean() < 13.0  # mean 12 (the clamp moves it a little)
    assert algo.forwards(3, 64) == algo.forwards(3, 64)  # a pure function of (seed, start)
    path = Path(__file__).parents[1] / "benchmarks" / "data" / "default_model_block_forwards.json"
    hist = json.loads(path.read_text())["histogram"]
    want = sum(int(k) * v for k, v in hist.items()) / sum(hist.values())
    algo = ScheduledDenoise(ScheduledConfig(histogram=str(path)), K, M)
    draws = np.array([algo.forwards(seed, 32 * j) for seed in range(50) for j in range(40)])
    assert abs(draws.mean() - want) < 1.0 and set(draws.tolist()) <= {int(k) for k in hist}


def test_each_block_takes_its_drawn_forward_count() -> None:
    algo = ScheduledDenoise(ScheduledConfig(), K, M)
    worker = Worker(FakeRunner(K, 64, K, vocab=32), algo, RoundMode(), report_every_s=0.0)  # type: ignore[arg-type]
    items = [AddPages(0, 0, np.arange(8)),
             Admit(1, 0, 0, np.full((1, K), M), [None], [0],
                   ReqSettings(prompt_len=0, max_end=4 * K, seed=5))]
    forwards = {}
    for i in range(200):
        report = worker.iterate(items if i == 0 else [])
        if report is not None and report.retired is not None:
            forwards.update(zip(report.retired.starts.tolist(), report.retired.forwards.tolist(),
                                strict=True))
        if worker.idle:
            break
    assert forwards == {s: algo.forwards(5, s) for s in range(0, 4 * K, K)}
