"""Scheduler + worker bookkeeping without a model (a scripted algorithm, a fake runner):
admission, prefill, blocks resident on the device, change-only messages, finish rules, abort
and preemption in every state, late reports, pool integrity."""

from __future__ import annotations

import numpy as np
import pytest
from local_engine import LocalEngine, scripted_engine

from dllm_serve.managers.messages import AbortReq, AddPages, Admit, Prefill, Release
from dllm_serve.managers.prefill_plan import merge_prefills

K, MASK, EOS = 4, 15, 14


def prompt(n: int) -> list[int]:
    return list(range(1, n + 1))


def test_requests_complete_with_exact_lengths_and_pools_whole() -> None:
    e = scripted_engine(mrr=3)
    lengths = {"a": (3, 5), "b": (9, 8), "c": (4, 1), "d": (13, 12), "e": (1, 4)}
    for rid, (p, n) in lengths.items():
        e.submit(rid, prompt(p), max_new_tokens=n, ignore_eos=True)
    outs = e.run()
    for rid, (_, n) in lengths.items():
        assert outs[rid][-1].finished and outs[rid][-1].finish_reason["type"] == "length"
        assert sum(len(o.new_ids) for o in outs[rid]) == n == outs[rid][-1].completion_tokens
    e.assert_whole()
    assert e.worker.batch.reqs == {}


def test_first_block_keeps_prompt_tail_and_outputs_only_new_tokens() -> None:
    e = scripted_engine()
    e.submit("a", prompt(6), max_new_tokens=3)
    outs = e.run()
    log = e.worker.runner.log  # type: ignore[attr-defined]
    assert log[0] == ("prefill", [0], [0], [[1, 2, 3, 4]])
    admit = next(x for x in e.sent if isinstance(x, Admit))
    assert admit.blocks.tolist() == [[5, 6, MASK, MASK]] and admit.first_start == 4
    assert log[1][0] == "forward" and log[1][2] == [4]
    assert outs["a"][0].new_ids.tolist() == [7, 7]


def test_prefill_is_chunked_and_goes_first() -> None:
    e = scripted_engine(prefill=2 * K)
    e.submit("a", prompt(5 * K + 1), max_new_tokens=2)
    e.run()
    log = e.worker.runner.log  # type: ignore[attr-defined]
    assert [x[0] for x in log[:4]] == ["prefill"] * 3 + ["forward"]
    assert [x[2] for x in log[:3]] == [[0], [8], [16]]
    assert [len(x[3][0]) for x in log[:3]] == [8, 8, 4]


def test_blocks_stay_on_the_device_and_only_changes_are_sent() -> None:
    """A request mid-block is never re-sent: while its blocks run, the scheduler sends nothing
    for it, and the worker keeps the same device layout (no rebuild, no upload)."""
    e = scripted_engine(mrr=2, need=lambda start: 2 if start < 8 else 6)
    e.submit("a", prompt(8), max_new_tokens=4, ignore_eos=True)  # one block at 8 (6 forwards)
    e.step()  # admit, prefill, first forward
    admits = [x for x in e.sent if isinstance(x, Admit)]
    pages = [x for x in e.sent if isinstance(x, AddPages)]
    assert len(admits) == 1 and len(pages) == 1
    slot = admits[0].slot
    layout = e.worker.batch.layout()
    sent = len(e.sent)
    for _ in range(4):  # forwards 2..5 of the block: nothing changes
        e.step()
        assert e.worker.batch.layout() is layout
    assert len(e.sent) == sent
    req = next(iter(e.sched.running.values()))
    assert req.holding.slot == slot and req.holding.pages == pages[0].pages.tolist()
    outs = e.run()
    assert outs["a"][-1].block_forwards == [6]


def test_pages_are_mapped_ahead_and_the_worker_opens_next_blocks_itself() -> None:
    e = scripted_engine(mrr=1)
    e.submit("a", prompt(2), max_new_tokens=40, ignore_eos=True)  # 11 blocks of 4
    outs = e.run()
    assert outs["a"][-1].completion_tokens == 40
    admits = [x for x in e.sent if isinstance(x, Admit)]
    assert len(admits) == 1  # every later block was opened by the worker
    mapped = sum(len(x.pages) for x in e.sent if isinstance(x, AddPages))
    assert mapped == 11  # each page mapped once, lazily, as the request advanced
    forwards = [x for x in e.worker.runner.log if x[0] == "forward"]  # type: ignore[attr-defined]
    assert len(forwards) == 11 * 2  # 2 forwards a block, none lost between blocks


