"""Faults: an engine process killed mid-round, a request whose KV can never fit, KV memory
nearly full under load, and clients that send their body slowly or never read their stream.

A killed scheduler or worker: /health stops answering 200 at once, every in-flight request
gets an error (a 500 JSON answer, or an error event then [DONE] in a stream), new requests are
refused, and the server exits with code 1 within seconds with every child process gone.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from http_helpers import Server, held_pages, pools_whole, start_server
from stress_helpers import (
    SEED,
    assert_clean_log,
    assert_openai_error,
    counters,
    delta,
    engine_children,
    report,
    scale,
    sse_payloads,
)

from dllm_serve.tokenizer import Tokenizer

pytestmark = pytest.mark.stress

ENDLESS = {"max_tokens": 3000, "ignore_eos": True}  # runs far longer than the test waits
EXIT_WITHIN_S = 15.0
KILLS = scale(1, 5)  # per process
KV_TOKENS = 512  # --max-total-tokens of the KV tests: 16 pages of 32


class HealthProbe:
    """Polls /health in a thread; records (time, status or 0 when refused)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.seen: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                code = httpx.get(self.server.url("/health"), timeout=2).status_code
            except httpx.TransportError:
                code = 0
            self.seen.append((time.monotonic(), code))
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def stream_until_first_event(server: Server, path: str, body: dict[str, Any],
                             started: threading.Event) -> list[Any]:
    """A stream that signals once its first event arrived, then reads to the end."""
    text = ""
    with httpx.stream("POST", server.url(path), json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for part in r.iter_text():
            text += part
            if "\n\n" in text:
                started.set()
    return sse_payloads(text)


def wait_running(server: Server, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.get("/get_server_info").json()["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.02)


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_engine_process_killed_mid_round(tiny_model_dir: Path, victim: str) -> None:
    """Short form: one kill per process; long form: KILLS, each at a random moment."""
    rng = random.Random(SEED)
    exits = [kill_mid_round(tiny_model_dir, victim, rng.uniform(0, 0.5) if i else 0.0)
             for i in range(KILLS)]
    report(f"fault: {victim} killed mid-round {KILLS} time(s) with 4 requests in flight: "
           f"every request got an error, the server exited 1 after {min(exits):.1f}-"
           f"{max(exits):.1f} s, every child gone")


def kill_mid_round(tiny_model_dir: Path, victim: str, delay: float) -> float:
    """Start a server, put 4 requests in flight, SIGKILL `victim` `delay` s after they run;
    check the outcome and return how long the server took to exit."""
    server = start_server(tiny_model_dir, "--served-model-name", "tiny")
    try:
        children = engine_children(server)
        all_children = psutil.Process(server.proc.pid).children(recursive=True)
        started = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(4) as pool:
            streams = [
                pool.submit(stream_until_first_event, server, "/v1/completions",
                            {"prompt": "kill", **ENDLESS}, started[0]),
                pool.submit(stream_until_first_event, server, "/generate",
                            {"text": "kill", "sampling_params": {"max_new_tokens": 3000,
                                                                 "ignore_eos": True}},
                            started[1])]
            plain = [pool.submit(server.post, "/v1/completions", {"prompt": "k", **ENDLESS}),
                     pool.submit(server.post, "/v1/chat/completions", {
                         "messages": [{"role": "user", "content": "k"}], **ENDLESS})]
            assert all(e.wait(60) for e in started)
            wait_running(server, 4)
            time.sleep(delay)
            probe = HealthProbe(server)
            killed_at = time.monotonic()
            os.kill(children[victim].pid, signal.SIGKILL)
            code = server.proc.wait(EXIT_WITHIN_S)
            exit_s = time.monotonic() - killed_at
            probe.close()
            stream_events = [f.result(10) for f in streams]
            answers = [f.result(10) for f in plain]
        assert code == 1
        codes = [c for _, c in probe.seen]
        down = next(i for i, c in enumerate(codes) if c != 200)  # 503, then refused (0)
        assert set(codes[down:]) <= {503, 0}, codes  # never healthy again
        for events in stream_events:
            error = events[-1]["error"]
            assert error["type"] == "server_error" and "died" in error["message"], error
        for r in answers:
            assert r.status_code == 500, r.text
            assert "died" in assert_openai_error(r)["message"]
        _, alive = psutil.wait_procs(all_children, timeout=10)
        assert not alive, alive
        assert "the engine died" in server.log_text()
        return exit_s
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_kv(tiny_model_dir: Path) -> Server:
    s = start_server(tiny_model_dir, "--max-total-tokens", str(KV_TOKENS),
                     "--max-running-requests", "8", "--served-model-name", "tiny")
    yield s
    s.stop()


def test_request_whose_kv_can_never_fit_is_400(small_kv: Server, tiny_model_dir: Path) -> None:
    """prompt + max_tokens within the context but beyond the whole KV pool: a clear 400."""
    prompt_len = len(Tokenizer.load(tiny_model_dir).encode("too big"))
    big = {"prompt": "too big", "max_tokens": KV_TOKENS, "ignore_eos": True}
    for stream in (False, True):
        r = small_kv.post("/v1/completions", {**big, "stream": stream})
        assert r.status_code == 400, r.text
        message = assert_openai_error(r)["message"]
        assert f"needs {KV_TOKENS + 32} KV tokens" in message, message
        assert f"KV pool holds ({KV_TOKENS}; see --max-total-tokens)" in message
    r = small_kv.post("/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": KV_TOKENS}})
    assert r.status_code == 400 and "KV pool" in assert_openai_error(r)["message"]
    fits = small_kv.post("/v1/completions", {**big, "max_tokens": KV_TOKENS - prompt_len})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] > 0
    pools_whole(small_kv)


