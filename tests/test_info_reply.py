"""Info replies are matched to their request id: a late reply never reaches the next caller."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from dllm_serve.managers.messages import InfoReq, InfoResp
from dllm_serve.managers.tokenizer_manager import TokenizerManager


class LateScheduler:
    """Answers each InfoReq only when the next one arrives (so the first caller times out)."""

    def __init__(self, front: TokenizerManager) -> None:
        self.front = front
        self.pending: list[InfoReq] = []

    def send(self, msg: InfoReq) -> None:
        for old in self.pending:
            self.front._answer(InfoResp(old.req_id, {"answer_to": old.req_id}))
        self.pending = [msg]
        if msg.req_id >= 2:  # from the second request on, also answer at once
            self.front._answer(InfoResp(msg.req_id, {"answer_to": msg.req_id}))
            self.pending = []


def bare_front() -> TokenizerManager:
    front = object.__new__(TokenizerManager)
    front.dead = None
    front.ready_info = {}
    front.states_lock = threading.Lock()
    front.tx_lock = threading.Lock()
    front.info_waiters = {}
    import itertools

    front.info_ids = itertools.count(1)
    front.tx = LateScheduler(front)  # type: ignore[assignment]
    return front


def test_late_info_reply_is_dropped_not_served_to_the_next_caller() -> None:
    front = bare_front()
    with pytest.raises(queue.Empty):
        front.server_info(timeout=0.05)  # request 1: its reply comes late
    info: dict[str, Any] = front.server_info(timeout=1.0)  # request 2
    assert info == {"answer_to": 2}
    assert front.info_waiters == {}