def test_sync_mode_counts_wasted_request_steps() -> None:
    need = {0: 2, 4: 5}
    for fdfo in (True, False):
        e = scripted_engine(fdfo=fdfo, mrr=2, need=lambda s: need.get(s, 2))
        e.submit("a", prompt(2), max_new_tokens=2)  # block at 0: 2 forwards
        e.submit("b", prompt(5), max_new_tokens=2)  # block at 4: 5 forwards
        e.run()
        wasted = e.sched.stats["wasted_request_steps"]
        assert wasted == (0 if fdfo else 3), (fdfo, wasted)


def test_eos_and_stop_token_truncate_inside_a_block() -> None:
    e = scripted_engine(fill=EOS)
    e.submit("a", prompt(2), max_new_tokens=8)
    e.submit("b", prompt(2), max_new_tokens=8, ignore_eos=True, stop_token_ids=[5])
    outs = e.run()
    assert outs["a"][-1].new_ids.tolist() == [EOS]
    assert outs["a"][-1].finish_reason == {"type": "stop", "matched": EOS}
    assert outs["b"][-1].finish_reason["type"] == "length"


def test_stop_string_truncates_and_a_late_report_is_dropped() -> None:
    decode = lambda ids: "".join(chr(ord("a") + t % 26) for t in ids)  # noqa: E731
    e = scripted_engine(decode=decode)  # token 7 -> "h"
    e.submit("a", prompt(1), max_new_tokens=64, stop=["hhh"])
    outs = e.run()
    last = outs["a"][-1]
    assert last.finish_reason == {"type": "stop", "matched": "hhh"}
    assert last.completion_tokens == 3 and len(outs["a"]) == 1
    # the worker had opened the next block already; the scheduler released it
    assert any(isinstance(x, Release) for x in e.sent)


def test_abort_in_every_state_frees_everything() -> None:
    e = scripted_engine(mrr=2, need=lambda s: 6)
    e.submit("mid", prompt(2), max_new_tokens=16)
    e.submit("waiting1", prompt(2), max_new_tokens=16)
    e.submit("waiting2", prompt(2), max_new_tokens=16)  # mrr=2: queued
    for _ in range(3):
        e.step()
    assert len(e.sched.running) == 2 and len(e.sched.waiting) == 1
    e.sched.abort(AbortReq("mid"))
    e.sched.abort(AbortReq("waiting2"))
    e.sched.abort(AbortReq("nonexistent"))
    e.step()
    outs = {o.rid: o for o in e.sched.take_outputs() if o.finished}
    outs.update({rid: o[-1] for rid, o in e.outputs.items() if o[-1].finished})
    assert outs["mid"].finish_reason["type"] == "abort"
    assert outs["waiting2"].finish_reason["type"] == "abort"
    e.submit("queued", prompt(2), max_new_tokens=16)
    e.sched.abort(AbortReq(abort_all=True))
    e.step()
    e.step()
    assert e.sched.idle and e.worker.batch.reqs == {}
    e.assert_whole()


def test_aborting_queued_requests_keeps_the_rest_in_arrival_order() -> None:
    """An abort takes the queued requests of its rid (every one of them, wherever they are in
    the queue: several share a rid only in tests) and leaves the others first come first
    served; the queue's head, oldest and newest pops follow arrival order."""
    from dllm_serve.managers.wait_queue import WaitQueue

    e = scripted_engine(mrr=1)
    for rid in ["a", "b", "c", "b", "d"]:
        e.submit(rid, prompt(2), max_new_tokens=4)
    e.sched.abort(AbortReq("b"))
    e.sched.abort(AbortReq("nonexistent"))
    assert [r.rid for r in e.sched.waiting] == ["a", "c", "d"]
    aborted = [o for o in e.sched.take_outputs() if o.finished]
    assert [o.rid for o in aborted] == ["b", "b"]
    assert all(o.finish_reason["type"] == "abort" for o in aborted)
    q = WaitQueue()
    reqs = list(e.sched.waiting)
    for req in reqs:
        q.append(req)
    assert q.head() is reqs[0] and q.pop() is reqs[2] and q.popleft() is reqs[0]
    assert q.with_rid("c") == [reqs[1]] and q.with_rid("a") == [] and q.with_rid(None) == []
    q.remove(reqs[1])
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.head()
    e.run()
    assert [rid for rid, outs in e.outputs.items() if outs[-1].finished] == ["a", "c", "d"]
    e.assert_whole()