def test_left_out_max_tokens_never_fails_on_a_small_kv_pool(small_kv: Server) -> None:
    """Regression: a request that left max_tokens out got a default that could not fit the KV
    pool (prompt + OpenAI's 16 or SGLang's 128), a 400 for a length it had not asked for. The
    default is cut to what fits, as SGLang does; chat's default is all that fits."""
    chat = small_kv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
        "dllm_threshold": 0.0})
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == KV_TOKENS
    cmpl = small_kv.post("/v1/completions", {"prompt": [5] * (KV_TOKENS - 12),
                                             "ignore_eos": True})
    assert cmpl.status_code == 200, cmpl.text
    assert cmpl.json()["usage"]["completion_tokens"] == 12  # not 16
    native = small_kv.post("/generate", {"input_ids": [5] * (KV_TOKENS - 62),
                                         "sampling_params": {"ignore_eos": True}})
    assert native.status_code == 200, native.text
    assert native.json()["meta_info"]["completion_tokens"] == 62  # not 128
    explicit = small_kv.post("/v1/completions", {"prompt": [5] * (KV_TOKENS - 12),
                                                 "max_tokens": 16})
    assert explicit.status_code == 400 and "KV pool" in assert_openai_error(explicit)["message"]
    pools_whole(small_kv)


def test_kv_nearly_full_under_load(small_kv: Server) -> None:
    """Far more requests than the pool holds at once: they wait for pages and all complete."""
    n = scale(40, 400)
    peak = {"used": 0, "waiting": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            info = small_kv.get("/get_server_info").json()
            peak["used"] = max(peak["used"], held_pages(info)
                               + info["kv_pool"]["reserved_pages"])
            peak["waiting"] = max(peak["waiting"], info["num_waiting_reqs"])
            time.sleep(0.05)

    def one(i: int) -> httpx.Response:
        body = {"prompt": "fill " * (1 + i % 20), "max_tokens": 60 + (i * 37) % 100,
                "ignore_eos": True, "stream": i % 3 == 0, "dllm_threshold": 0.5}
        return small_kv.post("/v1/completions", body)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(one, range(n)))
    elapsed = time.monotonic() - start
    done.set()
    watcher.join(5)
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        if i % 3 == 0:
            assert r.text.endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 60 + (i * 37) % 100
    total_pages = KV_TOKENS // 32
    assert peak["waiting"] > 0 and peak["used"] >= total_pages - 7, peak
    info = pools_whole(small_kv)
    assert_clean_log(small_kv)
    report(f"fault: KV pool of {total_pages} pages, {n} concurrent requests of up to 7 pages: "
           f"all completed in {elapsed:.1f} s, peak {peak['used']} pages in use or reserved, "
           f"up to {peak['waiting']} waiting; pages leaked "
           f"{held_pages(info)}")


def raw_request(server: Server, path: str, body: bytes, send: int | None = None,
                rcvbuf: int | None = None) -> socket.socket:
    """A socket that sent a POST's head and the first `send` bytes of its body (all if None)."""
    host, port = server.base.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:send])
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and (de-chunked) body of the answer on `sock`."""
    sock.settimeout(60)
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    return answer.status, answer.read()


def test_slow_and_unread_clients_hold_only_their_connection(small_kv: Server) -> None:
    """Without --request-timeout (the default): a client that stops halfway through its body
    and one that never reads its stream hold nothing but their connections. Others are served
    meanwhile, the unread request runs to its end and frees its KV pages, and both clients get
    complete answers when they go on."""
    slow_body = json.dumps({"prompt": "slow", "max_tokens": 8}).encode()
    unread_body = json.dumps({"text": "unread", "stream": True, "sampling_params": {
        "max_new_tokens": 300, "ignore_eos": True}}).encode()
    finished = "dllm:num_requests_total{finish_reason=length}"
    before = counters(small_kv)
    slow = raw_request(small_kv, "/v1/completions", slow_body, send=len(slow_body) // 2)
    unread = raw_request(small_kv, "/generate", unread_body, rcvbuf=4096)
    try:
        other = small_kv.post("/v1/completions", {"prompt": "meanwhile", "max_tokens": 8})
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 8
        deadline = time.monotonic() + 60
        while delta(before, counters(small_kv), finished) < 2:  # the unread one, too
            assert time.monotonic() < deadline, counters(small_kv)
            time.sleep(0.05)
        pools_whole(small_kv)
        slow.sendall(slow_body[len(slow_body) // 2:])
        status, answer = read_response(slow)
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 8
        status, stream = read_response(unread)
    finally:
        slow.close()
        unread.close()
    assert status == 200
    events = sse_payloads(stream.decode())
    assert len(events[-1]["output_ids"]) == 300
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert_clean_log(small_kv)
