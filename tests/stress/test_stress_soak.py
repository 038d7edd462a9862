"""Soak: many concurrent requests of every kind against one real server, a quarter of whose
clients leave mid-stream and some of which are aborted; then nothing is lost or leaked.

Afterwards: every request that was not aborted got a complete, well-formed answer; the KV pool
and request slots are whole; the scheduler and worker are the same live processes; the log has
no traceback or leak; and the Prometheus counters agree with what the clients saw (requests by
finish reason, prompt and generation tokens; a client that left knows only bounds for its own).
A share of the prompts start with one preamble, so the radix prefix cache (on, the default) is
shared throughout. Short form: 300 requests at concurrency 48. Long form
(DLLM_SERVE_STRESS=long): 10000 at 128.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_helpers import Server, held_pages, pools_whole, start_server
from stress_helpers import (
    EXTRA_FLAGS,
    SEED,
    assert_clean_log,
    assert_openai_error,
    check_generate_final,
    check_generate_stream,
    check_openai_answer,
    check_openai_chunks,
    counters,
    delta,
    engine_children,
    report,
    scale,
    sse_payloads,
)

from dllm_serve.tokenizer import Tokenizer

pytestmark = pytest.mark.stress

NUM_REQUESTS = scale(300, 10000)
CONCURRENCY = scale(48, 128)
CONTEXT = 1024
FLAGS = ("--max-running-requests", "16", "--context-length", str(CONTEXT),
         "--served-model-name", "tiny", *EXTRA_FLAGS)
CLIENT_TIMEOUT_S = scale(120.0, 600.0)  # a request still unanswered by then is a hang
# Request kinds and their weights (per 100). The disconnect kinds add up to 25.
KINDS = {"completion": 10, "completion_stream": 12, "chat": 7, "chat_stream": 8, "generate": 7,
         "generate_stream": 7, "leave_stream": 20, "leave_waiting": 5, "abort": 15,
         "invalid": 5, "extreme": 4}
EXTREME_FLOATS = (1e308, -1e308, 5e-324, 3.5e38, -0.0)
EXTREME_FIELDS = ("temperature", "top_p", "min_p", "dllm_threshold", "frequency_penalty",
                  "repetition_penalty", "top_k", "seed")
STOPS = ["in", "3", "!", " a", "x y"]
WORDS = ["apples", "the", "3", "in", "plus", "Tom", "!", "buys", "é", "日本"]
# A preamble that a share of the prompts start with (whole cached blocks: the radix cache is
# shared by requests that finish, stop, leave or are aborted).
PREAMBLE = "You are a careful assistant. Answer the question in one short sentence. " * 3


@dataclass
class Outcome:
    """What one client saw. `choices` engine requests were submitted (0: rejected by the
    HTTP layer); completion tokens are known exactly unless the client left."""

    kind: str
    choices: int = 0
    prompt_tokens: int = 0  # over all choices, as the engine counts them
    completion: int | None = None  # exact, or None when the client left
    bounds: tuple[int, int] = (0, 0)  # (seen, most possible) when the client left
    finished: Counter[str] | None = None  # finish reasons the client saw, per choice


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    s = start_server(tiny_model_dir, *FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir)


class Soak:
    def __init__(self, server: Server, tok: Tokenizer, client: httpx.AsyncClient,
                 rng: random.Random) -> None:
        self.server = server
        self.tok = tok
        self.client = client
        self.rng = rng

    # ---- random pieces ----------------------------------------------------------------------

    def text(self) -> str:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 30)))
        return PREAMBLE + words if self.rng.random() < 0.4 else words

    def sampling(self) -> dict[str, Any]:
        """Shared OpenAI fields: stop strings, ignore_eos, a faster threshold now and then."""
        body: dict[str, Any] = {"ignore_eos": self.rng.random() < 0.5}
        if self.rng.random() < 0.3:
            body["stop"] = self.rng.sample(STOPS, self.rng.randint(1, 2))
        if self.rng.random() < 0.5:
            body["dllm_threshold"] = self.rng.choice([0.0, 0.5])
        return body

    def url(self, path: str) -> str:
        return self.server.url(path)

    # ---- the kinds --------------------------------------------------------------------------

    async def completion(self, stream: bool = False) -> Outcome:
        n = self.rng.choice([1, 1, 2]) if not stream else 1
        max_tokens = self.rng.randint(1, 48)
        if self.rng.random() < 0.3:
            prompt: Any = [self.rng.randrange(0, 383) for _ in range(self.rng.randint(1, 40))]
            prompt_len = len(prompt)
        else:
            prompt = self.text()
            prompt_len = len(self.tok.encode(prompt))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "n": n,
                **self.sampling()}
        out = Outcome("completion_stream" if stream else "completion", n, n * prompt_len)
        if stream:
            events = await self._stream("/v1/completions", {
                **body, "stream": True, "stream_options": {"include_usage": True}})
            texts, reasons = check_openai_chunks(events, n, chat=False)
            usage = events[-1]["usage"]
        else:
            r = await self.client.post(self.url("/v1/completions"), json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            texts, reasons = check_openai_answer(answer, n, chat=False)
            usage = answer["usage"]
        return self._finish_openai(out, usage, prompt_len, texts, reasons, body, max_tokens)

    async def chat(self, stream: bool = False) -> Outcome:
        messages = [{"role": "user", "content": self.text()}]
        if self.rng.random() < 0.3:
            messages = [{"role": "system", "content": self.text()}, *messages]
        max_tokens = self.rng.randint(1, 48)
        prompt_len = len(self.tok.encode(self.tok.apply_chat_template(messages)))
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                **self.sampling()}
        out = Outcome("chat_stream" if stream else "chat", 1, prompt_len)
        if stream:
            events = await self._stream("/v1/chat/completions", {
                **body, "stream": True, "stream_options": {"include_usage": True}})
            texts, reasons = check_openai_chunks(events, 1, chat=True)
            usage = events[-1]["usage"]
        else:
            r = await self.client.post(self.url("/v1/chat/completions"), json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            texts, reasons = check_openai_answer(answer, 1, chat=True)
            usage = answer["usage"]
        return self._finish_openai(out, usage, prompt_len, texts, reasons, body, max_tokens)

    async def generate(self, stream: bool = False) -> Outcome:
        text = self.text()
        params = {"max_new_tokens": self.rng.randint(1, 48), **self.sampling()}
        prompt_len = len(self.tok.encode(text))
        body = {"text": text, "sampling_params": params, "stream": stream}
        if stream:
            events = await self._stream("/generate", body)
            final = check_generate_stream(events)
        else:
            r = await self.client.post(self.url("/generate"), json=body)
            assert r.status_code == 200, r.text
            final = r.json()
        check_generate_final(final, prompt_len, params)
        reason = final["meta_info"]["finish_reason"]["type"]
        assert reason in ("stop", "length"), final["meta_info"]
        return Outcome("generate_stream" if stream else "generate", 1, prompt_len,
                       final["meta_info"]["completion_tokens"], finished=Counter([reason]))

    async def leave_stream(self) -> Outcome:
        """A stream whose client reads one event and disconnects."""
        max_tokens = self.rng.randint(64, 300)
        route = self.rng.choice(["/v1/completions", "/v1/chat/completions", "/generate"])
        text = self.text()
        if route == "/generate":
            body: dict[str, Any] = {"text": text, "stream": True, "sampling_params": {
                "max_new_tokens": max_tokens, "ignore_eos": True}}
            prompt_len = len(self.tok.encode(text))
        elif route == "/v1/completions":
            body = {"prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            prompt_len = len(self.tok.encode(text))
        else:
            messages = [{"role": "user", "content": text}]
            body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}
            prompt_len = len(self.tok.encode(self.tok.apply_chat_template(messages)))
        seen = 0
        async with self.client.stream("POST", self.url(route), json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if route == "/generate":
                        seen = len(json.loads(line[len("data: "):])["output_ids"])
                    break
        return Outcome("leave_stream", 1, prompt_len, None, (seen, max_tokens))

    async def leave_waiting(self) -> Outcome:
        """A non-stream client that gives up (client timeout) before its answer. (A GPU may
        answer first: then the answer must be complete.)"""
        max_tokens = self.rng.randint(200, 400)
        text = self.text()
        body = {"prompt": text, "max_tokens": max_tokens, "ignore_eos": True}
        seen = 0
        try:
            r = await self.client.post(self.url("/v1/completions"), json=body,
                                       timeout=httpx.Timeout(30, read=self.rng.uniform(0.05, 0.5)))
        except httpx.ReadTimeout:
            pass
        else:
            assert r.status_code == 200, r.text
            seen = r.json()["usage"]["completion_tokens"]
            assert seen == max_tokens
        return Outcome("leave_waiting", 1, len(self.tok.encode(text)), None, (seen, max_tokens))

    async def abort(self, i: int) -> Outcome:
        """A /generate request aborted by rid after a random delay (it may finish first)."""
        rid = f"soak-{SEED}-{i}"
        text = self.text()
        stream = self.rng.random() < 0.5
        body = {"text": text, "rid": rid, "stream": stream, "sampling_params": {
            "max_new_tokens": self.rng.randint(64, 256), "ignore_eos": True}}
        aborter = asyncio.ensure_future(self._abort_later(rid, self.rng.uniform(0.0, 0.5)))
        if stream:
            final = check_generate_stream(await self._stream("/generate", body))
        else:
            r = await self.client.post(self.url("/generate"), json=body)
            assert r.status_code == 200, r.text
            final = r.json()
        await aborter
        meta = final["meta_info"]
        reason = meta["finish_reason"]["type"]
        assert reason in ("abort", "length"), meta
        assert meta["completion_tokens"] == len(final["output_ids"])
        assert meta["prompt_tokens"] == len(self.tok.encode(text))
        return Outcome("abort", 1, meta["prompt_tokens"], meta["completion_tokens"],
                       finished=Counter([reason]))

    async def invalid(self) -> Outcome:
        body = self.rng.choice([
            {"prompt": [5] * (CONTEXT + 10)}, {"prompt": [10**6]}, {"prompt": "x", "n": 0},
            {"prompt": "x", "max_tokens": CONTEXT}, {"messages": []}, {"prompt": ""}])
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await self.client.post(self.url(route), json=body)
        assert r.status_code == 400, r.text
        assert_openai_error(r)
        return Outcome("invalid")

    async def extreme(self) -> Outcome:
        """An extreme float (issue 13) in one sampling field: served (200) or a 400 naming it."""
        field, value = self.rng.choice(EXTREME_FIELDS), self.rng.choice(EXTREME_FLOATS)
        text = self.text()
        native = self.rng.random() < 0.5
        if native:
            route, body = "/generate", {"text": text, "sampling_params": {
                "max_new_tokens": self.rng.randint(1, 8), field: value}}
        else:
            route, body = "/v1/completions", {"model": "tiny", "prompt": text, field: value,
                                              "max_tokens": self.rng.randint(1, 8)}
        r = await self.client.post(self.url(route), json=body)
        if r.status_code == 400:
            assert field in assert_openai_error(r)["message"], r.text
            return Outcome("extreme")
        assert r.status_code == 200, r.text
        answer = r.json()
        meta = answer["meta_info"] if native else None
        usage = answer["usage"] if not native else None
        reason = meta["finish_reason"]["type"] if meta else answer["choices"][0]["finish_reason"]
        prompt = meta["prompt_tokens"] if meta else usage["prompt_tokens"]
        done = meta["completion_tokens"] if meta else usage["completion_tokens"]
        assert prompt == len(self.tok.encode(text)) and reason in ("stop", "length")
        return Outcome("extreme", 1, prompt, done, finished=Counter([reason]))

    # ---- helpers ----------------------------------------------------------------------------

    async def _stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        async with self.client.stream("POST", self.url(path), json=body) as r:
            text = (await r.aread()).decode()
        assert r.status_code == 200, text
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(text)

    async def _abort_later(self, rid: str, delay: float) -> None:
        await asyncio.sleep(delay)
        r = await self.client.post(self.url("/abort_request"), json={"rid": rid})
        assert r.status_code == 200 and r.json() == {"success": True}

    def _finish_openai(self, out: Outcome, usage: dict[str, int], prompt_len: int,
                       texts: list[str], reasons: list[str], body: dict[str, Any],
                       max_tokens: int) -> Outcome:
        n = len(texts)
        assert usage["prompt_tokens"] == prompt_len, (usage, prompt_len)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] <= n * max_tokens
        if n == 1 and reasons == ["length"]:
            assert usage["completion_tokens"] == max_tokens
        for text in texts:
            assert not any(s in text for s in body.get("stop", [])), (text, body["stop"])
        out.completion = usage["completion_tokens"]
        out.finished = Counter(reasons)
        return out


# ---- the run -----------------------------------------------------------------------------------


async def run_soak(server: Server, tok: Tokenizer) -> list[Outcome]:
    rng = random.Random(SEED)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=NUM_REQUESTS)
    gate = asyncio.Semaphore(CONCURRENCY)
    # idle connections dropped before the server's keep-alive (5 s) drops them: at httpx's
    # default (also 5 s) a request sent as the server closes its connection fails (ReadError)
    limits = httpx.Limits(max_connections=CONCURRENCY + 16, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        soak = Soak(server, tok, client, rng)
        calls: dict[str, Callable[[int], Awaitable[Outcome]]] = {
            "completion": lambda i: soak.completion(),
            "completion_stream": lambda i: soak.completion(stream=True),
            "chat": lambda i: soak.chat(), "chat_stream": lambda i: soak.chat(stream=True),
            "generate": lambda i: soak.generate(),
            "generate_stream": lambda i: soak.generate(stream=True),
            "leave_stream": lambda i: soak.leave_stream(),
            "leave_waiting": lambda i: soak.leave_waiting(), "abort": soak.abort,
            "invalid": lambda i: soak.invalid(), "extreme": lambda i: soak.extreme()}

        async def one(i: int, kind: str) -> Outcome:
            async with gate:
                return await calls[kind](i)

        return await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds)))


def test_soak(server: Server, tok: Tokenizer) -> None:
    children = engine_children(server)
    log_start = len(server.log_text())
    before = counters(server)
    start = time.monotonic()
    outcomes = asyncio.run(run_soak(server, tok))
    elapsed = time.monotonic() - start
    info = pools_whole(server)
    after = counters(server)

    assert server.get("/health").status_code == 200
    assert engine_children(server) == children and all(p.is_running() for p in
                                                       children.values())
    assert_clean_log(server, log_start)
    check_counters(outcomes, before, after)
    assert info["radix_cache"]["hit_tokens"] > 0  # the cache was shared, then pools whole
    report_soak(outcomes, elapsed, info, before, after)


def report_soak(outcomes: list[Outcome], elapsed: float, info: dict[str, Any],
                before: dict[str, float], after: dict[str, float]) -> None:
    kinds = Counter(o.kind for o in outcomes)
    seen = sum((o.finished for o in outcomes if o.finished), Counter[str]())
    left = kinds["leave_stream"] + kinds["leave_waiting"]
    by_reason = {r: int(delta(before, after, f"dllm:num_requests_total{{finish_reason={r}}}"))
                 for r in ("stop", "length", "abort")}
    report(f"soak: {len(outcomes)} requests at concurrency {CONCURRENCY} in {elapsed:.1f} s, "
           f"by kind {dict(sorted(kinds.items()))}; complete answers (stop/length) "
           f"{seen['stop'] + seen['length']}, abort_request calls {kinds['abort']} "
           f"({seen['abort']} took effect), clients that left {left} "
           f"({100 * left / len(outcomes):.0f}%: {kinds['leave_stream']} mid-stream, "
           f"{kinds['leave_waiting']} before a non-stream answer), invalid (400) "
           f"{kinds['invalid']}; engine requests {sum(o.choices for o in outcomes)}, by finish "
           f"reason in /metrics {by_reason}; pages leaked "
           f"{held_pages(info)}, slots leaked "
           f"{info['req_pool']['total_slots'] - info['req_pool']['free_slots']}; radix cache "
           f"{info['radix_cache']}")


def check_counters(outcomes: list[Outcome], before: dict[str, float],
                   after: dict[str, float]) -> None:
    """The server's counters against the clients' view (exact where the client knows)."""
    submitted = sum(o.choices for o in outcomes)
    unknown = [o for o in outcomes if o.choices and o.completion is None]
    seen = Counter[str]()
    for o in outcomes:
        seen.update(o.finished or {})
    by_reason = {r: delta(before, after, f"dllm:num_requests_total{{finish_reason={r}}}")
                 for r in ("stop", "length", "abort")}
    assert sum(by_reason.values()) == submitted, (by_reason, submitted)
    for reason, count in by_reason.items():
        assert seen[reason] <= count <= seen[reason] + len(unknown), (reason, count, seen)
    assert delta(before, after, "dllm:e2e_request_latency_seconds_count{}") == submitted
    prompt = sum(o.prompt_tokens for o in outcomes)
    assert delta(before, after, "dllm:prompt_tokens_total{}") == prompt
    known = sum(o.completion or 0 for o in outcomes)
    low = known + sum(o.bounds[0] for o in unknown)
    high = known + sum(o.bounds[1] for o in unknown)
    generated = delta(before, after, "dllm:generation_tokens_total{}")
    assert low <= generated <= high, (low, generated, high)
