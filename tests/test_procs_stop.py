"""ProcessSet.kill: the engine's stop gives its children a grace period to exit by themselves
(they got Shutdown) before it signals them, since a child's SIGTERM can be lost: the child
turns it into SystemExit, and Python swallows that when it lands in a __del__ or a gc callback.
The children here stand for such a worker by ignoring SIGTERM outright."""

from __future__ import annotations

import signal
import time

from dllm_serve.managers.ipc import Addresses
from dllm_serve.managers.procs import ProcessSet, spawn


def sleeper(seconds: float, ignore_sigterm: bool) -> None:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


def start(seconds: float, ignore_sigterm: bool) -> ProcessSet:
    procs = ProcessSet(Addresses.fresh(), spawn({"child": (sleeper, (seconds, ignore_sigterm))}))
    time.sleep(0.5)  # the child has installed its handler (spawn's start takes ~0.1 s here)
    return procs


def test_a_child_that_exits_within_the_grace_period_is_never_signalled() -> None:
    procs = start(1.5, ignore_sigterm=True)
    procs.kill(timeout=0.2, grace=10.0)
    assert procs.procs["child"].exitcode == 0  # it ran to its end: no SIGKILL


def test_without_grace_a_child_deaf_to_sigterm_is_killed() -> None:
    """What the engine's stop did before: the worker that lost its SIGTERM was SIGKILLed, and
    whatever it had not written yet (its round trace) was lost."""
    procs = start(30.0, ignore_sigterm=True)
    procs.kill(timeout=0.2)
    assert procs.procs["child"].exitcode == -signal.SIGKILL


def test_a_child_still_running_after_the_grace_period_gets_sigterm() -> None:
    procs = start(30.0, ignore_sigterm=False)
    procs.kill(timeout=5.0, grace=0.2)
    assert procs.procs["child"].exitcode == -signal.SIGTERM
