"""Scale-out: sglang-router (SGLang's own router, from the test extras) over two dllm-serve
replicas of the tiny model on the CPU. Completions, chat, streams and /generate all succeed
through it, and both replicas serve some."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_helpers import REPO, Server, free_port, pools_whole, sse_events, start_server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                reason="sglang-router is not installed (pip install -e .[test])")

ROUNDS = 4  # of each request kind
USER = [{"role": "user", "content": "Question: 2 + 3 =\nAnswer:"}]
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "completion": ("/v1/completions", {"model": "default", "prompt": "2 + 3 =", "max_tokens": 8}),
    "chat": ("/v1/chat/completions", {"model": "default", "messages": USER, "max_tokens": 8}),
    "completion_stream": ("/v1/completions", {"model": "default", "prompt": "1 + 1 =",
                                              "max_tokens": 40, "stream": True,
                                              "ignore_eos": True}),
    "chat_stream": ("/v1/chat/completions", {"model": "default", "messages": USER,
                                             "max_tokens": 40, "stream": True}),
    "generate": ("/generate", {"text": "3 + 4 =", "sampling_params": {"max_new_tokens": 8}}),
    "generate_stream": ("/generate", {"text": "5 + 6 =", "stream": True, "sampling_params": {
        "max_new_tokens": 40, "ignore_eos": True}}),
}


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path):
    servers = [start_server(tiny_model_dir, "--max-running-requests", "4") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def router(replicas: list[Server], tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin", "--log-level", "warn",
           "--worker-urls", *[s.base for s in replicas]]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, base, log)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def _wait_ready(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.post(f"{base}/v1/completions", json=KINDS["completion"][1],
                          timeout=30).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(log.read_text()[-3000:])


def _send(base: str, kind: str) -> str:
    path, body = KINDS[kind]
    if not body.get("stream"):
        r = httpx.post(base + path, json=body, timeout=120)
        assert r.status_code == 200, (kind, r.status_code, r.text)
        out = r.json()
        return out["text"] if path == "/generate" else str(out["choices"][0])
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, (kind, r.status_code)
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    return kind


def _served(server: Server) -> float:
    return server.get("/server_info").json()["stats"]["committed_blocks"]


def test_router_serves_every_kind_over_both_replicas(replicas: list[Server],
                                                      router: str) -> None:
    before = [_served(s) for s in replicas]
    kinds = [k for k in KINDS for _ in range(ROUNDS)]
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda k: _send(router, k), kinds))
    assert len(done) == len(kinds)  # every request answered 200 (asserted in _send)
    after = [_served(s) for s in replicas]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    for s in replicas:
        pools_whole(s)
