"""The HTTP front tokenizes off its event loop: a long text (30 MB took 31 s to encode on a
2-core CPU) keeps other clients' requests, health checks and streams waiting only if the loop
runs the tokenizer. Each route that tokenizes or detokenizes hands it to the tokenizing threads
(`bridge.tokenized`, a pool of its own, not the default executor the info routes use;
`Tokenizer.encode` and `decode_batch` let go of the GIL while they run): here a fake front's
tokenizer blocks its thread for 0.3 s while the loop ticks on."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

import pytest

from dllm_serve.errors import RequestError
from dllm_serve.http import bridge, native, openai_serving, tokenize

HOLD_S = 0.3


class FakeTokenizer:
    def __init__(self, hold: Callable[[], None]) -> None:
        self.hold = hold

    def apply_chat_template(self, messages: list[dict]) -> str:  # type: ignore[type-arg]
        return "rendered"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.hold()
        return []

    def decode_batch(self, lists: list[list[int]], skip: bool = True) -> list[str]:
        self.hold()
        return []


class FakeFront:
    """Its tokenizing blocks the calling thread for HOLD_S, then refuses (the test needs
    nothing after the tokenizing)."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer(self._hold)
        self.threads: list[str] = []

    def check_ids(self, ids: list[int], param: str) -> None:
        pass

    def _hold(self) -> None:
        self.threads.append(threading.current_thread().name)
        time.sleep(HOLD_S)
        raise RequestError("tokenized")

    def tokenize(self, prompt: str) -> list[int]:
        self._hold()
        return []

    def tokenize_all(self, prompts: list) -> list[list[int]]:  # type: ignore[type-arg]
        self._hold()
        return []


class FakeContext:
    def __init__(self) -> None:
        self.front = FakeFront()

    def require_front(self) -> FakeFront:
        return self.front

    def check_model(self, model: str | None) -> None:
        pass


ROUTES = {
    "generate": (native.generate, {"text": "hello", "sampling_params": {"max_new_tokens": 4}}),
    "completions": (openai_serving.create_completion, {"model": "m", "prompt": "hello"}),
    "chat": (openai_serving.create_chat_completion,
             {"model": "m", "messages": [{"role": "user", "content": "hello"}]}),
    "tokenize": (lambda ctx, _, body: tokenize.tokenize_route(ctx, body), {"prompt": "hello"}),
    "detokenize": (lambda ctx, _, body: tokenize.detokenize_route(ctx, body),
                   {"tokens": [1, 2, 3]}),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_route_tokenizes_off_the_event_loop(route: str) -> None:
    handler, body = ROUTES[route]
    ctx = FakeContext()
    ticks: list[float] = []

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def run() -> None:
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        with pytest.raises(RequestError, match="tokenized"):
            await handler(ctx, None, json.dumps(body).encode())  # type: ignore[arg-type]
        stop.set()
        await tick

    asyncio.run(run())
    assert ctx.front.threads and ctx.front.threads[0].startswith("tokenize")
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert len(ticks) >= 10 and max(gaps) < HOLD_S / 2, (len(ticks), max(gaps))


class GatedFront(FakeFront):
    """Long prompts block their thread until `release` is set; short ones go through."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def tokenize_all(self, prompts: list) -> list[list[int]]:  # type: ignore[type-arg]
        self.threads.append(threading.current_thread().name)
        if len(prompts[0]) > 100:
            assert self.release.wait(30)
        raise RequestError("tokenized")


def test_long_bodies_tokenize_in_threads_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests with a body past LONG_BODY_BYTES take the long-text threads: with every one of
    them busy (and more long requests queued behind), a short prompt is still tokenized at
    once."""
    monkeypatch.setattr(bridge, "LONG_BODY_BYTES", 1000)
    ctx = FakeContext()
    front = ctx.front = GatedFront()  # type: ignore[assignment]

    async def one(text: str) -> None:
        body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 4}}).encode()
        with pytest.raises(RequestError, match="tokenized"):
            await native.generate(ctx, None, body)  # type: ignore[arg-type]

    async def run() -> None:
        long = [asyncio.create_task(one("x" * 2000))
                for _ in range(bridge.LONG_TOKENIZE_THREADS + 2)]
        await asyncio.sleep(0.2)  # the long ones hold every long-text thread
        await asyncio.wait_for(one("short"), timeout=20)  # (a guard: it never waits for them)
        assert not any(t.done() for t in long)
        front.release.set()
        await asyncio.gather(*long)

    asyncio.run(run())
    short = [n for n in front.threads if not n.startswith("tokenize-long")]
    assert len(short) == 1 and short[0].startswith("tokenize")
    assert sum(n.startswith("tokenize-long") for n in front.threads) == len(front.threads) - 1
