"""Limits that protect the server, on one server that has them all: the API key on every route
but health and metrics (compared in constant time), a full queue (503, no retry) under load,
the body size cap (413), and the request timeout (408 / an error event) for a request that runs
too long, a client that sends its body slowly and one that never reads its stream. Last, a
SIGTERM drain that ends at once proves no request was left hanging in the server."""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from http_helpers import Server, pools_whole, start_server
from starlette.types import Message
from stress_helpers import (
    assert_clean_log,
    assert_openai_error,
    report,
    scale,
    sse_payloads,
)

from dllm_serve.http import auth

pytestmark = pytest.mark.stress

KEY = "sk-stress"
TIMEOUT_S = 3.0
PAYLOAD = 4096
OPEN = {"/health", "/health_generate", "/ready", "/metrics"}
POSTS = ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request", "/tokenize",
         "/v1/tokenize", "/detokenize", "/v1/detokenize")  # the routes that read a body
ENDLESS = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    s = start_server(tiny_model_dir, "--api-key", KEY, "--max-running-requests", "2",
                     "--max-queued-requests", "2", "--request-timeout", str(TIMEOUT_S),
                     "--max-payload-size", str(PAYLOAD), "--shutdown-timeout", "60",
                     "--served-model-name", "tiny")
    s.headers = {"authorization": f"Bearer {KEY}"}
    yield s
    s.stop()


# ---- API key -----------------------------------------------------------------------------------