def test_preempt_and_resume_keep_the_block_and_its_state() -> None:
    e = scripted_engine(mrr=2, need=lambda s: 5)
    e.submit("a", prompt(2), max_new_tokens=8, ignore_eos=True)
    e.step()
    e.step()
    assert e.sched.preempt("a")
    e.step()  # the worker takes the blocks off and reports them
    req = next(iter(e.sched.held.values()))
    assert req.dllm_incomplete_ids is not None and req.block_steps == [2]
    assert e.worker.batch.reqs == {}
    slot = req.holding.slot
    for _ in range(3):
        e.step()  # held: nothing runs
    assert e.sched.resume("a")
    outs = e.run()
    assert outs["a"][-1].completion_tokens == 8
    assert outs["a"][-1].block_forwards[0] == 5  # the resumed block kept its step count
    admits = [x for x in e.sent if isinstance(x, Admit)]
    assert admits[1].slot == slot and admits[1].block_steps == [2]


def test_queue_limit_and_never_fits_are_rejected() -> None:
    """One running + one queued: a burst that reaches an idle scheduler at once admits what
    can start before counting the queue (regression: "b" was refused as "queue full" while
    "a" could start, so an idle server refused the second of two requests)."""
    e = scripted_engine(mrr=1, pages=4, queue=1)
    e.submit("huge", prompt(4), max_new_tokens=100)
    e.submit("a", prompt(2), max_new_tokens=4)
    e.submit("b", prompt(2), max_new_tokens=4)
    e.submit("c", prompt(2), max_new_tokens=4)
    out = {o.rid: o for o in e.sched.take_outputs()}
    assert out["huge"].finish_reason["status_code"] == 400
    assert "KV pool" in out["huge"].finish_reason["message"]
    assert set(out) == {"huge", "c"} and out["c"].finish_reason["status_code"] == 503
    assert [r.rid for r in e.sched.running.values()] == ["a"]
    assert [r.rid for r in e.sched.waiting] == ["b"]
    outs = e.run()
    assert outs["a"][-1].finish_reason["type"] == "length"
    assert outs["b"][-1].finish_reason["type"] == "length"


def test_requests_admitted_ahead_count_as_queued() -> None:
    """mrr 1, queue 1, one admitted ahead: "b" takes a slot past the batch's size and the
    queue's one place, so "c" is refused; /get_server_info counts one running, one waiting.
    A queue of 0 still admits a request that can start at once."""
    e = scripted_engine(mrr=1, pages=16, queue=1, ahead=1)
    for rid in "abc":
        e.submit(rid, prompt(2), max_new_tokens=4)
    out = {o.rid: o for o in e.sched.take_outputs()}
    assert set(out) == {"c"} and out["c"].finish_reason["status_code"] == 503
    assert [r.rid for r in e.sched.running.values()] == ["a", "b"] and not e.sched.waiting
    info = e.sched.server_info()
    assert (info["num_running_reqs"], info["num_waiting_reqs"]) == (1, 1)
    assert all(o[-1].finish_reason["type"] == "length" for o in e.run().values())
    with pytest.raises(ValueError, match="admit_ahead"):
        scripted_engine(mrr=1, queue=0, ahead=1)
    e = scripted_engine(mrr=1, pages=16, queue=0)
    for rid in "ab":
        e.submit(rid, prompt(2), max_new_tokens=4)
    out = {o.rid: o for o in e.sched.take_outputs()}
    assert set(out) == {"b"} and out["b"].finish_reason["status_code"] == 503
    assert e.run()["a"][-1].finish_reason["type"] == "length"


def test_request_waits_for_memory_then_completes() -> None:
    e = scripted_engine(mrr=4, pages=4)  # each request reserves 3 pages
    e.submit("a", prompt(4), max_new_tokens=8)
    e.submit("b", prompt(4), max_new_tokens=8)
    e.step()
    assert [r.rid for r in e.sched.running.values()] == ["a"] and len(e.sched.waiting) == 1
    outs = e.run()
    assert outs["b"][-1].finish_reason["type"] == "length"


