"""Scheduler bookkeeping with a fake worker: admission, prefill, FDFO carry, in-place KV reuse,
finish rules, abort in every state, and pool integrity."""

from __future__ import annotations

import numpy as np
import pytest

from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.messages import (
    AbortReq,
    DenoiseWork,
    GenerateReq,
    PrefillDone,
    PrefillWork,
    ReqOutput,
    RoundResult,
)
from dllm_serve.managers.scheduler import Scheduler, SchedulerConfig
from dllm_serve.sampling_params import SamplingParams

K, MASK, EOS = 4, 99, 98


class FakeWorker:
    """Writes token 7 into every mask; a block is done after `need[block_start]` (or
    `need[("slot", s)]`) forwards, default 2. One block per request (no wavefront);
    sync runs until all requests are done, FDFO until any is."""

    def __init__(self, need: dict | None = None, fill: int = 7, fdfo: bool = True) -> None:
        self.need = need or {}
        self.fill = fill
        self.fdfo = fdfo
        self.works: list[PrefillWork | DenoiseWork] = []

    def run(self, work: PrefillWork | DenoiseWork) -> PrefillDone | RoundResult:
        self.works.append(work)
        if isinstance(work, PrefillWork):
            return PrefillDone()
        assert work.num_blocks == [1] * len(work.req_slots)
        rows = zip(work.req_slots, work.first_starts, work.block_steps, strict=True)
        left = np.array([max(1, self.need.get(("slot", r), self.need.get(s, 2)) - st)
                         for r, s, st in rows])
        forwards = int(left.min() if self.fdfo else left.max())
        done = left <= forwards
        ids = np.where(work.block_ids == MASK, self.fill, work.block_ids)
        states = [None if d else {"n": np.array(1)} for d in done]
        steps = work.block_steps + forwards
        return RoundResult(ids, work.num_blocks, done.astype(np.int64), states, steps,
                           np.where(done, work.block_steps + left, 0), forwards,
                           np.zeros(len(done), dtype=np.int64))


def make(worker: FakeWorker, fdfo: bool = True, mrr: int = 4, pages: int = 64,
         queue: int | None = None, prefill: int = 64, decode=None) -> Scheduler:
    cfg = SchedulerConfig(block_size=K, mask_id=MASK, fdfo=fdfo, max_running_requests=mrr,
                          max_queued_requests=queue, chunked_prefill_size=prefill,
                          num_pages=pages, page_size=K)
    worker.fdfo = fdfo
    return Scheduler(cfg, worker, FinishChecker({EOS}, decode))


def submit(s: Scheduler, rid: str, prompt_len: int, max_new: int = 8, **params) -> None:
    ids = np.arange(1, prompt_len + 1, dtype=np.int64)
    s.add_request(GenerateReq(rid, ids, SamplingParams(max_new_tokens=max_new, **params), 0.0))


def run_all(s: Scheduler, limit: int = 200) -> dict[str, list[ReqOutput]]:
    outs: dict[str, list[ReqOutput]] = {}
    for _ in range(limit):
        busy = s.step()
        for o in s.take_outputs():
            outs.setdefault(o.rid, []).append(o)
        s.check_integrity()
        if not busy:
            return outs
    raise AssertionError("did not finish")


def test_requests_complete_with_exact_lengths_and_pools_whole() -> None:
    s = make(FakeWorker(), mrr=3)
    lengths = {"a": (3, 5), "b": (9, 8), "c": (4, 1), "d": (13, 12), "e": (1, 4)}
    for rid, (p, n) in lengths.items():
        submit(s, rid, p, n, ignore_eos=True)
    outs = run_all(s)
    for rid, (_, n) in lengths.items():
        assert outs[rid][-1].finished and outs[rid][-1].finish_reason["type"] == "length"
        assert sum(len(o.new_ids) for o in outs[rid]) == n == outs[rid][-1].completion_tokens
    stats = s.alloc.stats()
    assert stats["free_pages"] == 64 and stats["free_slots"] == 3 and s.alloc.reserved == 0


def test_first_block_keeps_prompt_tail_and_outputs_only_new_tokens() -> None:
    w = FakeWorker()
    s = make(w)
    submit(s, "a", 6, 3)  # one prompt block (prefill) + tail of 2 in the first block
    outs = run_all(s)
    prefill = w.works[0]
    assert isinstance(prefill, PrefillWork) and prefill.token_ids[0].tolist() == [1, 2, 3, 4]
    first = w.works[1]
    assert isinstance(first, DenoiseWork)
    assert first.block_ids[0].tolist() == [5, 6, MASK, MASK] and first.first_starts == [4]
    assert outs["a"][0].new_ids.tolist() == [7, 7]


def test_prefill_is_chunked_and_goes_first() -> None:
    w = FakeWorker()
    s = make(w, prefill=2 * K)
    submit(s, "a", 5 * K + 1, 2)
    run_all(s)
    kinds = [type(x).__name__ for x in w.works]
    assert kinds[:3] == ["PrefillWork"] * 3
    assert [x.seg_starts for x in w.works[:3]] == [[0], [8], [16]]
    assert [len(x.token_ids[0]) for x in w.works[:3]] == [8, 8, 4]


