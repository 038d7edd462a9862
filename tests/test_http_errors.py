"""Every bad request gets its status code and OpenAI's error JSON; the server stays healthy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from http_helpers import Server, pools_whole, shared_server

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    return shared_server(tiny_model_dir)


@pytest.fixture(autouse=True)
def still_healthy(server: Server):
    yield
    assert server.get("/health").status_code == 200


def assert_error(r: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    for word in words:
        assert word in err["message"], err["message"]
    return err


@pytest.mark.parametrize("path,body,words", [
    (CMPL, {"prompt": ""}, ["empty"]),
    (CMPL, {"prompt": []}, ["empty"]),
    (CMPL, {"prompt": [[]]}, ["empty"]),
    (CMPL, {"prompt": [1, 10**6]}, ["out of vocabulary"]),
    (CMPL, {"prompt": [-1]}, ["out of vocabulary"]),
    (CMPL, {"prompt": [5] * 5000}, ["longer than the model's context length"]),
    (CMPL, {"prompt": [5] * 4000, "max_tokens": 100}, ["Requested token count exceeds"]),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 5000}]}, ["context length"]),
    (CMPL, {"prompt": "x", "max_tokens": "abc"}, ["max_tokens"]),
    (CMPL, {"prompt": "x", "max_tokens": -1}, ["max_tokens"]),  # 0: an empty completion
    (CMPL, {"prompt": "x", "temperature": "hot"}, ["temperature"]),
    (CMPL, {"prompt": "x", "temperature": -1}, ["temperature"]),
    (CMPL, {"prompt": "x", "top_p": 0}, ["top_p"]),
    (CMPL, {"prompt": "x", "n": "2"}, ["n"]),
    (CMPL, {"prompt": "x", "n": 0}, ["n"]),
    (CMPL, {"prompt": "x", "stream": "yes"}, ["stream"]),
    (CMPL, {"prompt": 5}, ["prompt"]),
    (CMPL, {"prompt": [1, "a"]}, ["prompt"]),
    (CMPL, {"max_tokens": 4}, ["prompt"]),
    (CMPL, {"prompt": "x", "stop": [""]}, ["stop"]),
    (CMPL, {"prompt": "x", "seed": 2**63}, ["seed"]),
    (CMPL, {"prompt": "x", "seed": -(2**63) - 1}, ["seed"]),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, ["stream_options"]),
    (CHAT, {"messages": []}, ["messages"]),
    (CHAT, {"messages": "hello"}, ["messages"]),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, ["chat template"]),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["image_url"]),
    (CMPL, {"prompt": "x", "dllm_threshold": "high"}, ["dllm_threshold"]),
    (CMPL, {"prompt": "x", "dllm_edit_threshold": 0.1}, ["dllm_edit_threshold"]),
])
def test_invalid_input_is_400(server: Server, path: str, body: dict, words: list[str]) -> None:
    assert_error(server.post(path, {"model": "tiny", **body}), 400, *words)
    if path == CMPL and not {"stream", "stream_options"} & set(body):  # before a stream, too
        r = server.post(path, {"model": "tiny", **body, "stream": True})
        assert r.headers["content-type"].startswith("application/json")
        assert_error(r, 400, *words)


@pytest.mark.parametrize("field,value", [
    ("logprobs", 2), ("echo", True), ("suffix", "end"), ("logit_bias", {"5": 1.0}),
    ("best_of", 3), ("frequency_penalty", 0.5), ("presence_penalty", -1),
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
    ("repetition_penalty", 1.2), ("lora_path", "adapter"), ("regex", "a+"),
    ("return_hidden_states", True), ("not_a_field", 1),
])
def test_unsupported_fields_are_named(server: Server, field: str, value: Any) -> None:
    path = CHAT if field in ("tools", "response_format") else CMPL
    body = {"messages": USER} if path == CHAT else {"prompt": "x"}
    err = assert_error(server.post(path, {**body, field: value, "max_tokens": 2}), 400, field)
    assert "Unsupported" in err["message"] and err["param"] == field


def test_neutral_values_of_unsupported_fields_are_accepted(server: Server) -> None:
    body = {"prompt": "x", "max_tokens": 2, "echo": False, "logprobs": None,
            "frequency_penalty": 0, "presence_penalty": 0.0, "best_of": 1, "user": "me"}
    assert server.post(CMPL, body).status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"42", b"null", b'"text"', b""])
def test_malformed_or_non_object_body_is_400(server: Server, raw: bytes) -> None:
    for path in (CMPL, CHAT, "/generate"):
        r = httpx.post(server.url(path), content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert_error(r, 400)


BIG = "1" + "0" * 400  # an int past the float range


@pytest.mark.parametrize("path,raw,words", [
    (CMPL, "[" * 60_000, ["nests deeper"]),  # json.loads: RecursionError
    (CMPL, '{"prompt": ' + "[" * 70 + "1" + "]" * 70 + "}", ["nests deeper"]),
    (CMPL, '{"prompt": "a\\ud800b"}', ["surrogate"]),
    (CMPL, '{"prompt": "a", "model": "\\udc00"}', ["surrogate"]),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud83d"}]}', ["surrogate"]),
    ("/generate", '{"text": "\\udfff"}', ["surrogate"]),
    (CMPL, b'{"prompt": "\xed\xa0\x80"}', ["UTF-8"]),  # a surrogate encoded in UTF-8
    ("/generate", '{"text": "a", "sampling_params": {"temperature": ' + BIG + "}}",
     ["temperature"]),
    (CMPL, '{"prompt": "a", "dllm_threshold": ' + BIG + "}", ["dllm_threshold"]),
    (CMPL, '{"prompt": "a", "dllm_threshold": NaN}', ["dllm_threshold"]),
    (CMPL, '{"prompt": "a", "dllm_threshold": 1.5}', ["dllm_threshold"]),
    ("/generate", '{"text": "a", "rid": ""}', ["rid"]),
    ("/abort_request", '{"rid": ""}', ["rid"]),
], ids=lambda v: v[:40] if isinstance(v, str) else None)
def test_hostile_bodies_are_400(server: Server, path: str, raw: str | bytes,
                                words: list[str]) -> None:
    """Regressions found by tests/stress: each of these was a 500 (or, for an empty rid, a
    request that could not be aborted; for a threshold out of range, one that was served)."""
    content = raw.encode() if isinstance(raw, str) else raw
    r = httpx.post(server.url(path), content=content, timeout=30,
                   headers={"content-type": "application/json"})
    assert_error(r, 400, *words)


def test_escaped_surrogate_pairs_are_fine(server: Server) -> None:
    r = httpx.post(server.url(CMPL), content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def test_wrong_content_type_is_400(server: Server) -> None:
    r = httpx.post(server.url(CMPL), content=json.dumps({"prompt": "x"}), timeout=30,
                   headers={"content-type": "text/plain"})
    assert_error(r, 400, "Content-Type")


def test_payload_too_large_is_413(server: Server) -> None:
    assert_error(server.post(CMPL, {"prompt": "x" * 70000}), 413, "Payload Too Large")


def test_a_client_gone_before_its_body_arrived_is_not_an_internal_error() -> None:
    """The body stream ends in a disconnect: a 400 APIError (its answer reaches no one), not
    starlette's ClientDisconnect, which the app would log as an internal error."""
    import asyncio

    from starlette.requests import Request

    from dllm_serve.http.body import read_json
    from dllm_serve.http.errors import APIError

    messages = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True},
                {"type": "http.disconnect"}]

    async def receive() -> dict:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (b"content-type", b"application/json")], "query_string": b""}
    with pytest.raises(APIError) as err:
        asyncio.run(read_json(Request(scope, receive), 1 << 20))
    assert err.value.status == 400 and "disconnected" in err.value.message