@pytest.mark.parametrize("fdfo", [True, False])
def test_forward_steps_and_blocks_are_reported(fdfo: bool) -> None:
    e = scripted_engine(fdfo=fdfo)
    e.submit("a", prompt(5), max_new_tokens=8, ignore_eos=True)
    out = e.run()["a"][-1]
    # 1 prefill forward + 3 blocks x 2 forwards; 3 blocks hold 8 tokens after a 1-token tail
    assert out.blocks == 3 and out.forward_steps == 1 + 3 * 2
    assert out.block_forwards == [2, 2, 2] and out.denoise_steps == 6


def test_max_new_tokens_zero_prefills_only() -> None:
    engine: LocalEngine = scripted_engine()
    engine.submit("a", prompt(9), max_new_tokens=0)
    outs = engine.run()
    assert outs["a"][-1].finish_reason == {"type": "length", "length": 0}
    assert outs["a"][-1].completion_tokens == 0
    assert [x[0] for x in engine.worker.runner.log] == ["prefill"]  # type: ignore[attr-defined]
    assert isinstance(next(x for x in engine.sent if not isinstance(x, AddPages)), Prefill)
    engine.assert_whole()


def test_turnovers_joins_and_leaves_patch_rows_in_place() -> None:
    """FDFO W=1: a request's finished block is replaced by its next block in the same row, a
    finished request leaves a hole and a new one takes it: no row moves; rows move (the last
    ones into the holes) only when holes would cost (here: as the queue drains)."""
    calls = {"layouts": 0, "moves": 0, "reused": 0}
    e = scripted_engine(mrr=4, need=lambda s: 3 + (s // K) % 2)
    batch, storage = e.worker.batch, e.worker.storage
    rebuild, write = batch._rebuild, storage.write_rows

    def counting_rebuild():  # type: ignore[no-untyped-def]
        before = [r.uid for r in batch.current.reqs] if batch.current is not None else []
        out = rebuild()
        calls["layouts"] += 1  # a row another request left, taken by a newcomer:
        calls["reused"] += any(r.uid not in before and i < len(before) and before[i] >= 0
                               for i, r in enumerate(out.reqs))
        return out

    def counting_write(*args, sources=None, **kwargs):  # type: ignore[no-untyped-def]
        calls["moves"] += sources is not None and len(sources) > 0
        return write(*args, sources=sources, **kwargs)

    batch._rebuild = counting_rebuild  # type: ignore[method-assign]
    storage.write_rows = counting_write  # type: ignore[method-assign]
    for i in range(12):
        e.submit(f"r{i}", prompt(2 + i % 5), max_new_tokens=(2 + i % 3) * K, ignore_eos=True)
    outs = e.run()
    assert all(o[-1].completion_tokens == (2 + int(r[1:]) % 3) * K for r, o in outs.items())
    assert calls["layouts"] >= 12 and calls["moves"] <= 4 and calls["reused"] >= 2, calls
    for o in outs.values():  # W=1, one forward ahead: a request steps in exactly its blocks'
        assert o[-1].denoise_steps == sum(o[-1].block_forwards), o[-1]  # forwards, holes or not
    e.assert_whole()


def test_a_hole_never_writes_the_slot_its_request_left() -> None:
    """Every forward names only the slots of requests the worker holds, and the scratch slot
    for holes and padding: a request that left (finished or aborted) and whose slot the
    scheduler has handed to the next request never has K/V written there on its behalf."""
    e = scripted_engine(mrr=8, pages=128, need=lambda s: 2 + (s // K) % 3)
    scratch = e.worker.runner.scratch_slot  # type: ignore[attr-defined]
    for i in range(24):
        e.submit(f"r{i}", prompt(1 + i % 4), max_new_tokens=(1 + i % 3) * K, ignore_eos=True)
    log = e.worker.runner.log  # type: ignore[attr-defined]
    launch, checked = e.worker.launch, {"forwards": 0, "holes": 0}

    def checked_launch():  # type: ignore[no-untyped-def]
        held = {r.slot for r in e.worker.batch.reqs.values()}  # at launch time
        seen = len(log)
        out = launch()
        for entry in log[seen:]:
            assert entry[0] == "forward" and set(entry[1]) <= held | {scratch}, (entry, held)
            checked["forwards"] += 1
            checked["holes"] += entry[1].count(scratch)
        return out

    e.worker.launch = checked_launch  # type: ignore[method-assign]
    for n in range(400):
        if n == 6:
            e.sched.abort(AbortReq("r1"))
        if not e.step():
            break
    assert checked["forwards"] > 20 and checked["holes"] > 0, checked  # holes did run
    assert all(o[-1].finished for o in e.outputs.values()) and len(e.outputs) == 24
    e.assert_whole()


def test_prefills_that_arrive_together_merge_but_never_past_a_release() -> None:
    def pre(slot: int, n: int) -> Prefill:
        return Prefill([slot], [0], [np.arange(n)])

    none = np.zeros(0, np.int64)
    items = [AddPages(0, 0, none), pre(0, 8), Admit(1, 0, 8, none, [], [], None),
             AddPages(1, 0, none), pre(1, 8), Release(9), AddPages(2, 0, none), pre(2, 8),
             pre(3, 12)]
    out = merge_prefills(items, max_tokens=16)  # type: ignore[arg-type]
    kinds = [type(x).__name__ for x in out]
    assert kinds == ["AddPages", "Admit", "AddPages", "Prefill", "Release", "AddPages",
                     "Prefill", "Prefill"]
    assert out[3].slots == [0, 1] and out[6].slots == [2] and out[7].slots == [3]


def test_a_request_counts_the_forwards_it_was_in_the_layout_for() -> None:
    """ResidentBatch.forwards: forwards run while the request had rows, across patches, a hole
    (it left with no block open: forwards without it do not count) and a request's second
    block."""
    from dllm_serve.managers.batch_layout import Block, DeviceReq
    from dllm_serve.managers.messages import ReqSettings

    batch = scripted_engine(mrr=4).worker.batch
    settings = ReqSettings(prompt_len=0, max_end=64)
    a, b, c, d = (DeviceReq(uid, uid, settings, K, [Block(0, init_ids=np.full(K, 15))])
                  for uid in range(4))

    def run(n: int) -> list[bool]:
        holes = [r.hole for r in batch.layout().reqs]
        for _ in range(n):
            batch.launched()
        return holes

    batch.add(a)
    run(3)
    for r in (b, c, d):
        batch.add(r)
    run(2)  # a patch: b, c, d appended
    batch.retire(a, 1)
    assert run(4) == [True, False, False, False]  # a left a hole: these do not count for it
    batch.open_block(a)
    assert run(5) == [False] * 4  # a took its hole back
    assert [batch.forwards(r) for r in (a, b, c, d)] == [3 + 2 + 5] + [2 + 4 + 5] * 3
    batch.open_block(b)  # two blocks: b's second takes a row, the counts carry over
    run(1)
    assert [batch.forwards(r) for r in (a, b, c, d)] == [11] + [12] * 3


@pytest.mark.parametrize("fdfo", [True, False])
def test_requests_admitted_ahead_wait_on_the_worker_and_join_without_a_round_trip(
        fdfo: bool) -> None:
    """With admit_ahead the scheduler admits (slot, pages, prefill) past max_running_requests;
    the worker keeps at most max_running_requests in its batch and lets a waiting request in
    when one leaves: with FDFO in an iteration that brought it no admission (sync already
    holds admitted requests until its batch boundary). The outputs are those without; the
    pools end whole."""

    def run(ahead: int) -> tuple[LocalEngine, int, int, int]:
        e = scripted_engine(mrr=2, fdfo=fdfo, ahead=ahead,
                            need=lambda start: 2 + (start // 4) % 3)
        for i in range(7):
            e.submit(f"r{i}", prompt(4 + i), max_new_tokens=4 * (1 + i % 3), ignore_eos=True)
        admitted = in_batch = joined_alone = 0
        while True:
            before = set(e.worker.batch.reqs)
            sent = len(e.sent)
            if not e.step():
                break
            admitted = max(admitted, len(e.sched.running))
            in_batch = max(in_batch, len(e.worker.batch.reqs))
            new = set(e.worker.batch.reqs) - before
            if new and not any(isinstance(x, Admit) and x.uid in new for x in e.sent[sent:]):
                joined_alone += 1
            e.sched.check_integrity()
        e.assert_whole()
        return e, admitted, in_batch, joined_alone

    base, admitted, in_batch, joined_alone = run(0)
    assert admitted == in_batch == 2 and (joined_alone == 0 or not fdfo)
    e, admitted, in_batch, joined_alone = run(2)
    assert admitted == 4 and in_batch == 2 and joined_alone > 0
    assert {r: e.tokens(r) for r in base.outputs} == {r: base.tokens(r) for r in base.outputs}
    assert not e.worker.flow.waiting and not e.worker.batch.reqs
