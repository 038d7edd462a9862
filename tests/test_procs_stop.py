"""ProcessSet.kill: the engine's stop gives its children a grace period to exit by themselves
(they got Shutdown) before it signals them, since a child's SIGTERM can be lost: the child
turns it into SystemExit, and Python swallows that when it lands in a __del__ or a gc callback.
The children here stand for such a worker by ignoring SIGTERM outright."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from dllm_serve.managers.ipc import Addresses
from dllm_serve.managers.procs import ProcessSet, spawn


def sleeper(seconds: float, ignore_sigterm: bool, ready: str) -> None:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(ready).touch()
    time.sleep(seconds)


def start(tmp_path: Path, seconds: float, ignore_sigterm: bool) -> ProcessSet:
    """A child that sleeps `seconds`, once it has installed its handler."""
    ready = tmp_path / "ready"
    procs = ProcessSet(Addresses.fresh(), spawn({"child": (sleeper, (seconds, ignore_sigterm,
                                                                    str(ready)))}))
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists()
    return procs


def test_a_child_that_exits_within_the_grace_period_is_never_signalled(tmp_path: Path) -> None:
    procs = start(tmp_path, 1.0, ignore_sigterm=True)
    procs.kill(timeout=0.2, grace=10.0)
    assert procs.procs["child"].exitcode == 0  # it ran to its end: no SIGKILL


def test_without_grace_a_child_deaf_to_sigterm_is_killed(tmp_path: Path) -> None:
    """What the engine's stop did before: the worker that lost its SIGTERM was SIGKILLed, and
    whatever it had not written yet (its round trace) was lost."""
    procs = start(tmp_path, 30.0, ignore_sigterm=True)
    procs.kill(timeout=0.2)
    assert procs.procs["child"].exitcode == -signal.SIGKILL


def test_a_child_still_running_after_the_grace_period_gets_sigterm(tmp_path: Path) -> None:
    procs = start(tmp_path, 30.0, ignore_sigterm=False)
    procs.kill(timeout=5.0, grace=0.2)
    assert procs.procs["child"].exitcode == -signal.SIGTERM
