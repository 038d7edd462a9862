"""The scheduler: owns requests, queues, admission, the KV allocator and the FDFO lifecycle.

One round = one unit of work sent to the worker: either prefill (prompt blocks of newly
admitted requests, which go first) or denoise (the current block of every running request).
After a denoise round each row is either committed (accept_length = block_size: output, finish
check, next block) or carried (`req.dllm_incomplete_ids` / `req.dllm_algo_state` stored; its
slot and KV pages stay where they are, so the next round reuses them in place).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.messages import (
    AbortReq,
    DenoiseWork,
    GenerateReq,
    InfoReq,
    InfoResp,
    PrefillDone,
    PrefillWork,
    ReqOutput,
    RoundResult,
)
from dllm_serve.managers.req import Req
from dllm_serve.mem.allocator import KVAllocator

logger = logging.getLogger(__name__)

Work = PrefillWork | DenoiseWork
Result = PrefillDone | RoundResult


class WorkerLike(Protocol):
    def run(self, work: Work) -> Result: ...


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    mask_id: int
    fdfo: bool
    max_running_requests: int
    max_queued_requests: int | None
    chunked_prefill_size: int
    num_pages: int
    page_size: int
    random_seed: int = 0
    wavefront_size: int = 1

    def __post_init__(self) -> None:
        if self.page_size % self.block_size:
            raise ValueError(f"--page-size ({self.page_size}) must be a multiple of the "
                             f"model's block size ({self.block_size})")


class Scheduler:
    def __init__(self, config: SchedulerConfig, worker: WorkerLike,
                 finish: FinishChecker) -> None:
        self.config = config
        self.worker = worker
        self.finish = finish
        self.alloc = KVAllocator(config.num_pages, config.page_size, config.max_running_requests)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outbox: list[Any] = []
        self.inflight: list[Req] = []  # the rows of the work last scheduled, in order
        self.rng = random.Random(config.random_seed)
        self.stats = {"rounds": 0, "prefill_rounds": 0, "forwards": 0, "inplace_reloops": 0,
                      "committed_blocks": 0, "request_steps": 0, "wasted_request_steps": 0}

    # ---- the loop body ------------------------------------------------------------------

    def step(self) -> bool:
        """Schedule and run one round; False when there was nothing to do."""
        work = self.schedule()
        if work is None:
            return False
        self.process(work, self.worker.run(work))
        return True

    def handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, InfoReq):
            self.outbox.append(InfoResp(msg.req_id, self.server_info()))
        else:
            raise TypeError(f"scheduler got an unexpected message {type(msg).__name__}")

    def take_outputs(self) -> list[Any]:
        out, self.outbox = self.outbox, []
        return out

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # ---- requests in ----------------------------------------------------------------------

    def add_request(self, msg: GenerateReq) -> None:
        seed = msg.params.seed if msg.params.seed is not None else self.rng.getrandbits(63)
        req = Req(msg.rid, msg.input_ids, msg.params, msg.arrival, self.config.block_size, seed)
        need = self.alloc.pages_for(req.max_end)
        if need > self.alloc.pages.size:
            return self._reject(req, 400, f"The request needs {req.max_end} KV tokens "
                                f"(prompt + max_new_tokens, whole blocks), more than the whole "
                                f"KV pool holds ({self.alloc.pages.size * self.config.page_size}"
                                f"; see --max-total-tokens). Reduce the prompt or max tokens.")
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            self._admit()  # requests that can start now are not queued (a burst at idle)
            if len(self.waiting) >= limit:
                return self._reject(req, 503, "The request queue is full.")
        self.waiting.append(req)

    def abort(self, msg: AbortReq) -> None:
        victims = [r for r in [*self.waiting, *self.running] if msg.abort_all or r.rid == msg.rid]
        for req in victims:
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, {"type": "abort", "message": msg.message})

    def _reject(self, req: Req, status: int, message: str) -> None:
        self._finish(req, {"type": "abort", "message": message, "status_code": status})

    # ---- scheduling -----------------------------------------------------------------------

    def schedule(self) -> Work | None:
        self._admit()
        prefill = [r for r in self.running if r.needs_prefill]
        if prefill:
            return self._prefill_work(prefill)
        if self.running:
            return self._denoise_work(list(self.running))
        return None

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self.alloc.can_admit(req.max_end):
                break  # FCFS: the head waits for memory, nobody overtakes it
            self.waiting.popleft()
            req.holding = self.alloc.admit(req.max_end)
            self.running.append(req)

    def _prefill_work(self, reqs: list[Req]) -> PrefillWork:
        k = self.config.block_size
        budget = max(k, self.config.chunked_prefill_size // k * k)
        work = PrefillWork([], [], [], [])
        self.inflight = []
        for req in reqs:
            end = min(req.prefill_end, req.committed_len + budget)
            if end <= req.committed_len:
                break
            self.inflight.append(req)
            self._add_row(work, req, end)
            work.seg_starts.append(req.committed_len)
            work.token_ids.append(req.input_ids[req.committed_len:end].astype(np.int64))
            budget -= end - req.committed_len
        return work

    def _denoise_work(self, reqs: list[Req]) -> DenoiseWork:
        blocks = [r.current_blocks(self.config.mask_id) for r in reqs]
        work = DenoiseWork(
            req_slots=[], pages=[], first_starts=[r.block_start for r in reqs],
            num_blocks=[len(b) for b in blocks],
            limits=[r.window_end(self.config.wavefront_size) for r in reqs],
            block_ids=np.concatenate(blocks),
            states=[s for r, b in zip(reqs, blocks, strict=True)
                    for s in (r.dllm_algo_state or [None] * len(b))],
            block_steps=np.array([s for r, b in zip(reqs, blocks, strict=True)
                                  for s in (r.block_steps or [0] * len(b))], dtype=np.int64),
            temperatures=[r.params.temperature for r in reqs],
            top_ps=[r.params.top_p for r in reqs], seeds=[r.seed for r in reqs],
            params=[r.params.dllm for r in reqs], top_ks=[r.params.top_k for r in reqs],
            min_ps=[r.params.min_p for r in reqs])
        self.inflight = reqs
        for req, limit in zip(reqs, work.limits, strict=True):
            self._add_row(work, req, limit)
        return work

    def _add_row(self, work: PrefillWork | DenoiseWork, req: Req, end: int) -> None:
        assert req.holding is not None and req.holding.slot is not None
        self.alloc.ensure(req.holding, end)
        work.req_slots.append(req.holding.slot)
        work.pages.append(self.alloc.page_array(req.holding))

    # ---- results --------------------------------------------------------------------------

    def process(self, work: Work, result: Result) -> None:
        self.stats["rounds"] += 1
        if isinstance(work, PrefillWork):
            assert isinstance(result, PrefillDone)
            return self._process_prefill(work)
        assert isinstance(result, RoundResult)
        self._count(result)
        first = 0
        for b, req in enumerate(self.inflight):
            n, retired = result.num_blocks[b], int(result.retired[b])
            req.forward_steps += result.forwards
            req.denoise_steps += result.forwards
            self._retire(req, result, first, retired)
            if not req.finished:
                self._carry(req, result, first + retired, first + n)
            first += n

    def _retire(self, req: Req, result: RoundResult, first: int, count: int) -> None:
        """Commit the request's leading `count` blocks, in order, until it finishes."""
        for row in range(first, first + count):
            req.block_forwards.append(int(result.done_steps[row]))
            req.block_edits.append(int(result.block_edits[row]))
            self._commit(req, result.block_ids[row])
            if req.finished:
                return

    def _carry(self, req: Req, result: RoundResult, lo: int, hi: int) -> None:
        """Keep blocks [lo, hi) of the result as the request's unfinished blocks (in place)."""
        if lo == hi:
            req.dllm_incomplete_ids, req.dllm_algo_state, req.block_steps = None, None, []
            return
        req.dllm_incomplete_ids = result.block_ids[lo:hi].copy()
        req.dllm_algo_state = result.states[lo:hi]
        req.block_steps = result.block_steps[lo:hi].tolist()

    def _process_prefill(self, work: PrefillWork) -> None:
        self.stats["prefill_rounds"] += 1
        self.stats["forwards"] += 1
        for req, ids in zip(self.inflight, work.token_ids, strict=True):
            req.committed_len += len(ids)
            req.forward_steps += 1

    def _count(self, result: RoundResult) -> None:
        rows = len(result.num_blocks)
        self.stats["forwards"] += result.forwards
        self.stats["inplace_reloops"] += result.forwards - 1
        self.stats["request_steps"] += rows * result.forwards
        done = result.done_steps > 0
        wasted = np.where(done, result.block_steps - result.done_steps, 0)
        self.stats["wasted_request_steps"] += int(wasted.sum())

    def _commit(self, req: Req, block: np.ndarray) -> None:
        new = self.finish.commit(req, req.generated_part(block))
        req.committed_len = req.block_end
        req.blocks += 1
        self.stats["committed_blocks"] += 1
        if req.finished:
            self.running.remove(req)
            self._release(req)
        self.outbox.append(self._output(req, new))

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        self._release(req)
        self.outbox.append(self._output(req, np.zeros(0, dtype=np.int64)))

    def _release(self, req: Req) -> None:
        if req.holding is not None:
            self.alloc.release(req.holding)

    def _output(self, req: Req, new: np.ndarray) -> ReqOutput:
        return ReqOutput(
            rid=req.rid, new_ids=new, finished=req.finished, finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
            forward_steps=req.forward_steps, denoise_steps=req.denoise_steps, blocks=req.blocks,
            block_forwards=list(req.block_forwards) if req.finished else [],
            block_edits=list(req.block_edits) if req.finished else [])

    # ---- introspection --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """free + used == total for pages and slots; nothing owned twice; raises if not."""
        self.alloc.check([r.holding for r in self.running if r.holding is not None])

    def server_info(self) -> dict[str, Any]:
        s = self.alloc.stats()
        return {
            "kv_pool": {"total_pages": s["total_pages"], "free_pages": s["free_pages"],
                        "reserved_pages": s["reserved_pages"],
                        "page_size": self.config.page_size},
            "req_pool": {"total_slots": s["total_slots"], "free_slots": s["free_slots"]},
            "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "block_size": self.config.block_size, "dllm_fdfo": self.config.fdfo,
            "stats": dict(self.stats),
        }
