"""procs.profiled: a process loop under cProfile when its variable names a path prefix; and
procs.warn_long_gc, the --gc-warning-threshold-secs hook."""

from __future__ import annotations

import os
import pstats

import pytest

from dllm_serve.managers.procs import profiled

ENV = "DLLM_SERVE_TEST_PROFILE"


def busy_loop(out: list[int], stop_with: BaseException | None = None) -> None:
    out.append(sum(range(1000)))
    if stop_with is not None:
        raise stop_with


def test_without_the_variable_the_loop_runs_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    out: list[int] = []
    profiled(ENV, busy_loop, out)
    assert out == [499500] and list(tmp_path.iterdir()) == []


def test_the_stats_name_the_loop(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "prof"))
    out: list[int] = []
    profiled(ENV, busy_loop, out)
    path = tmp_path / f"prof.{os.getpid()}"
    assert out == [499500]
    names = {fn for _, _, fn in pstats.Stats(str(path)).stats}  # type: ignore[attr-defined]
    assert "busy_loop" in names


def test_a_loop_stopped_by_sigterm_still_writes_its_stats(tmp_path, monkeypatch):
    """The processes turn SIGTERM into SystemExit; the stats are written on the way out."""
    monkeypatch.setenv(ENV, str(tmp_path / "prof"))
    with pytest.raises(SystemExit):
        profiled(ENV, busy_loop, [], SystemExit(0))
    assert (tmp_path / f"prof.{os.getpid()}").stat().st_size > 0


def test_warn_long_gc_logs_collections_over_the_threshold(caplog):
    """--gc-warning-threshold-secs: a collection longer than the threshold is logged as a
    warning (a threshold of a nanosecond: every collection); 0 installs nothing."""
    import gc
    import logging

    from dllm_serve.managers.procs import warn_long_gc

    before = list(gc.callbacks)
    warn_long_gc(0.0)
    assert gc.callbacks == before
    warn_long_gc(1e-9)
    try:
        with caplog.at_level(logging.WARNING, logger="dllm_serve.managers.procs"):
            gc.collect()
        assert any("garbage collection paused this process" in r.getMessage()
                   and "generation 2" in r.getMessage() for r in caplog.records)
    finally:
        gc.callbacks[:] = before
