"""Process lifecycle and limits: health while starting, the built-in model, --api-key, a full
queue, SIGTERM drain, Ctrl-C in a terminal, a dead child; never an orphan process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from http_helpers import REPO, Server, pools_whole, shared_server, start_server

KEY = "sk-test-key"
DRAIN_WAIT_S = 900.0  # 96 tokens take seconds; this only stops a hang from blocking forever


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """No --model-path (the built-in model shipped in the package), an API key, and room for
    one running and one queued request. The module's last test stops it."""
    s = start_server(None, "--api-key", KEY, "--max-running-requests", "1",
                     "--max-queued-requests", "1")
    s.headers = {"authorization": f"Bearer {KEY}"}
    yield s
    s.stop()


def children_of(server: Server) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def assert_all_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, alive


def wait_admitted(server: Server, n: int, timeout: float = 60) -> None:
    """Until n requests are running or queued in the scheduler."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.get("/get_server_info").json()
        if info["num_running_reqs"] + info["num_waiting_reqs"] >= n:
            return
        assert time.monotonic() < deadline, "requests never arrived"
        time.sleep(0.02)


def post_in_threads(server: Server, bodies: list[dict], timeout: float | None = 120,
                    ) -> tuple[list, list[threading.Thread]]:
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda b=b: results.append(
        server.post("/v1/completions", b, timeout=timeout))) for b in bodies]
    for t in threads:
        t.start()
    return results, threads


def test_health_503_while_loading_then_built_in_model(server: Server) -> None:
    assert 503 in server.health_seen and server.health_seen[-1] == 200
    assert server.get("/v1/models").json()["data"][0]["id"] == "default_model"


def test_api_key_required_except_health_and_metrics(server: Server) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        r = httpx.post(server.url("/v1/completions"), json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for path in ("/v1/models", "/get_server_info"):
        assert httpx.get(server.url(path), timeout=30).status_code == 401
    for path in ("/health", "/health_generate", "/metrics", "/ready"):
        assert httpx.get(server.url(path), timeout=30).status_code == 200, path
    # a trailing slash gets the router's redirect to the open route, not a 401
    assert httpx.get(server.url("/metrics/"), timeout=30).status_code == 307
    assert server.post("/v1/completions", body).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    assert len(good.models.list().data) == 1


def test_full_queue_is_503_without_retry(server: Server) -> None:
    bodies = [{"prompt": f"queue {i}", "max_tokens": 300, "ignore_eos": True,
               "stream": i % 2 == 1} for i in range(6)]
    responses, threads = post_in_threads(server, bodies)
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) <= {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert r.headers["x-should-retry"] == "false"
            assert "queue is full" in r.json()["error"]["message"]  # JSON, even for a stream
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in r.text
    pools_whole(server)


def test_sigterm_drains_then_exits_with_no_children(server: Server) -> None:
    """In flight (one running, one queued) finish; new requests get 503; exit 0.

    Independent of the machine's speed: the running request is a stream whose first block has
    arrived when the signal goes out, so it is in flight whatever a forward costs, and it has
    only a few blocks left; the clients wait as long as the drain takes (up to DRAIN_WAIT_S, a
    bound for a hang, not a speed assumption)."""
    children = children_of(server)
    assert len(children) >= 2
    body = {"prompt": "drain me", "max_tokens": 96, "ignore_eos": True}  # 3 blocks each
    with httpx.stream("POST", server.url("/v1/completions"), json={**body, "stream": True},
                      headers=server.headers, timeout=DRAIN_WAIT_S) as stream:
        lines = stream.iter_lines()
        assert next(x for x in lines if x.startswith("data: "))  # its first block: running
        results, threads = post_in_threads(server, [body], timeout=DRAIN_WAIT_S)
        wait_admitted(server, 2)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = server.post("/v1/completions", {"prompt": "late", "max_tokens": 2})
        assert late.status_code == 503 and late.headers["x-should-retry"] == "false"
        assert server.get("/health").status_code == 503
        rest = [x for x in lines if x.startswith("data: ")]
    for t in threads:
        t.join(DRAIN_WAIT_S)
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    assert [r.status_code for r in results] == [200]
    assert results[0].json()["usage"]["completion_tokens"] == 96
    assert server.proc.wait(60) == 0
    assert_all_gone(children)


def test_ctrl_c_in_a_terminal_drains_too(tiny_model_dir: Path) -> None:
    """SIGINT to the whole process group: the engine's children ignore it, the server drains."""
    server = start_server(tiny_model_dir, new_session=True)
    try:
        children = children_of(server)
        results, threads = post_in_threads(server, [{"prompt": "x", "max_tokens": 100,
                                                     "ignore_eos": True}])
        wait_admitted(server, 1)
        os.killpg(server.proc.pid, signal.SIGINT)
        threads[0].join(120)
        assert results[0].status_code == 200
        assert results[0].json()["usage"]["completion_tokens"] == 100
        assert server.proc.wait(60) == 0
        assert_all_gone(children)
    finally:
        server.stop()


def test_dead_child_fails_requests_and_server_exits(tiny_model_dir: Path) -> None:
    server = start_server(tiny_model_dir)
    try:
        children = children_of(server)
        engine = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(engine) == 2  # the scheduler and the worker
        body = {"prompt": "crash", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(x for x in lines if x.startswith("data: "))
            os.kill(engine[-1].pid, signal.SIGKILL)
            rest = [x[6:] for x in lines if x.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert "died" in error["message"] and error["type"] == "server_error"
        assert "request id req-" in error["message"]  # a short message, no internals:
        assert not any(w in error["message"] for w in ("Traceback", "File ", ".py", "\n"))
        assert server.proc.wait(30) == 1
        assert "the engine died" in server.log_text()
        assert_all_gone(children)
    finally:
        server.stop()


def test_busy_port_or_broken_model_exits_1(tiny_model_dir: Path, tmp_path: Path) -> None:
    shared = shared_server(tiny_model_dir)
    port = shared.base.rsplit(":", 1)[1]
    busy = subprocess.run([sys.executable, "-m", "dllm_serve", "--model-path",
                           str(tiny_model_dir), "--port", port], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert busy.returncode == 1 and "address already in use" in busy.stderr
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="exited with 1") as failure:
        start_server(broken)
    log = str(failure.value)
    # the worker's traceback once (its log), then one line naming the file, not three nested
    assert "startup failed" in log and log.count("Traceback") == 1, log
    last = next(line for line in log.splitlines() if "startup failed" in line)
    assert "model.safetensors: not a readable safetensors file" in last, last
