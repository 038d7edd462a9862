"""The offline Python API, shaped like SGLang's `Engine`.

    with Engine(model_path=..., dllm_algorithm="LowConfidence", device="cpu") as engine:
        out = engine.generate("Question: 2 + 3 =", {"max_new_tokens": 32})
        print(out["text"], out["meta_info"])

It starts the same scheduler and worker processes as the server (over ZMQ), without HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
from collections.abc import AsyncIterator, Iterator
from typing import Any

from dllm_serve.cli import preflight
from dllm_serve.errors import EngineDeadError, RequestError
from dllm_serve.managers.procs import collector_paused
from dllm_serve.managers.tokenizer_manager import GenOutput, TokenizerManager
from dllm_serve.sampling_params import SamplingParams, check_n, copy_seed
from dllm_serve.server_args import ServerArgs

Params = dict[str, Any] | list[dict[str, Any]] | None


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        """Keywords are `ServerArgs` fields (model_path, dllm_algorithm, dllm_fdfo, ...). A bad
        value raises ValueError before any process starts (the CLI's checks: `preflight`)."""
        config = preflight(ServerArgs(**kwargs))
        self.server_args = config.args  # model_path resolved
        self.front = TokenizerManager(config)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: Params = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 rid: str | list[str] | None = None, stream: bool = False,
                 ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (-> dict) or a batch (-> list of dicts, in order).

        Each result has `text`, `output_ids` and `meta_info` (id, finish_reason, prompt_tokens,
        completion_tokens, forward_steps, blocks, e2e_latency). With stream=True (one prompt
        only) an iterator yields one dict per committed block, `text` holding the new text;
        closing it early aborts the request.
        Invalid requests raise RequestError before anything runs.
        """
        batch, requests = self._requests(prompt, sampling_params, input_ids, rid, stream)
        if stream:
            return self._stream(*requests[0])
        waits: list[tuple[str, queue.Queue[GenOutput]]] = []
        outs: list[GenOutput] = []
        try:
            with collector_paused():
                for i, p, r in requests:
                    waits.append(self._submit(i, p, r))
            for _, q in waits:
                outs.append(_last(q))
        finally:  # e.g. a rid already running, or Ctrl-C while waiting: nothing is left running
            for r, _ in waits[len(outs):]:
                self.front.abort(r)
        results = [result_dict(o) for o in outs]
        return results if batch or len(results) > 1 else results[0]

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: Params = None,
                             input_ids: list[int] | list[list[int]] | None = None,
                             rid: str | list[str] | None = None, stream: bool = False,
                             ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[
                                 dict[str, Any]]:
        """`generate` for asyncio code (SGLang's `Engine.async_generate`): the same arguments
        and results, awaited in the running event loop, so one thread can keep many requests
        in flight. With stream=True it returns an async iterator of the per-block dicts.
        Cancelling the await (or leaving the stream early) aborts the unfinished requests."""
        batch, requests = self._requests(prompt, sampling_params, input_ids, rid, stream)
        if stream:
            return self._astream(*requests[0])
        loop = asyncio.get_running_loop()
        waits: list[tuple[str, _Updates]] = []
        try:
            with collector_paused():
                for i, p, r in requests:
                    waits.append(self._asubmit(loop, i, p, r))
            outs = [await _alast(q) for _, q in waits]
        finally:
            for r, q in waits:
                if not q.finished:
                    self.front.abort(r)
        results = [result_dict(o) for o in outs]
        return results if batch or len(results) > 1 else results[0]

    def _requests(self, prompt: str | list[str] | None, sampling_params: Params,
                  input_ids: list[int] | list[list[int]] | None, rid: str | list[str] | None,
                  stream: bool) -> tuple[bool, list[tuple[list[int], SamplingParams, str | None]]]:
        """(is it a batch, one (ids, params, rid) per engine request), each validated."""
        batch, prompts = normalize_prompts(prompt, input_ids)
        ids = self.front.tokenize_all(prompts)
        params = per_prompt_params(sampling_params, len(ids))
        requests = expand_n(ids, params, rids_per_prompt(rid, len(ids)))
        for i, p, _ in requests:
            self.front.validate(i, p)
        if stream and len(requests) > 1:
            raise RequestError("stream=True takes a single prompt and n=1")
        return batch, requests

    def _submit(self, ids: list[int], params: SamplingParams, rid: str | None,
                ) -> tuple[str, queue.Queue[GenOutput]]:
        """Submit; (its rid, the queue its updates arrive on)."""
        q: queue.Queue[GenOutput] = queue.Queue()
        return self.front.submit(ids, params, q.put, rid), q

    def _asubmit(self, loop: asyncio.AbstractEventLoop, ids: list[int], params: SamplingParams,
                 rid: str | None) -> tuple[str, _Updates]:
        """Submit; the updates arrive on the returned queue inside `loop`."""
        q = _Updates()

        def deliver(out: GenOutput) -> None:  # on the front's receiver thread
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        return self.front.submit(ids, params, deliver, rid), q

    async def _astream(self, ids: list[int], params: SamplingParams, rid: str | None,
                       ) -> AsyncIterator[dict[str, Any]]:
        r, q = self._asubmit(asyncio.get_running_loop(), ids, params, rid)
        try:
            while True:
                out = await q.get()
                yield chunk_dict(out)
                if out.finished:
                    return
        finally:
            if not q.finished:
                self.front.abort(r)

    def _stream(self, ids: list[int], params: SamplingParams, rid: str | None,
                ) -> Iterator[dict[str, Any]]:
        r, q = self._submit(ids, params, rid)
        finished = False
        try:
            while not finished:
                out = q.get()
                finished = out.finished
                yield chunk_dict(out)
        finally:  # left early (closed, collected): the engine frees the request's slot and KV
            if not finished:
                self.front.abort(r)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort request `rid` (or the copies made of it: "<rid>-<i>"), or all."""
        self.front.abort(rid, abort_all, copies=True)

    def get_server_info(self) -> dict[str, Any]:
        """Server args, the scheduler's state, `kv_pool` / `req_pool` occupancy and
        `radix_cache` (cached_pages, evictable_pages, hit_tokens, miss_tokens)."""
        return {**self.server_args.__dict__, **self.front.server_info()}

    def flush_cache(self) -> dict[str, Any]:
        """Empty the radix prefix cache: {"success", "message", "freed_pages"}; success is
        False (nothing flushed) while requests are running or waiting."""
        r = self.front.flush_cache()
        return {"success": r.success, "message": r.message, "freed_pages": r.freed_pages}

    def get_all_child_pids(self) -> list[int]:
        return self.front.procs.pids()

    def shutdown(self) -> None:
        self.front.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        front = getattr(self, "front", None)
        if front is not None:
            front.shutdown()


def normalize_prompts(prompt: str | list[str] | None,
                      input_ids: list[int] | list[list[int]] | None, text_name: str = "prompt",
                      ) -> tuple[bool, list[str] | list[list[int]]]:
    """(is it a batch, the prompts as texts or id lists); exactly one of the two is given.
    RequestError (naming the argument) for anything else: a text that is not a string of
    valid Unicode, an id that is not an int (bool and float included). Arrays with
    `tolist()` (numpy, torch) are read as lists."""
    if (prompt is None) == (input_ids is None):  # text_name: the text's name (/generate: text)
        raise RequestError(f"give exactly one of {text_name} and input_ids", param=text_name)
    if prompt is not None:
        batch, texts = (False, [prompt]) if isinstance(prompt, str) else (True, _list(prompt))
        for text in texts:
            _check_text(text)
        return batch, texts
    input_ids = _list(input_ids, "input_ids")
    if input_ids and (isinstance(input_ids[0], (list, tuple))
                      or getattr(input_ids[0], "ndim", 0) == 1):  # a batch (rows may be arrays)
        rows = [_list(x, "input_ids") for x in input_ids]
        for row in rows:
            _check_ids(row)
        return True, rows
    _check_ids(input_ids)
    return False, [input_ids]


def _list(x: Any, name: str = "prompt") -> list[Any]:
    x = x.tolist() if hasattr(x, "tolist") else x
    if not isinstance(x, (list, tuple)):
        raise RequestError(f"{name} must be a list, got {type(x).__name__}", param=name)
    return list(x)


def _check_text(text: Any) -> None:
    if not isinstance(text, str):
        raise RequestError(f"prompt must be a string or a list of strings, got an item of type "
                           f"{type(text).__name__}", param="prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("prompt is not valid Unicode (a lone surrogate)",
                           param="prompt") from None


def _check_ids(ids: list[Any]) -> None:
    bad = next((t for t in ids if type(t) is not int), None)  # bool is an int subclass
    if bad is not None:
        raise RequestError(f"input_ids must hold integers, got {bad!r}", param="input_ids")


def rids_per_prompt(rid: Any, prompts: int) -> list[str | None]:
    """One rid per prompt (or None each); RequestError for a non-string, an empty one or
    the same one twice."""
    rids = [rid] if isinstance(rid, str) else [None] * prompts if rid is None else rid
    if not isinstance(rids, list) or len(rids) != prompts:
        raise RequestError("rid must be a string, or a list of one per prompt", param="rid")
    if any(r is not None and (not isinstance(r, str) or not r) for r in rids):
        raise RequestError("each rid must be a non-empty string", param="rid")
    named = [r for r in rids if r is not None]
    if len(set(named)) != len(named):
        raise RequestError("rid holds the same id twice", param="rid")
    return rids


def per_prompt_params(params: Params, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (a dict for all, or a list of n); RequestError if bad."""
    if isinstance(params, list):
        if len(params) != n:
            raise RequestError("sampling_params must have one entry per prompt")
        return [_parse(p) for p in params]
    return [_parse(params)] * n  # one object: expand_n gives each request its own copy


def expand_n(ids: list[list[int]], params: list[SamplingParams], rids: list[str | None],
             ) -> list[tuple[list[int], SamplingParams, str | None]]:
    """One engine request per prompt and copy (SGLang's `n`), prompt-major; copy i of a
    prompt gets seed + i (when seeded) and rid "<rid>-<i>" (when n > 1)."""
    out = []
    for i, p, r in zip(ids, params, rids, strict=True):
        try:
            check_n(p.n)  # before the copies, each of which has n = 1
        except ValueError as e:
            raise RequestError(str(e), param="n") from None
        for copy in range(p.n):
            one = dataclasses.replace(p, n=1, stop=list(p.stop), dllm=dict(p.dllm))
            if copy and one.seed is not None:
                one.seed = copy_seed(one.seed, copy)
            out.append((i, one, r if p.n == 1 or r is None else f"{r}-{copy}"))
    return out


def _parse(d: dict[str, Any] | None) -> SamplingParams:
    if d is not None and not isinstance(d, dict):
        raise RequestError(f"sampling_params must be a dict or a list of dicts, got "
                           f"{type(d).__name__}", param="sampling_params")
    try:
        return SamplingParams.from_dict(d)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None


def _last(q: queue.Queue[GenOutput]) -> GenOutput:
    while not (out := q.get()).finished:
        pass
    return out


class _Updates(asyncio.Queue[GenOutput]):
    """A request's updates in the event loop; `finished` once its last one arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.finished = False

    def put_nowait(self, out: GenOutput) -> None:
        self.finished = self.finished or out.finished
        super().put_nowait(out)


async def _alast(q: _Updates) -> GenOutput:
    while not (out := await q.get()).finished:
        pass
    return out


def result_dict(out: GenOutput) -> dict[str, Any]:
    """A request's output as SGLang returns it (finished, or so far in a cumulative stream):
    text, output_ids, meta_info."""
    raise_if_dead(out)
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta}


def chunk_dict(out: GenOutput) -> dict[str, Any]:
    """One streamed update: the new text and ids, meta_info."""
    raise_if_dead(out)
    return {"text": out.delta, "output_ids": out.new_ids, "meta_info": out.meta}


def raise_if_dead(out: GenOutput) -> None:
    """EngineDeadError for a request the engine failed (or ended by shutting down)."""
    reason = out.finish_reason or {}
    if reason.get("type") == "abort" and reason.get("status_code") == 500:
        raise EngineDeadError(reason.get("message", "engine failed"))
