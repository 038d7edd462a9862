"""ProcessSet.kill: the engine's stop gives its children a grace period to exit by themselves
(they got Shutdown) before it signals them, since a child's SIGTERM can be lost: the child
turns it into SystemExit, and Python swallows that when it lands in a __del__ or a gc callback.
The children here stand for such a worker by ignoring SIGTERM outright. And a process that
froze its startup objects (procs.freeze_startup_objects) exits without nanobind's warnings."""

from __future__ import annotations

import signal
import subprocess
import sys
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
    procs = ProcessSet(Addresses.fresh(), spawn({"child": (f"{__name__}:sleeper", (
        seconds, ignore_sigterm, str(ready)))}))
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


def test_a_process_that_froze_its_startup_objects_exits_without_leak_warnings() -> None:
    """freeze_startup_objects hands the frozen objects back at exit: left frozen, Triton's
    native objects outlive the interpreter and nanobind prints its "leaked" warnings (~30
    lines at every server stop, from the front and the worker)."""
    code = ("import triton, triton.language\n"
            "from dllm_serve.managers.procs import freeze_startup_objects\n"
            "assert freeze_startup_objects() > 0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "nanobind" not in out.stderr, out.stderr[:500]
    left_frozen = subprocess.run([sys.executable, "-c", "import gc, triton\ngc.freeze()\n"],
                                 capture_output=True, text=True, timeout=120, check=True)
    assert "nanobind: leaked" in left_frozen.stderr  # what the hand-back prevents


def ends(how: str) -> None:
    if how == "raise":
        raise RuntimeError("the child's own error")
    if how == "exit":
        raise SystemExit(3)


def test_a_child_leaves_with_its_own_exit_code() -> None:
    """_child_main ends every child with os._exit: 0 when its entry point returns, SystemExit's
    code, 1 when it fails (its traceback printed first, as multiprocessing would); an entry
    point that is not "module:function" fails the same way."""
    entries = {h: (f"{__name__}:ends", (h,)) for h in ("return", "exit", "raise")}
    entries["unnamed"] = (f"{__name__}.ends", ("return",))
    procs = ProcessSet(Addresses.fresh(), spawn(entries))
    for p in procs.procs.values():
        p.join(60)
    codes = {name: p.exitcode for name, p in procs.procs.items()}
    procs.kill()
    assert codes == {"return": 0, "exit": 3, "raise": 1, "unnamed": 1}
