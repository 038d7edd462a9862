"""The scheduler with the radix prefix cache (scripted algorithm, fake runner): a request takes
the cached prefix and prefills only the rest, output pages are reused, eviction comes before
waiting, flush, and no page lost or leaked under aborts, preemption and eviction in any order."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from local_engine import LocalEngine, scripted_engine

from dllm_serve.managers.messages import AbortReq, AddPages, FlushCacheReq, FlushCacheResp

K = 4


def prompt(n: int, base: int = 1) -> list[int]:
    return [base + i % 13 for i in range(n)]


def prefills(e: LocalEngine) -> list[tuple[list[int], list[int]]]:
    """(slots, seg_starts) of each prefill forward the runner ran."""
    return [(x[1], x[2]) for x in e.worker.runner.log if x[0] == "prefill"]  # type: ignore[attr-defined]


def test_a_cached_prompt_is_not_prefilled_again() -> None:
    e = scripted_engine(mrr=2)
    e.submit("a", prompt(14), max_new_tokens=6, ignore_eos=True)
    first = e.run()["a"]
    assert prefills(e) == [([0], [0])] and e.sched.alloc.stats()["cached_pages"] >= 3
    e.worker.runner.log.clear()  # type: ignore[attr-defined]
    sent = len(e.sent)
    e.submit("b", prompt(14), max_new_tokens=6, ignore_eos=True)  # same prompt: 12 cached
    e.submit("c", prompt(8) + prompt(6, base=5), max_new_tokens=6, ignore_eos=True)  # 8 cached
    outs = e.run()
    assert prefills(e) == [([1], [8])]  # only c's third block; b's whole blocks were cached
    adds = [x for x in e.sent[sent:] if isinstance(x, AddPages)]
    a_pages = adds[0].pages[:3].tolist()
    assert adds[0].first == 0 and adds[1].first == 0  # the cached pages mapped on admission
    assert adds[1].pages[:2].tolist() == a_pages[:2]
    assert e.tokens("b") == [t for o in first for t in o.new_ids.tolist()]
    assert outs["c"][-1].completion_tokens == 6
    cache = e.sched.server_info()["radix_cache"]
    assert cache["hit_tokens"] == 12 + 8 and cache["miss_tokens"] == 14 + 2 + 6
    e.assert_whole()


def test_requests_admitted_together_share_pages_of_sent_prefill_forwards() -> None:
    """Two requests with the same prompt arrive together; prefill forwards hold 2 blocks: the
    second shares what the first forward (already sent) wrote, and prefills only the rest."""
    e = scripted_engine(mrr=2, prefill=2 * K)
    for rid in "ab":
        e.submit(rid, prompt(12), max_new_tokens=4, ignore_eos=True)
    outs = e.run()
    assert prefills(e) == [([0], [0]), ([0, 1], [8, 8])]  # a: [0,8), then a and b: [8,12)
    assert e.sched.server_info()["radix_cache"]["hit_tokens"] == 8
    assert e.tokens("a") == e.tokens("b") and outs["b"][-1].completion_tokens == 4
    e.assert_whole()


def test_output_pages_serve_the_next_turn() -> None:
    e = scripted_engine(mrr=1)
    e.submit("a", prompt(2), max_new_tokens=16, ignore_eos=True)  # positions 0..17 final
    turn1 = e.run()["a"]
    history = prompt(2) + [t for o in turn1 for t in o.new_ids.tolist()]
    e.worker.runner.log.clear()  # type: ignore[attr-defined]
    e.submit("b", history + [3, 3, 3], max_new_tokens=4, ignore_eos=True)
    e.run()
    # pages [0, 16) are cached (the block [16, 20) holds tokens past the output: not cached)
    assert prefills(e) == [([0], [16])]
    assert e.sched.server_info()["radix_cache"]["hit_tokens"] == 16
    e.assert_whole()


def test_only_whole_pages_are_cached_with_pages_of_two_blocks() -> None:
    e = scripted_engine(mrr=1, page_size=2 * K)
    e.submit("a", prompt(13), max_new_tokens=2, ignore_eos=True)  # pages [0, 8), [8, 16)
    e.run()
    assert e.sched.alloc.stats()["cached_pages"] == 1  # [8, 16) holds 3 + 2 known tokens
    e.worker.runner.log.clear()  # type: ignore[attr-defined]
    e.submit("b", prompt(13), max_new_tokens=2, ignore_eos=True)
    e.run()
    assert prefills(e) == [([0], [8])]  # block [8, 12): prefilled; the page was not shared
    e.assert_whole()


def test_eviction_comes_before_waiting() -> None:
    e = scripted_engine(mrr=2, pages=6)
    e.submit("a", prompt(16), max_new_tokens=4, ignore_eos=True)  # 5 pages, all final
    e.run()
    assert e.sched.alloc.stats()["free_pages"] == 1
    e.submit("b", prompt(16, base=4), max_new_tokens=4, ignore_eos=True)  # nothing shared
    e.step()
    assert [r.rid for r in e.sched.running.values()] == ["b"] and not e.sched.waiting
    outs = e.run()
    assert outs["b"][-1].completion_tokens == 4
    assert e.assert_whole()["cached_pages"] == 6
    m = e.sched.alloc.match(np.array(prompt(16)))
    assert m is not None and len(m.pages) == 1  # a's pages went from the leaf up


def test_a_locked_prefix_is_never_evicted_and_a_request_waits_for_the_rest() -> None:
    e = scripted_engine(mrr=3, pages=8, need=lambda s: 6)
    e.submit("a", prompt(16), max_new_tokens=8, ignore_eos=True)  # 6 pages
    e.step()
    e.submit("b", prompt(16), max_new_tokens=8, ignore_eos=True)  # shares 4, needs 2 more
    e.submit("c", prompt(8, base=7), max_new_tokens=4, ignore_eos=True)  # 3: must wait
    e.step()
    assert [r.rid for r in e.sched.running.values()] == ["a", "b"]
    assert [r.rid for r in e.sched.waiting] == ["c"]
    outs = e.run()
    assert outs["a"][-1].completion_tokens == outs["b"][-1].completion_tokens == 8
    assert outs["c"][-1].completion_tokens == 4
    e.assert_whole()


def test_flush_is_refused_while_requests_run_and_empties_the_cache_when_idle() -> None:
    e = scripted_engine(mrr=1, need=lambda s: 4)
    e.submit("a", prompt(9), max_new_tokens=8, ignore_eos=True)
    e.submit("b", prompt(9), max_new_tokens=8, ignore_eos=True)
    e.step()
    e.sched.handle(FlushCacheReq(5))
    refused = e.sched.take_outputs()[-1]
    assert isinstance(refused, FlushCacheResp) and refused.req_id == 5 and not refused.success
    assert "1 running, 1 waiting" in refused.message
    e.run()
    cached = e.sched.alloc.stats()["cached_pages"]
    assert cached > 0
    done = e.sched.flush_cache(6)
    assert done.success and done.freed_pages == cached
    s = e.assert_whole()
    assert s["cached_pages"] == 0 and s["free_pages"] == s["total_pages"]


def test_disabled_cache_shares_nothing() -> None:
    e = scripted_engine(mrr=1, radix_cache=False)
    for rid in "ab":
        e.submit(rid, prompt(9), max_new_tokens=3, ignore_eos=True)
    e.run()
    assert prefills(e) == [([0], [0]), ([0], [0])]
    info = e.sched.server_info()["radix_cache"]
    assert info == {"cached_pages": 0, "evictable_pages": 0, "hit_tokens": 0,
                    "miss_tokens": 18}
    assert e.assert_whole()["free_pages"] == 64


def test_a_stop_inside_a_block_keeps_that_page_out() -> None:
    e = scripted_engine(mrr=1, fill=14)  # 14 = EOS: the first generated token stops
    e.submit("a", prompt(8), max_new_tokens=8)
    e.run()
    assert e.sched.alloc.stats()["cached_pages"] == 2  # the prompt only
    e.assert_whole()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), fdfo=st.booleans(), wavefront=st.sampled_from([1, 2]),
       page_blocks=st.sampled_from([1, 2]))
def test_no_page_lost_or_leaked_under_aborts_preemption_and_eviction(
        seed: int, fdfo: bool, wavefront: int, page_blocks: int) -> None:
    """Random arrivals with shared prefixes into a small pool; random aborts, preemptions
    and resumptions at random times; the integrity check (references, locks, free +
    evictable + in use = total) runs after every step, and the pools end whole."""
    rng = random.Random(seed)
    e = scripted_engine(mrr=3, pages=24, fdfo=fdfo, wavefront=wavefront,
                        page_size=page_blocks * K, need=lambda s: 2 + (s // K) % 3)
    bases = [prompt(rng.randrange(4, 24), base=b) for b in (1, 2)]
    for i in range(40):
        base = rng.choice(bases)
        e.submit(f"r{i}", base[:rng.randrange(1, len(base) + 1)] + prompt(rng.randrange(0, 6)),
                 max_new_tokens=rng.randrange(0, 20), ignore_eos=rng.random() < 0.7)
        for _ in range(rng.randrange(0, 4)):
            e.step()
            e.sched.check_integrity()
        _poke(e, rng)
    for _ in range(3000):
        for req in list(e.sched.held.values()):
            e.sched.resume(req.rid)
        if not e.step():
            break
        e.sched.check_integrity()
    e.assert_whole()
    assert e.worker.batch.reqs == {}


def _poke(e: LocalEngine, rng: random.Random) -> None:
    """Abort, preempt or resume a random request."""
    running = [r.rid for r in e.sched.running.values()]
    held = [r.rid for r in e.sched.held.values()]
    waiting = [r.rid for r in e.sched.waiting]
    roll = rng.random()
    if roll < 0.15 and running + waiting:
        e.sched.abort(AbortReq(rng.choice(running + waiting)))
    elif roll < 0.3 and running:
        e.sched.preempt(rng.choice(running))
    elif roll < 0.4 and held:
        e.sched.resume(rng.choice(held))
    elif roll < 0.42:
        e.sched.abort(AbortReq(abort_all=True))


def test_match_never_passes_the_prompt() -> None:
    """A prompt that is exactly cached whole pages is not prefilled at all; its first block
    (all masks) starts right after it."""
    e = scripted_engine(mrr=1)
    e.submit("a", prompt(8), max_new_tokens=4, ignore_eos=True)
    e.run()
    e.worker.runner.log.clear()  # type: ignore[attr-defined]
    e.submit("b", prompt(8), max_new_tokens=4, ignore_eos=True)
    outs = e.run()
    assert prefills(e) == [] and outs["b"][-1].completion_tokens == 4
    req_pages = [x for x in e.sent if isinstance(x, AddPages)][-1]
    assert req_pages.first == 0 and np.array_equal(req_pages.pages[:2], [0, 1])


@pytest.mark.parametrize("max_new", [0, 1])
def test_prefill_only_requests_cache_their_prompt(max_new: int) -> None:
    e = scripted_engine(mrr=1)
    e.submit("a", prompt(9), max_new_tokens=max_new)
    e.run()
    assert e.sched.alloc.stats()["cached_pages"] == 2
    e.assert_whole()