def test_api_key_on_every_route_but_health_and_metrics(server: Server) -> None:
    paths = [p.replace("{model_id}", "tiny") for p in server.get("/openapi.json").json()["paths"]]
    wrong = [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
             {"authorization": f"Basic {KEY}"}, {"authorization": f"Bearer {KEY}x"},
             {"authorization": f"Bearer {KEY[:-1]}"}, {"authorization": "Bearer"}]
    checked = 0
    for path in [*paths, "/openapi.json", "/docs", "/no/such/route"]:
        method = "POST" if path in POSTS else "GET"
        for headers in wrong:
            r = httpx.request(method, server.url(path), headers=headers, json={}, timeout=30)
            checked += 1
            if path in OPEN:
                assert r.status_code != 401, path
            else:
                assert r.status_code == 401, (path, headers, r.status_code)
                assert assert_openai_error(r)["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
        right = httpx.request(method, server.url(path), headers=server.headers, json={},
                              timeout=30)
        assert right.status_code != 401, path  # e.g. 200, or 400 for the empty body
    good = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices
    report(f"limits: API key checked on {len(paths) + 3} routes x {len(wrong)} wrong "
           f"credentials ({checked} requests): 401 everywhere but {sorted(OPEN)}")


def test_api_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check goes through hmac.compare_digest on two SHA-256 digests (equal lengths,
    whatever the key sent), never `==` on the keys."""
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    passed: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        passed.append(scope["path"])

    async def sent(message: Message) -> None:
        pass

    middleware = auth.ApiKeyMiddleware(app, KEY)  # type: ignore[arg-type]
    for token in (KEY, "x", KEY * 100, ""):
        scope = {"type": "http", "path": "/v1/models",
                 "headers": [(b"authorization", f"Bearer {token}".encode())]}
        asyncio.run(middleware(scope, None, sent))  # type: ignore[arg-type]
    assert passed == ["/v1/models"] and len(calls) == 4
    assert all(len(a) == len(b) == 32 for a, b in calls)


# ---- queue and body limits ----------------------------------------------------------------------


def test_full_queue_under_load_is_503_without_retry(server: Server) -> None:
    """2 running + 2 queued at most; the rest get 503 with x-should-retry: false. Admitted
    requests are served, or, on this server with a 3 s request timeout, may get 408 when
    the load keeps them waiting that long (the long form's 200 clients on 2 cores do)."""
    n = scale(24, 200)
    peak = {"running": 0, "waiting": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            info = server.get("/get_server_info").json()
            peak["running"] = max(peak["running"], info["num_running_reqs"])
            peak["waiting"] = max(peak["waiting"], info["num_waiting_reqs"])
            time.sleep(0.02)

    def one(i: int) -> httpx.Response:
        body = {"prompt": f"queue {i}", "max_tokens": 40, "ignore_eos": True,
                "stream": i % 2 == 1, "dllm_threshold": 0.5}
        return server.post("/v1/completions", body)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(one, range(n)))
    done.set()
    watcher.join(5)
    codes = Counter(r.status_code for r in responses)
    assert set(codes) <= {200, 408, 503} and codes[200] >= 2 and codes[503] > 0, codes
    for r in responses:
        if r.status_code in (408, 503):
            assert r.headers["x-should-retry"] == "false"
            error = assert_openai_error(r)
            assert ("queue is full" in error["message"] if r.status_code == 503
                    else error["code"] == "request_timeout"), error
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert sse_payloads(r.text)[-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert r.json()["usage"]["completion_tokens"] == 40
    assert peak["running"] <= 2 and peak["waiting"] <= 2, peak
    pools_whole(server)
    report(f"limits: {n} concurrent requests against 2 running + 2 queued: {codes[200]} "
           f"served, {codes[503]} refused with 503 (no retry), {codes[408]} timed out (408)")


def chunked(total: int) -> Iterator[bytes]:
    """A body without Content-Length (chunked transfer): a valid request of `total` bytes."""
    head = b'{"prompt": "x", "max_tokens": 2, "user": "'
    yield head
    yield b"u" * (total - len(head) - 2)
    yield b'"}'


def test_body_size_cap_is_413(server: Server) -> None:
    for path in POSTS:
        for body in (b'{"prompt": "' + b"x" * PAYLOAD + b'"}', chunked(PAYLOAD + 1)):
            r = httpx.post(server.url(path), content=body, timeout=30,
                           headers={**server.headers, "content-type": "application/json"})
            assert r.status_code == 413, (path, r.text)
            assert "Payload Too Large" in assert_openai_error(r)["message"]
    at_limit = httpx.post(server.url("/v1/completions"), content=chunked(PAYLOAD), timeout=30,
                          headers={**server.headers, "content-type": "application/json"})
    assert at_limit.status_code == 200, at_limit.text  # at the limit: served
    assert at_limit.json()["usage"]["completion_tokens"] == 2


# ---- request timeout --------------------------------------------------------------------------


def timeouts_logged(server: Server) -> int:
    return server.log_text().count("passed --request-timeout")


def test_request_running_too_long_is_408_and_freed(server: Server) -> None:
    """408 with x-should-retry: false, so the openai client (2 retries here) does not retry."""
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=2)
    before = timeouts_logged(server)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failure:
        client.completions.create(model="tiny", prompt="long", max_tokens=3000,
                                  extra_body={"ignore_eos": True})
    assert time.monotonic() - start >= TIMEOUT_S
    assert failure.value.status_code == 408
    assert failure.value.response.headers["x-should-retry"] == "false"
    assert timeouts_logged(server) == before + 1  # sent once, not retried
    error = assert_openai_error(failure.value.response)
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    pools_whole(server)


def test_stream_running_too_long_ends_with_an_error_event(server: Server) -> None:
    with httpx.stream("POST", server.url("/v1/completions"), headers=server.headers,
                      json={**ENDLESS, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = sse_payloads(r.read().decode())
    assert events[0]["choices"][0]["finish_reason"] is None
    assert events[-1]["error"]["code"] == "request_timeout"
    pools_whole(server)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIError, match="request timeout"):
        for _ in client.completions.create(model="tiny", prompt="long", max_tokens=3000,
                                           stream=True, extra_body={"ignore_eos": True}):
            pass


def test_slow_body_is_408(server: Server) -> None:
    """The deadline covers reading the body: a client that stops halfway gets 408."""
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n{\"pro")
        start = time.monotonic()
        sock.settimeout(TIMEOUT_S + 30)
        head = sock.recv(65536)
        elapsed = time.monotonic() - start
    assert head.startswith(b"HTTP/1.1 408 "), head[:200]
    assert elapsed >= TIMEOUT_S - 0.5


def test_client_that_never_reads_its_stream_is_freed(server: Server) -> None:
    """The engine request is aborted at the timeout (KV freed) although the client reads
    nothing; when it finally reads, the stream ends with the timeout error."""
    host, port = server.base.removeprefix("http://").split(":")
    body = json.dumps({"text": "never read", "stream": True, "sampling_params": {
        "max_new_tokens": 3000, "ignore_eos": True}}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
        assert server.get("/get_server_info").json()["num_running_reqs"] == 1
        pools_whole(server, timeout=TIMEOUT_S + 5)  # freed while the client still reads nothing
        sock.settimeout(10)
        data = b""
        while b"data: [DONE]" not in data:
            part = sock.recv(1 << 16)
            assert part, "connection closed before [DONE]"
            data += part
    finally:
        sock.close()
    assert b'"code": "request_timeout"' in data


# ---- last: nothing is left hanging ----------------------------------------------------------


def test_drain_finds_nothing_in_flight(server: Server) -> None:
    """After slow, never-reading and timed-out clients, SIGTERM finds no request in flight:
    the server exits 0 within 30 s (its drain would otherwise wait --shutdown-timeout, 60 s)."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert_clean_log(server)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    elapsed = time.monotonic() - start
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
    report(f"limits: request timeout {TIMEOUT_S:g} s (408, stream error event, slow body, "
           f"never-reading client) and 413 on every POST route; SIGTERM then exited 0 in "
           f"{elapsed:.1f} s with nothing in flight")
