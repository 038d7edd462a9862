"""Issue 15: a Triton compile after "ready" is named, counted and traced, never silent
(kernels/compile_watch.py). On the CPU Triton compiles nothing, so these tests call the hooks
the watch installs in `triton.knobs.runtime` the way Triton's JIT does around a compile
(keyword arguments, `jit_cache_hook` before and `jit_post_compile_hook` after); the CUDA test
compiles a real kernel."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from local_engine import local_engine

from dllm_serve.kernels.compile_watch import CompileWatch
from dllm_serve.managers.round_trace import TRACE_ENV, Tracer

knobs = pytest.importorskip("triton").knobs
SIGNATURE = "_new_kernel[num_warps=4](X: *fp32)"


def simulate_compile(key: str = "k1", repr_: str = SIGNATURE) -> Any:
    """What Triton's JIT calls around one compile; returns the before-hook's answer."""
    runtime = knobs.runtime
    kwargs = {"key": key, "repr": repr_, "fn": None, "compile": {}, "is_manual_warmup": False,
              "already_compiled": False}
    answer = runtime.jit_cache_hook(**kwargs)
    if not answer:
        runtime.jit_post_compile_hook(**kwargs)
    return answer


@pytest.fixture
def clean_hooks():  # type: ignore[no-untyped-def]
    runtime = knobs.runtime
    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    yield runtime
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_each_compile_is_reported_with_its_kernel_and_time(clean_hooks: Any) -> None:
    seen: list[tuple[str, float]] = []
    watch = CompileWatch(lambda kernel, seconds: seen.append((kernel, seconds)))
    assert watch.start()
    simulate_compile("a")
    simulate_compile("b", "_other[num_warps=8](Y: *bf16)")
    assert watch.compiles == 2
    assert [k for k, _ in seen] == [SIGNATURE, "_other[num_warps=8](Y: *bf16)"]
    assert all(s >= 0.0 for _, s in seen)
    watch.stop()
    assert clean_hooks.jit_cache_hook is None and clean_hooks.jit_post_compile_hook is None


def test_hooks_installed_before_still_run_and_are_put_back(clean_hooks: Any) -> None:
    calls: list[str] = []

    def before(**kw: Any) -> bool:
        calls.append("before " + kw["key"])
        return kw["key"] == "skipped"  # a true answer: Triton skips that compile

    def after(**kw: Any) -> None:
        calls.append("after " + kw["key"])

    clean_hooks.jit_cache_hook, clean_hooks.jit_post_compile_hook = before, after
    watch = CompileWatch(lambda kernel, seconds: calls.append("watch"))
    watch.start()
    assert simulate_compile("skipped") is True  # the earlier hook's answer passes through
    assert simulate_compile("built") is False
    assert calls == ["before skipped", "before built", "after built", "watch"]
    assert watch.compiles == 1
    watch.stop()
    assert (clean_hooks.jit_cache_hook, clean_hooks.jit_post_compile_hook) == (before, after)


def test_the_worker_logs_counts_and_traces_a_compile(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, clean_hooks: Any) -> None:
    """Through the worker (as worker_main starts the watch once ready): the warning names the
    kernel, the next report counts it into the scheduler's stats (/metrics reads them), and
    the round trace holds a "compile" record."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    engine = local_engine(tiny_model_dir, "LowConfidence", fdfo=True)
    engine.worker.tracer = Tracer.from_env(torch.device("cpu"), {})
    watch = CompileWatch(engine.worker.compiled)
    watch.start()
    with caplog.at_level(logging.WARNING):
        simulate_compile()
    engine.submit("r", [5, 6, 7], max_new_tokens=8, ignore_eos=True)
    engine.run()
    watch.stop()
    assert engine.sched.stats["kernel_compiles_after_ready"] == 1
    assert f"Triton compiled {SIGNATURE} after ready" in caplog.text
    engine.worker.tracer.settle()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["kernel"] for r in records if r["kind"] == "compile"] == [SIGNATURE]


@pytest.mark.gpu
def test_a_real_compile_is_seen_once(clean_hooks: Any) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _fresh_kernel(X, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.arange(0, BLOCK)
        tl.store(X + i, tl.load(X + i, mask=i < n) + 1.0, mask=i < n)

    seen: list[tuple[str, float]] = []
    watch = CompileWatch(lambda kernel, seconds: seen.append((kernel, seconds)))
    assert watch.start()
    x = torch.zeros(16, device="cuda")
    for _ in range(3):
        _fresh_kernel[(1,)](x, 16, BLOCK=16)
    torch.cuda.synchronize()
    watch.stop()
    assert x.tolist() == [3.0] * 16
    assert len(seen) == 1 and "_fresh_kernel" in seen[0][0] and seen[0][1] > 0.0, seen