def test_unfinished_block_reuses_slot_and_pages_in_place() -> None:
    # "a" (slot 0) resolves its blocks in 1 forward, "b" (slot 1) needs 3
    w = FakeWorker(need={("slot", 0): 1, ("slot", 1): 3})
    s = make(w, mrr=2)
    submit(s, "a", 2, 8)
    submit(s, "b", 3, 8)
    calls: list[tuple[str, int]] = []
    ensure = s.alloc.ensure

    def spy(h, end):
        new = ensure(h, end)
        if new:
            calls.append((next(r.rid for r in s.running if r.holding is h), new))
        return new

    s.alloc.ensure = spy  # type: ignore[method-assign]
    s.step()  # round 1: both fresh
    assert sorted(calls) == [("a", 1), ("b", 1)]
    b = next(r for r in s.running if r.rid == "b")
    slot, pages = b.holding.slot, list(b.holding.pages)
    assert b.dllm_incomplete_ids is not None and b.dllm_algo_state is not None
    calls.clear()
    s.step()  # round 2: "a" starts a fresh block, "b" continues in place
    assert calls == [("a", 1)]
    work = w.works[-1]
    row = work.req_slots.index(slot)
    assert work.pages[row].tolist() == pages and work.states[row] is not None
    assert b.holding.slot == slot and b.holding.pages == pages


def test_sync_mode_counts_wasted_request_steps() -> None:
    w = FakeWorker(need={0: 1})
    s = make(w, fdfo=False, mrr=2)
    submit(s, "a", 2, 2)
    submit(s, "b", 3, 2)
    w.need = {0: 3}
    s.step()
    # both blocks start at 0 and need 3 forwards: nothing wasted
    assert s.stats["wasted_request_steps"] == 0
    w.need = {4: 1}
    submit(s, "c", 1, 4)
    run_all(s)
    assert s.stats["request_steps"] >= s.stats["wasted_request_steps"] >= 0


def test_eos_and_stop_token_truncate_inside_a_block() -> None:
    w = FakeWorker(fill=EOS)
    s = make(w)
    submit(s, "a", 2, 8)
    submit(s, "b", 2, 8, ignore_eos=True, stop_token_ids=[5])
    outs = run_all(s)
    assert outs["a"][-1].new_ids.tolist() == [EOS]
    assert outs["a"][-1].finish_reason == {"type": "stop", "matched": EOS}
    assert outs["b"][-1].finish_reason["type"] == "length"


def test_stop_string_truncates_output_ids() -> None:
    decode = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731
    s = make(FakeWorker(fill=7), decode=decode)  # token 7 -> "h"
    submit(s, "a", 1, 16, stop=["hhh"])
    outs = run_all(s)
    last = outs["a"][-1]
    assert last.finish_reason == {"type": "stop", "matched": "hhh"}
    assert last.completion_tokens == 3


def test_abort_in_every_state_frees_everything() -> None:
    w = FakeWorker(need={0: 1, 4: 5})
    s = make(w, mrr=2)
    submit(s, "mid", 2, 16)  # will be mid-block after round 2
    submit(s, "between", 2, 16)
    submit(s, "waiting", 2, 16)  # mrr=2: stays in the queue
    s.step()  # round 1: both blocks at 0 finish (between blocks now)
    s.abort(AbortReq("between"))
    s.step()  # round 2: "mid" and "waiting"'s first... "mid" block 4 needs 5 forwards
    assert any(r.rid == "mid" and r.dllm_incomplete_ids is not None for r in s.running)
    s.abort(AbortReq("mid"))
    s.abort(AbortReq("nonexistent"))
    outs = {o.rid: o for o in s.take_outputs() if o.finished}
    assert outs["between"].finish_reason["type"] == "abort"
    assert outs["mid"].finish_reason["type"] == "abort"
    submit(s, "queued", 2, 16)
    s.abort(AbortReq(abort_all=True))
    s.take_outputs()
    assert s.idle
    s.check_integrity()
    assert s.alloc.stats()["free_pages"] == 64 and s.alloc.reserved == 0


def test_queue_limit_and_never_fits_are_rejected() -> None:
    """One running + one queued: a burst that reaches an idle scheduler at once admits what
    can start before counting the queue (regression: "b" was refused as "queue full" while
    "a" could start, so an idle server refused the second of two requests)."""
    s = make(FakeWorker(), mrr=1, pages=4, queue=1)
    submit(s, "huge", 4, 100)
    submit(s, "a", 2, 4)
    submit(s, "b", 2, 4)
    submit(s, "c", 2, 4)
    out = {o.rid: o for o in s.take_outputs()}
    assert out["huge"].finish_reason["status_code"] == 400
    assert "KV pool" in out["huge"].finish_reason["message"]
    assert set(out) == {"huge", "c"} and out["c"].finish_reason["status_code"] == 503
    assert [r.rid for r in s.running] == ["a"] and [r.rid for r in s.waiting] == ["b"]
    outs = run_all(s)
    assert outs["a"][-1].finish_reason["type"] == "length"
    assert outs["b"][-1].finish_reason["type"] == "length"


def test_request_waits_for_memory_then_completes() -> None:
    s = make(FakeWorker(), mrr=4, pages=4)  # each request reserves 3 pages
    submit(s, "a", 4, 8)
    submit(s, "b", 4, 8)
    s.step()
    assert [r.rid for r in s.running] == ["a"] and len(s.waiting) == 1
    outs = run_all(s)
    assert outs["b"][-1].finish_reason["type"] == "length"


@pytest.mark.parametrize("fdfo", [True, False])
def test_forward_steps_and_blocks_are_reported(fdfo: bool) -> None:
    s = make(FakeWorker(), fdfo=fdfo)
    submit(s, "a", 5, 8, ignore_eos=True)
    out = run_all(s)["a"][-1]
    # 1 prefill forward + 2 blocks x 2 forwards; 3 blocks hold 8 tokens after a 1-token tail
    assert out.blocks == 3 and out.forward_steps == 1 + 3 * 2
    assert out.block_forwards == [2, 2, 2]