def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """parse_request: a body past PARSE_INLINE_BYTES is parsed in another thread (its errors
    still a 400 APIError); a small one on the loop's own thread."""
    import asyncio
    import threading

    from dllm_serve.http import body as body_mod
    from dllm_serve.http.errors import APIError
    from dllm_serve.http.protocol import GenerateRequest

    threads: list[int] = []
    real = body_mod.parse_body

    def recording(model: Any, raw: bytes) -> Any:
        threads.append(threading.get_ident())
        return real(model, raw)

    monkeypatch.setattr(body_mod, "parse_body", recording)
    big = json.dumps({"input_ids": [list(range(1000))] * 20}).encode()
    assert len(big) > body_mod.PARSE_INLINE_BYTES

    async def both() -> tuple[int, Any, Any]:
        small = await body_mod.parse_request(GenerateRequest, b'{"text": "hi"}')
        large = await body_mod.parse_request(GenerateRequest, big)
        return threading.get_ident(), small, large

    loop_thread, small, large = asyncio.run(both())
    assert small.text == "hi" and len(large.input_ids) == 20
    assert threads[0] == loop_thread and threads[1] != loop_thread
    bad = b'{"input_ids": [' + b"1, " * 30000 + b"]"
    with pytest.raises(APIError) as err:
        asyncio.run(body_mod.parse_request(GenerateRequest, bad))
    assert err.value.status == 400 and "not valid JSON" in err.value.message


