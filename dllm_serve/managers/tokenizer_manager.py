"""The front (TokenizerManager): validates and tokenizes requests, sends them to the scheduler,
and turns committed blocks back into text for whoever waits on each request.

It lives in the caller's process (the offline Engine, or the HTTP server). A background thread
receives the scheduler's outputs and calls each request's callback; callbacks run on that thread
and must be quick (put the update on a queue). If a child process dies, every pending request
gets a final update with an abort finish reason (status 500) and later submits raise
EngineDeadError.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from dllm_serve.dllm.algorithm_settings import settings_of
from dllm_serve.engine_config import EngineConfig
from dllm_serve.errors import EngineDeadError, RequestError
from dllm_serve.managers.detokenizer import IncrementalDetokenizer
from dllm_serve.managers.ipc import Sender
from dllm_serve.managers.launch import launch
from dllm_serve.managers.messages import (
    AbortReq,
    BatchOutput,
    Fatal,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    InfoReq,
    InfoResp,
    ReqOutput,
    Shutdown,
)
from dllm_serve.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from dllm_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# the engine's stop sends Shutdown and gives the children this long to exit by themselves (the
# worker writes out what it holds) before it signals them (ProcessSet.kill)
SHUTDOWN_GRACE_S = 2.0


@dataclass
class GenOutput:
    """One update of a request: the full text so far, the new part, and the metadata.

    `output_ids` (every id so far) is copied only when read: `ids` is the request's growing
    list (appended to, never changed), of which this update saw the first `num_ids` (a copy
    at every block cost time quadratic in the output, read or not)."""

    rid: str
    text: str
    delta: str
    ids: list[int]
    num_ids: int
    new_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    meta: dict[str, Any]

    @property
    def output_ids(self) -> list[int]:
        return self.ids[:self.num_ids]


@dataclass
class ReqState:
    params: SamplingParams
    callback: Callable[[GenOutput], None]
    detok: IncrementalDetokenizer
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    first_output: float | None = None


class TokenizerManager:
    def __init__(self, config: EngineConfig, cancel: threading.Event | None = None) -> None:
        """config: resolved once by the caller (EngineConfig.resolve). Setting `cancel` while
        the engine starts stops it (EngineDeadError; launch.launch)."""
        self.config = config
        self.args = config.args
        self.tokenizer = Tokenizer.load(config.tokenizer_path)
        self.model_config = config.model
        self.algorithm = settings_of(config.args.dllm_algorithm)  # no torch in the front
        self.context_length = self.config.context_length
        self.ctx = zmq.Context()
        self.procs, self.rx, self.ready_info = launch(self.config, self.ctx, cancel)
        self.tx = Sender(self.ctx, self.procs.addrs.to_scheduler)
        self.tx_lock = threading.Lock()
        self.states: dict[str, ReqState] = {}
        self.states_lock = threading.Lock()
        # Info and flush requests waiting for their reply, by id; a reply nobody waits for is
        # dropped.
        self.info_waiters: dict[int, queue.Queue[Any]] = {}
        self.info_ids = itertools.count(1)
        self.dead: str | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._recv_loop, name="front-recv", daemon=True)
        self.thread.start()
        atexit.register(self.shutdown)  # an engine never shut down still stops cleanly

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's ids; a 400 without encoding it when it cannot fit the context
        (`Tokenizer.min_tokens`: a body's worth of text costs seconds of tokenizing). Lets go
        of the GIL while it encodes: the HTTP front calls it off its event loop."""
        self._check_length(prompt)
        return self.tokenizer.encode(prompt)

    def tokenize_all(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Each prompt's ids: id lists as they are, texts tokenized together (a batch of texts
        is split over the tokenizer's threads instead of encoded one by one), each checked
        first as in `tokenize`."""
        if len(prompts) > 1 and all(isinstance(p, str) for p in prompts):
            for p in prompts:
                self._check_length(p)  # type: ignore[arg-type]
            return self.tokenizer.encode_batch(prompts)  # type: ignore[arg-type]
        return [p if isinstance(p, list) else self.tokenize(p) for p in prompts]

    def _check_length(self, prompt: str) -> None:
        ctx = self.context_length
        if not self.tokenizer.fits_at_most(prompt, ctx - 1):
            raise RequestError(f"The input (at least {self.tokenizer.min_tokens(prompt)} "
                               f"tokens: {len(prompt)} characters) is longer than the model's "
                               f"context length ({ctx} tokens).", param="prompt")

    def check_ids(self, ids: list[int], param: str) -> None:
        """RequestError (400, naming `param`) for the first id outside the vocabulary."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"Token id {bad} is out of vocabulary (vocab size {vocab}).",
                               param=param)

    def _check_no_mask(self, input_ids: list[int]) -> None:
        """RequestError (400) for a prompt holding the mask token: the engine fills the mask
        positions of the blocks it generates, so one in the prompt's last block would be
        rewritten and one before it left as a hole."""
        mask = self.config.dllm.mask_id
        if mask in input_ids:
            raise RequestError(f"The prompt contains the mask token (id {mask}, position "
                               f"{input_ids.index(mask)}), which the model reserves for the "
                               f"positions it generates; remove it from the prompt.",
                               param="prompt")

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (400) for anything the engine cannot serve; a max_new_tokens
        left out becomes its default or `room()`, whichever is smaller. An explicit one that
        does not fit the context is a 400 here; one that does not fit the KV pool, a 400 from
        the scheduler."""
        n, ctx = len(input_ids), self.context_length
        if n == 0:
            raise RequestError("Prompt cannot be empty.", param="prompt")
        if n >= ctx:  # before anything that reads every id (a body's worth is millions)
            raise RequestError(f"The input ({n} tokens) is longer than the model's context "
                               f"length ({ctx} tokens).", param="prompt")
        self.check_ids(input_ids, "prompt")
        self._check_no_mask(input_ids)
        vocab = self.model_config.vocab_size
        if params.max_new_tokens is None:  # left out: never more than fits (as SGLang)
            params.max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, self.room(len(input_ids)))
        try:
            params.verify(vocab)
            params.dllm = self.algorithm.validate_request_params(params.dllm)
        except ValueError as e:
            raise RequestError(str(e), param=_param_of(str(e))) from None
        params.normalize()
        if n + params.max_new_tokens > ctx:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {n + params.max_new_tokens} tokens: {n} "
                f"tokens from the input and {params.max_new_tokens} tokens for the completion. "
                f"Please reduce the prompt or max tokens.", param="max_tokens")
        block = self.config.dllm.block_size
        need = -(-(n + params.max_new_tokens) // block) * block  # Req.max_end: whole blocks
        if need > self.kv_capacity:  # the scheduler's check, before anything is sent
            raise RequestError(
                f"The request needs {need} KV tokens (prompt + max_new_tokens, whole blocks), "
                f"more than the whole KV pool holds ({self.kv_capacity}; see "
                f"--max-total-tokens). Reduce the prompt or max tokens.", param="max_tokens")

    def submit(self, input_ids: list[int], params: SamplingParams,
               callback: Callable[[GenOutput], None], rid: str | None = None) -> str:
        """Validate and send one request; callback gets every update, the last one finished."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise RequestError(f"rid must be a non-empty string, got {rid!r}", param="rid")
        self.validate(input_ids, params)
        rid = rid or uuid.uuid4().hex
        with self.states_lock:
            if rid in self.states:
                raise RequestError(f"Duplicate request id {rid!r}.")
            self.states[rid] = ReqState(params, callback, self._detokenizer(params))
        ids = np.asarray(input_ids, dtype=np.int64)
        self._send(GenerateReq(rid, ids, params, time.monotonic()))
        return rid

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        skip = params.skip_special_tokens

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)

        return IncrementalDetokenizer(decode, params.stop, params.no_stop_trim)

    def abort(self, rid: str | None = None, abort_all: bool = False,
              copies: bool = False) -> None:
        """Abort the request `rid`, or all; with `copies` (a user's abort), where no request
        has `rid`, the copies made of it. Nothing once shut down (nothing runs)."""
        if self.closed:
            return
        if abort_all:
            self._send(AbortReq(rid=rid, abort_all=True))
        elif rid is not None:
            for one in self._family(rid) if copies else [rid]:
                self._send(AbortReq(rid=one))

    def _family(self, rid: str) -> list[str]:
        """[rid] when a request of the front has it; else the copies made of it ("rid-0",
        "rid-1", ...: n > 1, an OpenAI response's choices), as SGLang's abort takes every
        request whose rid begins with the one given; else [rid] (a request the front has
        already forgotten: the scheduler finds none)."""
        with self.states_lock:
            if rid in self.states:
                return [rid]
            copies = [r for r in self.states if r.startswith(rid + "-")]
        return copies or [rid]

    def server_info(self, timeout: float = 30.0) -> dict[str, Any]:
        info: InfoResp = self._ask(InfoReq, timeout)
        return {**self.ready_info, **info.info}

    def flush_cache(self, timeout: float = 30.0) -> FlushCacheResp:
        """Empty the scheduler's prefix cache; `success` False (and why, in `message`) while
        requests are running or waiting."""
        return self._ask(FlushCacheReq, timeout)

    def _ask(self, make: Callable[[int], object], timeout: float) -> Any:
        """Send make(req_id) to the scheduler and wait for the reply with that id (raises
        queue.Empty after `timeout` s)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        req_id = next(self.info_ids)
        reply: queue.Queue[Any] = queue.Queue(maxsize=1)
        with self.states_lock:
            self.info_waiters[req_id] = reply
        try:
            self._send(make(req_id))
            return reply.get(timeout=timeout)
        finally:
            with self.states_lock:
                self.info_waiters.pop(req_id, None)

    @property
    def kv_capacity(self) -> int:
        """Tokens the whole KV pool holds: the most prompt + output one request can reserve."""
        kv = self.ready_info["kv_pool"]
        return int(kv["total_pages"] * kv["page_size"])

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can ask for (at least 1): prompt +
        output within the context length and within the whole KV pool. The pool holds whole
        pages of whole blocks, so a total within it stays within it rounded up to a block."""
        return max(1, min(self.context_length, self.kv_capacity) - prompt_len)

    def num_pending(self) -> int:
        return len(self.states)

    def _send(self, msg: object) -> None:
        with self.tx_lock:
            self.tx.send(msg)

    # ---- outputs ----------------------------------------------------------------------------

    def _recv_loop(self) -> None:
        while not self.closed:
            try:
                msg = self.rx.recv(timeout_ms=200)
            except zmq.ZMQError:
                return
            if msg is None:
                if (dead := self.procs.dead()) is not None and not self.closed:
                    self._fail_all(f"the engine died: {dead}")
            elif isinstance(msg, BatchOutput):
                for out in msg.outputs:
                    self._deliver(out)
            elif isinstance(msg, InfoResp | FlushCacheResp):
                self._answer(msg)
            elif isinstance(msg, Fatal):
                self._fail_all(f"the engine failed: {msg.reason or msg.message}")

    def _deliver(self, out: ReqOutput) -> None:
        with self.states_lock:
            state = self.states.get(out.rid)
            if state is None:
                return
            if out.finished:
                del self.states[out.rid]
        now = time.monotonic()
        state.first_output = state.first_output or now
        state.output_ids.extend(out.new_ids.tolist())
        at = out.finish_reason.pop("at", None) if out.finish_reason else None  # internal
        delta = state.detok.update(state.output_ids, out.finish_reason, at)
        meta = {"id": out.rid, "finish_reason": out.finish_reason,
                "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens,
                "forward_steps": out.forward_steps, "denoise_steps": out.denoise_steps,
                "blocks": out.blocks,
                "block_forwards": out.block_forwards, "block_edits": out.block_edits,
                "e2e_latency": now - state.created,
                "time_to_first_block": state.first_output - state.created}
        state.callback(GenOutput(out.rid, state.detok.text, delta, state.output_ids,
                                 len(state.output_ids),
                                 out.new_ids.tolist(), out.finished, out.finish_reason, meta))

    def _answer(self, msg: InfoResp | FlushCacheResp) -> None:
        with self.states_lock:
            reply = self.info_waiters.pop(msg.req_id, None)
        if reply is None:
            logger.debug("dropped a late %s (id %d)", type(msg).__name__, msg.req_id)
            return
        reply.put(msg)

    def _fail_all(self, message: str) -> None:
        if self.dead is None:
            logger.error("%s", message)
        self._end_all(message)
        self.procs.kill(timeout=2.0)

    def _end_all(self, message: str) -> None:
        """Every request still waiting ends with an engine failure (`message`), and so does
        any later call."""
        self.dead = self.dead or message
        with self.states_lock:
            rids = list(self.states)
        reason = {"type": "abort", "message": message, "status_code": 500}
        for rid in rids:
            self._deliver(ReqOutput(rid, np.zeros(0, dtype=np.int64), True, reason))

    # ---- lifecycle --------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        try:
            self._send(Shutdown())
        except Exception:  # closed sockets, or an interpreter tearing down: stop by signals
            pass
        self.procs.kill(grace=SHUTDOWN_GRACE_S)  # the children stop on Shutdown; then signals
        self.thread.join(timeout=2.0)
        self._end_all("the engine was shut down")  # callers still waiting are told so
        self.tx.sock.close()
        self.rx.sock.close()
        self.ctx.term()


def _param_of(message: str) -> str | None:
    """The field a verify() message names first (its first word, dllm_ settings included)."""
    word = message.split(" ", 1)[0].rstrip(":=,")
    return word if word.replace("_", "").isalnum() else None
