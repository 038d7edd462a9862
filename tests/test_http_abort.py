"""Aborts and client disconnects end with the KV pool and request slots whole."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from http_helpers import Server, pools_whole, shared_server
from prometheus_client.parser import text_string_to_metric_families

ENDLESS = {"max_new_tokens": 3000, "ignore_eos": True}  # longer than any test waits


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    return shared_server(tiny_model_dir)


def first_event(lines: Any) -> dict[str, Any]:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[len("data: "):])
    raise AssertionError("no event")


def aborts_logged(server: Server) -> int:
    """How many requests the server aborted because their client left (from its log)."""
    return server.log_text().count("unfinished request(s) of")


def test_abort_request_by_rid_ends_the_stream(server: Server) -> None:
    body = {"text": "abort me", "rid": "victim", "stream": True, "sampling_params": ENDLESS}
    with httpx.stream("POST", server.url("/generate"), json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert first_event(lines)["meta_info"]["finish_reason"] is None
        assert server.post("/abort_request", {"rid": "victim"}).json() == {"success": True}
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    pools_whole(server)


def test_abort_by_the_rid_asked_ends_its_copies(server: Server) -> None:
    """Regression: a /generate with rid "fam" and n = 2 runs as "fam-0" and "fam-1", and an
    abort of "fam" found nothing (SGLang aborts every rid that begins with the one given)."""
    result: list[httpx.Response] = []
    body = {"text": "abort us", "rid": "fam", "sampling_params": {**ENDLESS, "n": 2}}
    thread = threading.Thread(target=lambda: result.append(server.post("/generate", body)))
    thread.start()
    deadline = time.monotonic() + 60
    while server.get("/get_server_info").json()["num_running_reqs"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.post("/abort_request", {"rid": "fam"}).json() == {"success": True}
    thread.join(60)
    outs = result[0].json()
    assert [o["meta_info"]["id"] for o in outs] == ["fam-0", "fam-1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    pools_whole(server)


def test_abort_all_finishes_every_request(server: Server) -> None:
    results: list[httpx.Response] = []

    def run(i: int) -> None:
        body = {"prompt": f"p{i}", "max_tokens": 200, "ignore_eos": True}
        results.append(server.post("/v1/completions", body))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.get("/get_server_info").json()["num_running_reqs"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.post("/abort_request", {"abort_all": True})
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200] * 3
    assert all(r.json()["choices"][0]["finish_reason"] == "abort" for r in results)
    pools_whole(server)


def test_disconnect_non_stream_aborts(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="EMPTY", max_retries=0,
                           timeout=1.5)
    before = aborts_logged(server)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="tiny", prompt="slow", max_tokens=3000,
                                  extra_body={"ignore_eos": True}, n=2)
    pools_whole(server)
    assert aborts_logged(server) == before + 1


def test_disconnect_mid_stream_aborts(server: Server) -> None:
    body = {"prompt": "stream then leave", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    before = aborts_logged(server)
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        assert first_event(r.iter_lines())["choices"][0]["finish_reason"] is None
    pools_whole(server)
    assert aborts_logged(server) == before + 1


def test_disconnect_while_queued_or_before_first_block(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "ignore_eos": True}
    before = aborts_logged(server)
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", server.url("/v1/chat/completions"), json=body,
                          timeout=httpx.Timeout(60, read=0.01)) as r:
            r.read()
    pools_whole(server)
    assert aborts_logged(server) == before + 1


def request_counters(server: Server) -> dict[str, float]:
    text = server.get("/metrics").text
    return {f"{s.name}{s.labels.get('finish_reason', '')}": s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("dllm:num_requests_total", "dllm:prompt_tokens_total")}


def test_client_that_left_is_counted_in_metrics(server: Server) -> None:
    """Regression (found by the soak test): a request whose client left mid-stream was missing
    from dllm:num_requests_total and the prompt-token counter, which only saw what the client
    had read; it is counted once, as aborted."""
    before = request_counters(server)
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        first_event(r.iter_lines())
    pools_whole(server)
    deadline = time.monotonic() + 10
    while (after := request_counters(server)).get("dllm:num_requests_totalabort", 0) == \
            before.get("dllm:num_requests_totalabort", 0):
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after["dllm:num_requests_totalabort"] == before.get(
        "dllm:num_requests_totalabort", 0) + 1
    assert after["dllm:prompt_tokens_total"] == before.get("dllm:prompt_tokens_total", 0) + 3
