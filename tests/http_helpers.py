"""Run the real `python -m dllm_serve` in a subprocess for the HTTP tests.

`shared_server` starts one server per test session for every module that does not need its
own flags or kill it (each start costs seconds on a small CPU machine); it stops at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
SHARED_FLAGS = ("--max-running-requests", "8", "--max-payload-size", "65536",
                "--served-model-name", "tiny")
_shared: dict[str, Server] = {}
_dirs: dict[str, str] = {}


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    health_seen: list[int] = field(default_factory=list)  # /health codes while starting
    headers: dict[str, str] = field(default_factory=dict)  # sent by get() and post()

    def url(self, path: str) -> str:
        return self.base + path

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url(path), headers=self.headers, timeout=60, **kw)

    def post(self, path: str, body: Any = None, timeout: float | None = 120,
             **kw: Any) -> httpx.Response:
        return httpx.post(self.url(path), json=body, headers=self.headers, timeout=timeout, **kw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _log_dir() -> str:
    """The folder for this test process's server logs: $DLLM_SERVE_TEST_LOGS (kept), else a
    temporary one removed at exit."""
    if "logs" not in _dirs:
        keep = os.environ.get("DLLM_SERVE_TEST_LOGS")
        if keep:
            os.makedirs(keep, exist_ok=True)
            _dirs["logs"] = keep
        else:
            _dirs["logs"] = tempfile.mkdtemp(prefix="dllm-serve-test-logs-")
            atexit.register(shutil.rmtree, _dirs["logs"], ignore_errors=True)
    return _dirs["logs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path | None, *flags: str, env: dict[str, str] | None = None,
                 new_session: bool = False, timeout: float = 180.0) -> Server:
    """Start a server on a free port and wait until /health is 200 (raise if it exits).

    new_session: in its own process group, as a server started from a terminal is."""
    port = free_port()
    model = ["--model-path", str(model_dir)] if model_dir is not None else []
    cmd = [sys.executable, "-m", "dllm_serve", *model, "--device", "cpu",
           "--port", str(port), *flags]
    log = Path(tempfile.mkstemp(prefix="server-", suffix=".log", dir=_log_dir())[1])
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            start_new_session=new_session, preexec_fn=_stop_with_tests)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    _wait_healthy(server, timeout)
    return server


def _stop_with_tests() -> None:
    """In the server, before exec: SIGTERM it if the test process dies without cleaning up
    (Linux's PR_SET_PDEATHSIG), so a killed test run leaves no server behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n"
                               f"{server.log_text()[-3000:]}")
        try:
            code = httpx.get(server.url("/health"), timeout=5).status_code
            server.health_seen.append(code)
            if code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    raise TimeoutError(f"server not healthy in {timeout} s:\n{server.log_text()[-3000:]}")


def shared_server(model_dir: Path) -> Server:
    """The session's shared server (SHARED_FLAGS), started on first use."""
    if "server" not in _shared or _shared["server"].proc.poll() is not None:
        server = start_server(model_dir, *SHARED_FLAGS)
        atexit.register(server.stop)
        _shared["server"] = server
    return _shared["server"]


def whole(info: dict[str, Any]) -> bool:
    """Idle, every request slot free, and every KV page free or held by the radix cache for
    nobody (evictable): free + cached-evictable == total, none reserved."""
    kv, req, cache = info["kv_pool"], info["req_pool"], info["radix_cache"]
    return (kv["free_pages"] + cache["evictable_pages"] == kv["total_pages"]
            and cache["evictable_pages"] == cache["cached_pages"] and kv["reserved_pages"] == 0
            and req["free_slots"] == req["total_slots"]
            and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0)


def held_pages(info: dict[str, Any]) -> int:
    """KV pages held by requests: neither free nor cached-evictable (0 when idle and whole)."""
    kv = info["kv_pool"]
    return kv["total_pages"] - kv["free_pages"] - info["radix_cache"]["evictable_pages"]


def pools_whole(server: Server, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the scheduler is idle with its pools whole (see `whole`)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.get("/get_server_info").json()
        kv, req = info["kv_pool"], info["req_pool"]
        if whole(info):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not whole after {timeout} s: {kv} {req} "
                                 f"{info['radix_cache']}")
        time.sleep(0.1)


def sse_events(lines: Any) -> list[Any]:
    """Parse `data: ...` SSE lines into JSON objects, stopping at [DONE] (kept as the string)."""
    import json

    events: list[Any] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            events.append(data)
            break
        events.append(json.loads(data))
    return events
