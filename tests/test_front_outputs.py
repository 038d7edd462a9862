"""The front's update of a request per committed block (`TokenizerManager._deliver`): each
update keeps the ids and text it saw, however many blocks come after it."""

from __future__ import annotations

import threading

import numpy as np

from dllm_serve.managers.detokenizer import IncrementalDetokenizer
from dllm_serve.managers.messages import ReqOutput
from dllm_serve.managers.tokenizer_manager import GenOutput, ReqState, TokenizerManager
from dllm_serve.sampling_params import SamplingParams


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_each_update_keeps_the_ids_and_text_it_saw() -> None:
    """An update's output_ids are copied only when read (a copy at every block made the
    front's cost quadratic in the output), yet read after later blocks have come they are
    still that update's: the first ids up to its block, as its text is."""
    front = object.__new__(TokenizerManager)
    front.states_lock = threading.Lock()
    seen: list[GenOutput] = []
    params = SamplingParams(max_new_tokens=100)
    front.states = {"r": ReqState(params, seen.append, IncrementalDetokenizer(letters, []))}
    blocks = [list(range(i, i + 32)) for i in range(0, 96, 32)] + [[96, 97]]
    for n, block in enumerate(blocks):
        last = n == len(blocks) - 1
        front._deliver(ReqOutput("r", np.asarray(block, dtype=np.int64), last,
                                 {"type": "length", "length": 98} if last else None))
    assert [len(u.output_ids) for u in seen] == [32, 64, 96, 98]
    for n, update in enumerate(seen):
        ids = sum(blocks[:n + 1], [])
        assert update.output_ids == ids and update.new_ids == blocks[n]
        assert update.text == letters(ids)
    assert "r" not in front.states
