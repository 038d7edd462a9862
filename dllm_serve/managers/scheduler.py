"""The scheduler: owns requests, queues, admission, the KV allocator and the request lifecycle.

It never waits for the worker. Each loop iteration it takes the front's messages (requests,
aborts, info) and the worker's reports (retired blocks, preempted and failed requests), and
answers with changes for the worker: pages, prefill forwards and admissions of new requests,
releases of finished ones. Committing a retired block (finish check, output to the front) is
the scheduler's; running the blocks is the worker's (see messages.py for who owns a block
when). The worker opens a request's next block itself while the request's pages cover it, so
the scheduler keeps each running request's pages mapped LOOKAHEAD_BLOCKS ahead of the last
block it knows of.

Prefix cache: a new request takes the longest prefix of its prompt that the radix cache holds
(whole pages, shared), and only the rest is prefilled; its pages enter the cache as they
become final (managers/req_pages.py): prompt pages as soon as the prefill forward that writes
them is sent, so requests admitted later in the same round share them too.
"""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any

import numpy as np

from dllm_serve.managers.finish import FinishChecker, remember
from dllm_serve.managers.messages import (
    AbortReq,
    Admit,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    InfoReq,
    InfoResp,
    Preempt,
    Preempted,
    Release,
    ReqOutput,
    ReqSettings,
    Retired,
    WorkerReport,
    WorkItem,
)
from dllm_serve.managers.prefill_plan import PrefillPlanner
from dllm_serve.managers.req import Req
from dllm_serve.managers.req_pages import ReqPages
from dllm_serve.managers.scheduler_config import SchedulerConfig
from dllm_serve.managers.wait_queue import WaitQueue
from dllm_serve.mem.allocator import KVAllocator

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, finish: FinishChecker) -> None:
        self.config = config
        self.finish = finish
        self.alloc = KVAllocator(config.num_pages, config.page_size, config.max_admitted,
                                 config.radix_cache)
        self.waiting = WaitQueue()  # FIFO, O(1) aborts
        self.running: dict[int, Req] = {}  # by uid, admission order
        self.held: dict[int, Req] = {}  # preempted: off the device, keeping slot and pages
        self.outbox: list[Any] = []
        self.to_worker: list[WorkItem] = []
        self.pages = ReqPages(self.alloc, config, self.to_worker)
        self.uids = itertools.count(1)
        self.rng = random.Random(config.random_seed)
        self._stop_arrays: dict[frozenset[int], np.ndarray] = {}  # ReqSettings.stop_ids, shared
        self.stats = {"rounds": 0, "prefill_rounds": 0, "forwards": 0, "inplace_reloops": 0,
                      "committed_blocks": 0, "request_steps": 0, "wasted_request_steps": 0,
                      "kernel_compiles_after_ready": 0}
        self.prefill = PrefillPlanner(config, self.to_worker, self.pages, self.stats)

    # ---- the loop's interface -----------------------------------------------------------

    def handle(self, msg: Any) -> None:
        """A message from the front."""
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, InfoReq):
            self.outbox.append(InfoResp(msg.req_id, self.server_info()))
        elif isinstance(msg, FlushCacheReq):
            self.outbox.append(self.flush_cache(msg.req_id))
        else:
            raise TypeError(f"scheduler got an unexpected message {type(msg).__name__}")

    def on_report(self, rep: WorkerReport) -> None:
        """A report from the worker: count, then commit, fail and hold what it names."""
        self._count(rep)
        if rep.retired is not None:
            self._retired(rep.retired)
        for failed in rep.failed:
            if (req := self.running.get(failed.uid)) is not None:
                self._finish(req, {"type": "error", "message": failed.message,
                                   "status_code": 500})
        for pre in rep.preempted:
            self._preempted(pre)

    def schedule(self) -> None:
        """Admit what fits; the changes go to `to_worker`."""
        self._admit()

    def take_outputs(self) -> list[Any]:
        out, self.outbox = self.outbox, []
        return out

    def take_worker_items(self) -> list[WorkItem]:
        out = list(self.to_worker)
        self.to_worker.clear()  # shared with self.pages
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
        self.waiting.append(req)
        limit = self.config.max_queued_requests
        if limit is not None and self.num_queued > limit:
            self._admit()  # requests that can start now are not queued (a burst at idle)
            if self.num_queued > limit:  # it waits, and waits last (admission is FIFO)
                self.waiting.pop()
                return self._reject(req, 503, "The request queue is full.")

    @property
    def num_in_batch(self) -> int:
        """Admitted requests counted as running: at most max_running_requests (the worker's
        batch size); those admitted ahead past it wait on the worker (a forward after a
        request leaves, one of them takes its place)."""
        return min(len(self.running), self.config.max_running_requests)

    @property
    def num_queued(self) -> int:
        """Requests counted as queued (bounded by max_queued_requests): those waiting for
        admission and those admitted ahead, prefilled, waiting to join the batch."""
        return len(self.waiting) + len(self.running) - self.num_in_batch

    def abort(self, msg: AbortReq) -> None:
        for req in list(self.waiting) if msg.abort_all else self.waiting.with_rid(msg.rid):
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "message": msg.message})
        for req in [r for r in self.running.values() if msg.abort_all or r.rid == msg.rid]:
            self._finish(req, {"type": "abort", "message": msg.message})

    def preempt(self, rid: str) -> bool:
        """Take a running request's blocks off the device (it keeps its slot and pages); they
        come back in the worker's report and wait in `held` until `resume`. False if no such
        running request."""
        req = next((r for r in self.running.values() if r.rid == rid and r.on_device), None)
        if req is None:
            return False
        req.on_device = False
        self.to_worker.append(Preempt(req.uid))
        return True

    def resume(self, rid: str) -> bool:
        """Send a held request's blocks back to the device."""
        req = next((r for r in self.held.values() if r.rid == rid), None)
        if req is None:
            return False
        del self.held[req.uid]
        self._send_blocks(req)
        return True

    def flush_cache(self, req_id: int = 0) -> FlushCacheResp:
        """Empty the prefix cache; refused while any request runs or waits (as SGLang)."""
        if not self.idle:
            return FlushCacheResp(req_id, False, f"Cannot flush the cache while requests are "
                                  f"running or waiting ({len(self.running)} running, "
                                  f"{len(self.waiting)} waiting); retry when the server is idle.")
        freed = self.alloc.flush()
        logger.info("flushed the prefix cache (%d pages)", freed)
        return FlushCacheResp(req_id, True, f"Cache flushed ({freed} KV pages freed).", freed)

    def _reject(self, req: Req, status: int, message: str) -> None:
        self._finish(req, {"type": "abort", "message": message, "status_code": status})

    # ---- admission --------------------------------------------------------------------------

    def _admit(self) -> None:
        """Admit waiting requests, first come first served, while memory allows and fewer than
        max_running_requests + admit_ahead hold a slot: the `admit_ahead` past the batch's
        size wait on the worker, prefilled, and take a finished request's place in the very
        forward after it leaves (the worker keeps at most max_running_requests in its batch),
        instead of after a round trip through this process."""
        new = []
        while self.waiting and len(self.running) < self.config.max_admitted:
            req = self.waiting.head()
            match = self.alloc.match(req.input_ids)
            if not self.alloc.can_admit(req.max_end, match):
                break  # FCFS: the head waits for memory, nobody overtakes it
            self.waiting.popleft()
            req.uid = next(self.uids)
            self.running[req.uid] = req
            self.pages.start(req, match)
            self.prefill.add(req)
            new.append(req)
        self.prefill.send()
        for req in new:
            if req.params.max_new_tokens == 0:  # prefill only (SGLang): nothing to generate
                self._finish(req, {"type": "length", "length": 0})
            else:
                self._send_blocks(req)

    def _send_blocks(self, req: Req) -> None:
        """Admit the request's unfinished blocks (or its first block) to the device."""
        assert req.holding is not None and req.holding.slot is not None
        blocks = req.current_blocks(self.config.mask_id)
        self.to_worker.append(Admit(
            req.uid, req.holding.slot, req.block_start, blocks,
            req.dllm_algo_state or [None] * len(blocks), req.block_steps or [0] * len(blocks),
            self._settings(req)))
        req.dllm_incomplete_ids, req.dllm_algo_state, req.block_steps = None, None, []
        req.on_device = True

    def _settings(self, req: Req) -> ReqSettings:
        p = req.params
        # an early stop token does not end a request with min_new_tokens: the finish check
        # decides (the worker's array of a stop set is shared: read only, never written)
        stop = self.finish.stop_set(req) if not p.min_new_tokens else frozenset()
        ids = self._stop_arrays.get(stop)
        if ids is None:
            ids = np.array(sorted(stop), dtype=np.int64)
            ids.flags.writeable = False
            remember(self._stop_arrays, stop, ids, len(stop))  # small ones shared
        return ReqSettings(req.prompt_len, req.max_end, p.temperature, p.top_p, req.seed,
                           dict(p.dllm), ids, top_k=p.top_k, min_p=p.min_p)

    # ---- results ----------------------------------------------------------------------------

    def _retired(self, r: Retired) -> None:
        cols = zip(r.uids.tolist(), r.starts.tolist(), r.forwards.tolist(), r.edits.tolist(),
                   r.req_forwards.tolist(), strict=True)  # Python ints, not numpy scalars
        for i, (uid, start, forwards, edits, req_forwards) in enumerate(cols):
            req = self.running.get(uid)
            if req is None:
                continue  # finished meanwhile (stop string, abort): a late report
            if start != req.committed_len:
                raise RuntimeError(f"worker retired block {start} of {req.rid!r}, "
                                   f"expected {req.committed_len}")
            req.block_forwards.append(forwards)
            req.block_edits.append(edits)
            req.denoise_steps = req_forwards
            req.forward_steps = req.prefill_forwards + req.denoise_steps
            self._commit(req, r.ids[i])
            if not req.finished:
                self.pages.top_up(req)

    def _preempted(self, pre: Preempted) -> None:
        req = self.running.get(pre.uid)
        if req is None:
            return
        if pre.first_start != req.committed_len:
            raise RuntimeError(f"preempted {req.rid!r} at {pre.first_start}, expected "
                               f"{req.committed_len}")
        if len(pre.blocks):
            req.dllm_incomplete_ids = pre.blocks
            req.dllm_algo_state = pre.states
            req.block_steps = list(pre.block_steps)
        req.denoise_steps = pre.req_forwards
        self.held[req.uid] = req

    def _count(self, rep: WorkerReport) -> None:
        s = self.stats
        s["rounds"] += rep.rounds
        s["forwards"] += rep.forwards
        s["inplace_reloops"] += rep.forwards - rep.rounds
        s["request_steps"] += rep.block_steps
        s["wasted_request_steps"] += rep.idle_block_steps
        s["kernel_compiles_after_ready"] += rep.compiles

    def _commit(self, req: Req, block: np.ndarray) -> None:
        new = self.finish.commit(req, req.generated_part(block))
        req.committed_len = req.block_end
        req.blocks += 1
        self.stats["committed_blocks"] += 1
        self.pages.cache(req, new)
        if req.finished:
            self._release(req)
        self.outbox.append(self._output(req, new))

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        self._release(req)
        self.outbox.append(self._output(req, np.zeros(0, dtype=np.int64)))

    def _release(self, req: Req) -> None:
        """Free what the request holds and tell the worker to drop it (if it was admitted)."""
        if req.holding is not None:
            self.alloc.release(req.holding)
        if self.running.pop(req.uid, None) is not None:
            self.held.pop(req.uid, None)
            self.to_worker.append(Release(req.uid))

    def _output(self, req: Req, new: np.ndarray) -> ReqOutput:
        return ReqOutput(
            rid=req.rid, new_ids=new, finished=req.finished, finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids),
            forward_steps=req.forward_steps, denoise_steps=req.denoise_steps, blocks=req.blocks,
            block_forwards=list(req.block_forwards) if req.finished else [],
            block_edits=list(req.block_edits) if req.finished else [],
            cached_tokens=req.cached_tokens)

    # ---- introspection --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Pages: reference counts equal their holders (requests, cache), free + evictable
        + in use == total, cache locks equal the requests' paths; slots owned once. Raises."""
        self.alloc.check([r.holding for r in self.running.values() if r.holding is not None])

    def server_info(self) -> dict[str, Any]:
        s = self.alloc.stats()
        return {
            "kv_pool": {"total_pages": s["total_pages"], "free_pages": s["free_pages"],
                        "reserved_pages": s["reserved_pages"],
                        "page_size": self.config.page_size},
            "req_pool": {"total_slots": s["total_slots"], "free_slots": s["free_slots"]},
            "radix_cache": {"cached_pages": s["cached_pages"],
                            "evictable_pages": s["evictable_pages"],
                            **self.pages.prompt_tokens},
            "num_running_reqs": self.num_in_batch, "num_waiting_reqs": self.num_queued,
            "block_size": self.config.block_size, "dllm_fdfo": self.config.fdfo,
            "stats": dict(self.stats),
        }