def test_unknown_model_is_404(server: Server) -> None:
    for path, body in ((CMPL, {"prompt": "x"}), (CHAT, {"messages": USER})):
        err = assert_error(server.post(path, {**body, "model": "gpt-9"}), 404, "gpt-9")
        assert err["code"] == "model_not_found" and err["param"] == "model"
        # sglang-router names a request that gave no model "unknown": served as no name
        assert server.post(path, {**body, "model": "unknown", "max_tokens": 2}).status_code == 200
        # the --model-path as given: vLLM's and SGLang's default served name
        as_path = server.get("/get_model_info").json()["model_path"]
        assert server.post(path, {**body, "model": as_path, "max_tokens": 2}).status_code == 200
    assert_error(server.get("/v1/models/gpt-9"), 404)


def test_unknown_route_and_method(server: Server) -> None:
    assert_error(server.get("/v1/nothing"), 404)
    assert_error(server.get(CMPL), 405)


def test_head_wherever_get_and_a_405_allows_every_method(server: Server) -> None:
    """RFC 9110: HEAD where GET is served (the GET answer's headers, no body); a 405's Allow
    names every method of its path (/flush_cache serves GET and POST as two routes)."""
    for path in ("/health", "/v1/models", "/get_load", "/metrics"):
        head, get = (httpx.request(m, server.url(path), timeout=30) for m in ("HEAD", "GET"))
        assert head.status_code == 200 == get.status_code and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"]
    r = httpx.request("OPTIONS", server.url("/flush_cache"), timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, POST"
    assert httpx.request("HEAD", server.url(CMPL), timeout=30).headers["allow"] == "POST"


def test_native_errors(server: Server) -> None:
    err = assert_error(server.post("/generate", {"text": "a", "input_ids": [1]}), 400,
                       "exactly one of text and input_ids")
    assert err["param"] == "text"
    assert_error(server.post("/generate", {"text": ["a", "b"], "stream": True}), 400, "single")
    assert_error(server.post("/generate", {"text": "a", "sampling_params": {"max_tokens": 3}}),
                 400, "max_tokens")
    assert_error(server.post("/generate", {"text": "a", "return_logprob": True}), 400,
                 "return_logprob")
    assert_error(server.post("/generate", {"text": "a", "rid": ["x", "y"]}), 400, "rid")
    assert_error(server.post("/abort_request", {}), 400, "rid")
    # the front's prompt and length checks, under /generate's own names
    err = assert_error(server.post("/generate", {"text": "word " * 5000}), 400, "context")
    assert err["param"] == "text"
    err = assert_error(server.post("/generate", {"input_ids": [10**6]}), 400, "vocabulary")
    assert err["param"] == "input_ids"
    err = assert_error(server.post("/generate", {"text": "a", "sampling_params": {
        "max_new_tokens": 10**6}}), 400, "context length")
    assert err["param"] == "max_new_tokens"


def test_left_out_max_tokens_fit_the_context(server: Server) -> None:
    """Regression: a prompt near the context length with max_tokens left out was a 400 for
    the default's 16 (completions) or 128 (/generate) tokens; the default is cut to what fits
    (an explicit value that does not fit is still a 400, above)."""
    r = server.post(CMPL, {"prompt": [5] * 4090, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    r = server.post("/generate", {"input_ids": [5] * 4000, "sampling_params": {
        "ignore_eos": True, "max_new_tokens": None}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 96, r.text


def test_openai_client_raises_bad_request(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="longer than the model's context length"):
        client.completions.create(model="tiny", prompt=[5] * 5000)
    with pytest.raises(openai.BadRequestError, match="Requested token count exceeds"):
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)  # type: ignore[arg-type]


def test_server_still_serves_after_bad_requests(server: Server) -> None:
    r = server.post(CMPL, {"prompt": "x", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    pools_whole(server)


def test_a_template_that_fails_on_the_messages_is_a_400() -> None:
    """Regression: a chat template whose own code raised anything but a Jinja or value error
    (e.g. `{{ messages[0].content + 1 }}`: a TypeError) was a 500."""
    from types import SimpleNamespace

    from dllm_serve.errors import RequestError
    from dllm_serve.http.openai_serving import _render_and_tokenize

    def failing(messages: list) -> str:
        return messages[0]["content"] + 1

    front = SimpleNamespace(tokenizer=SimpleNamespace(apply_chat_template=failing))
    with pytest.raises(RequestError, match="TypeError") as e:
        _render_and_tokenize(front, [{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    assert e.value.param == "messages"
