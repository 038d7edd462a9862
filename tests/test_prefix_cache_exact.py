"""Exactness of the radix prefix cache with the real tiny model (CPU, fp32, temperature 0): the
output is token-identical with the cache on and off, for both algorithms and both modes, with
shared prompt prefixes and a chat second turn that reuses the first turn's output blocks;
through the local engine (scheduler + worker in one process) and through `Engine`."""

from __future__ import annotations

from pathlib import Path

import pytest
from local_engine import LocalEngine, local_engine
from test_engine import assert_pools_whole, make_engine

SYSTEM = list(range(40, 40 + 70))  # a shared "system prompt": 2 whole blocks of 32 + 6


def turn_one() -> dict[str, list[int]]:
    return {"a": SYSTEM + [7, 8, 9], "b": SYSTEM + list(range(300, 340)), "c": SYSTEM[:50]}


def run_turns(engine: LocalEngine) -> dict[str, list[int]]:
    """Turn one (shared prefixes), then turn two: more prompts on the same prefix and a chat
    second turn whose prompt is turn one's prompt + reply + a new question."""
    for rid, ids in turn_one().items():
        engine.submit(rid, ids, max_new_tokens=40, ignore_eos=True)
    engine.run()
    chat = turn_one()["a"] + engine.tokens("a") + [11, 12, 13, 14, 15]
    engine.submit("chat", chat, max_new_tokens=40, ignore_eos=True)
    engine.submit("d", SYSTEM + [21] * 30, max_new_tokens=24, ignore_eos=True)
    engine.submit("e", turn_one()["b"], max_new_tokens=24, ignore_eos=True)
    engine.run()
    return {rid: engine.tokens(rid) for rid in engine.outputs}


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
@pytest.mark.parametrize("fdfo", [True, False])
@pytest.mark.parametrize("wavefront", [1, 2])
def test_cache_on_and_off_give_the_same_tokens(tiny_model_dir: Path, algorithm: str,
                                               fdfo: bool, wavefront: int) -> None:
    on = local_engine(tiny_model_dir, algorithm, fdfo, wavefront=wavefront, mrr=3)
    off = local_engine(tiny_model_dir, algorithm, fdfo, wavefront=wavefront, mrr=3,
                       radix_cache=False)
    got, want = run_turns(on), run_turns(off)
    assert got == want
    cache = on.sched.server_info()["radix_cache"]
    # turn one (prefill forwards of one block): b and c share the block of a's that was sent
    # before they were admitted (32 each); turn two: chat takes a's prompt blocks and first
    # output block (96), d the shared prefix's 2 blocks, e all 3 blocks of b's prompt
    assert cache["hit_tokens"] == 32 + 32 + 96 + 64 + 96, cache
    assert off.sched.server_info()["radix_cache"]["hit_tokens"] == 0
    on.assert_whole()
    off.assert_whole()


def test_chat_turn_reuses_the_first_turns_blocks_with_pages_of_two_blocks(
        tiny_model_dir: Path) -> None:
    on = local_engine(tiny_model_dir, "JointThreshold", True, page_size=64, mrr=3)
    off = local_engine(tiny_model_dir, "JointThreshold", True, page_size=64, mrr=3,
                       radix_cache=False)
    assert run_turns(on) == run_turns(off)
    assert on.sched.server_info()["radix_cache"]["hit_tokens"] >= 64 * 3
    on.assert_whole()


def test_engine_outputs_match_with_and_without_the_cache(tiny_model_dir: Path) -> None:
    """Through the real processes: the same batch twice (the second run hits the cache),
    a chat second turn, then a flush; the same tokens as an engine with the cache off."""
    prompts = ["The same long system prompt, word for word, before every question. " * 3 + q
               for q in ("What is 2 + 3?", "Name a colour.", "Count to five.")]
    params = {"max_new_tokens": 48, "ignore_eos": True}
    results = {}
    for disabled in (False, True):
        with make_engine(tiny_model_dir, disable_radix_cache=disabled,
                         dllm_algorithm="JointThreshold") as engine:
            first = engine.generate(prompts, params)
            again = engine.generate(prompts, params)
            chat = engine.generate(prompts[0] + first[0]["text"] + " And 3 + 4?", params)
            info = engine.get_server_info()
            assert_pools_whole(engine)
            flushed = engine.flush_cache()
            assert flushed["success"] and info["radix_cache"]["cached_pages"] == (
                flushed["freed_pages"])
            after = engine.get_server_info()
            assert after["kv_pool"]["free_pages"] == after["kv_pool"]["total_pages"]
            results[disabled] = ([o["output_ids"] for o in first + again] + [chat["output_ids"]],
                                 info["radix_cache"])
    (on, on_cache), (off, off_cache) = results[False], results[True]
    assert on == off
    assert on[:3] == on[3:6]
    assert on_cache["hit_tokens"] > 0 and off_cache["hit_tokens"] == 0
    assert off_cache["cached_pages"] == 0
