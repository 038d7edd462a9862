"""`PublishRing`: each publish (eager, or a replay of a captured graph) writes the next pinned
slot, and the host's takes follow it slot for slot; the worker's readouts through the denoise
graphs stay intact while forwards are queued behind them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.round_roofline import graphed
from dllm_serve.kernels.host_copy import PublishRing

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
WIDTH = 37


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_publishes_fill_the_slots_in_turn(rows: int) -> None:
    """Eleven publishes into four slots: each take sees its own publish (rows beyond n keep
    what an earlier publish left), the cursor counts them, reset starts over at slot 0."""
    ring = PublishRing(rows, WIDTH, DEVICE, slots=4)
    src = torch.zeros(rows, WIDTH, dtype=torch.int64, device=DEVICE)
    for i in range(11):
        n = 1 + i % rows
        src.fill_(i)
        src[:n, 0] = torch.arange(n, device=DEVICE) + 1000 * i
        ring.publish(src[:n])
        view = ring.take(n)
        sync()
        want = torch.full((n, WIDTH), i, dtype=torch.int64)
        want[:, 0] = torch.arange(n) + 1000 * i
        assert np.array_equal(view, want.numpy()), i
        assert view.ctypes.data == ring.host[i % 4].data_ptr()
    assert int(ring.cursor.item()) == 11
    ring.reset()
    assert int(ring.cursor.item()) == 0 and ring.take(1).ctypes.data == ring.host[0].data_ptr()


def test_refuses_rows_it_cannot_hold() -> None:
    ring = PublishRing(4, WIDTH, DEVICE, slots=2)
    with pytest.raises(AssertionError):
        ring.publish(torch.zeros(5, WIDTH, dtype=torch.int64, device=DEVICE))
    with pytest.raises(AssertionError):
        ring.publish(torch.zeros(2, WIDTH + 1, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
def test_each_replay_of_one_graph_writes_the_next_slot_behind_queued_work() -> None:
    """The denoise graphs' pattern: one captured graph (compute the readout, publish it)
    replayed many times while long kernels keep the replays queued; each replay's slot holds
    that replay's readout when its event completes, slots < in flight never overwritten."""
    dev = torch.device("cuda")
    ring = PublishRing(48, WIDTH, dev, slots=3)
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    readout = torch.zeros(48, WIDTH, dtype=torch.int64, device=dev)

    def body() -> None:
        counter.add_(1)
        readout.copy_(counter.expand(48, WIDTH))
        ring.publish(readout)

    replay = graphed(body, dev)
    ring.reset()
    counter.zero_()
    big = torch.randn(4096, 4096, device=dev)
    pending = []
    for i in range(1, 201):
        big = big @ big
        big /= big.norm()
        replay()
        event = torch.cuda.Event()
        event.record()
        pending.append((i, ring.take(48), event))
        if len(pending) == 2:  # fewer unread than slots
            j, view, ev = pending.pop(0)
            ev.synchronize()
            assert bool((view == j).all()), j
    for j, view, ev in pending:
        ev.synchronize()
        assert bool((view == j).all()), j


def message(count: int, width: int, first: int) -> np.ndarray:
    return np.concatenate([[count], first + np.arange(count * width)]).astype(np.int64)


def test_a_fetch_takes_its_own_message_only() -> None:
    """Each fetch takes the message posted for it (count, then its records) or none (count
    0): a fetch queued before a post but run after it (a forward still waiting on the device)
    does not take the message meant for the next one."""
    from dllm_serve.kernels.host_copy import StageRing

    width = 3
    ring = StageRing(1 + 4 * width, width, DEVICE, slots=4)
    dst = torch.full((1 + 4 * width,), -7, dtype=torch.int64, device=DEVICE)
    ring.post(message(2, width, 100))
    ring.fetch(dst)
    sync()
    assert dst[:7].tolist() == message(2, width, 100).tolist()
    ring.fetch(dst)  # nothing posted for it
    sync()
    assert int(dst[0]) == 0
    ring.replayed()  # a replay queued, not yet run on the device
    ring.post(message(1, width, 500))  # meant for the fetch after it
    from dllm_serve.kernels.host_copy import _fetch_kernel

    _fetch_kernel[(1,)](ring.host, ring.cursor, dst, 1 + ring.elems, WIDTH=width,
                        SLOTS=ring.slots, BLOCK=1024)  # the queued replay runs now
    sync()
    assert int(dst[0]) == 0, "the earlier forward took a later forward's message"
    ring.fetch(dst)
    sync()
    assert dst[:4].tolist() == message(1, width, 500).tolist()
    assert int(ring.cursor.item()) == ring.queued == 4


def test_messages_wrap_around_the_slots() -> None:
    from dllm_serve.kernels.host_copy import StageRing

    width = 2
    ring = StageRing(1 + 3 * width, width, DEVICE, slots=3)
    dst = torch.zeros(1 + 3 * width, dtype=torch.int64, device=DEVICE)
    for i in range(20):
        if i % 4 != 3:
            ring.post(message(1 + i % 3, width, 10 * i))
        ring.fetch(dst)
        sync()
        want = message(1 + i % 3, width, 10 * i) if i % 4 != 3 else [0]
        assert dst[:len(want)].tolist() == list(want), i
    assert len(ring.unfenced) == 1  # only the last post's fetch can still be pending
    with pytest.raises(AssertionError, match="one message per fetch"):
        ring.post(message(1, width, 0))
        ring.post(message(1, width, 0))


class FakeEvent:
    """A CUDA event's calls, logged (the fence bookkeeping, tested on any machine)."""

    def __init__(self, log: list[tuple[str, int]], slot: int) -> None:
        self.log, self.slot = log, slot

    def record(self, stream: object) -> None:
        self.log.append(("record", self.slot))

    def synchronize(self) -> None:
        self.log.append(("wait", self.slot))


def test_a_slot_is_rewritten_after_its_fetch_ran_without_a_device_call_when_known() -> None:
    """Each slot's fence is recorded once the fetch of its message is queued (at the next
    post) and waited on before the slot is written again, unless `ran` says that fetch has
    run; no event is made per message (each slot keeps its own)."""
    from dllm_serve.kernels.host_copy import StageRing

    width, slots = 2, 3
    ring = StageRing(1 + 2 * width, width, torch.device("cpu"), slots=slots)
    log: list[tuple[str, int]] = []
    ring.cuda, ring.fences = True, [FakeEvent(log, i) for i in range(slots)]
    fences = list(ring.fences)
    for i in range(slots):  # messages for fetches 0, 1, 2
        ring.post(message(1, width, i))
        ring.replayed()  # a fetch queued (a graph's)
    assert log == [("record", 0), ("record", 1)]  # fetch 2's fence: at the next post
    log.clear()
    ring.ran(1)  # fetch 0 has run: slot 0 is free without waiting
    ring.post(message(1, width, 3))
    assert log == [("record", 2)]
    ring.replayed()
    log.clear()
    ring.post(message(1, width, 4))  # slot 1: fetch 1 not known to have run
    assert log == [("record", 0), ("wait", 1)]
    ring.replayed()
    log.clear()
    ring.ran(5)  # every fetch so far has run
    ring.post(message(1, width, 5))
    assert log == [("record", 1)]
    assert ring.fences == fences and ring.queued == 5


@pytest.mark.gpu
def test_replays_take_the_messages_posted_for_them_behind_queued_work() -> None:
    """The forward graphs' pattern: a captured graph that fetches and logs what it got,
    replayed 300 times behind long kernels while the host posts a message before some of the
    replays (the earlier replays still waiting): each replay logs its own message or none."""
    from dllm_serve.kernels.host_copy import StageRing

    dev, width, n = torch.device("cuda"), 4, 300
    ring = StageRing(1 + 2 * width, width, dev, slots=8)
    dst = torch.zeros(1 + 2 * width, dtype=torch.int64, device=dev)
    log = torch.full((n, 2), -1, dtype=torch.int64, device=dev)
    at = torch.zeros(1, dtype=torch.int64, device=dev)

    def body() -> None:
        ring.fetch(dst)
        got = torch.where(dst[:1] > 0, dst[1:2], torch.zeros_like(dst[:1]))
        log.index_copy_(0, at, torch.cat([dst[:1], got]).view(1, 2))
        at.add_(1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # the eager run counts itself
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    at.zero_()
    log.fill_(-1)
    big = torch.randn(2048, 2048, device=dev)
    want = []
    for i in range(n):
        if i % 10 == 0:
            big = big @ big
            big /= big.norm()
        if i % 3 == 0:
            ring.post(message(1 + i % 2, width, 1000 + i))
            want.append([1 + i % 2, 1000 + i])
        else:
            want.append([0, 0])
        graph.replay()
        ring.replayed()
    torch.cuda.synchronize()
    assert log.tolist() == want


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
def test_row_storage_sends_its_staged_rows_through_the_ring(algorithm: str) -> None:
    """RowStorage's flush posts its inbox to the StageRing and apply_staged fetches it first
    (on CUDA its own ring; on the CPU one attached here, its kernel interpreted): each write
    lands at the apply after its flush, an apply with nothing posted changes nothing, and the
    host's fetch count equals the device's."""
    from dllm_serve.dllm.algorithms import build_algorithm
    from dllm_serve.dllm.config import DllmConfig
    from dllm_serve.kernels.host_copy import StageRing
    from dllm_serve.managers.row_storage import RowStorage

    mask = 15
    s = RowStorage(build_algorithm(DllmConfig(algorithm=algorithm, block_size=4, mask_id=mask)),
                   8, 4, DEVICE, free_key=8)
    if s.ring is None:
        s.ring = StageRing(len(s.staged), s.width, DEVICE)
    for step, (rows, first) in enumerate((([5, 2], 1), ([0, 7, 3], 20), ([2], 40))):
        ids = first + np.arange(len(rows) * 4, dtype=np.int64).reshape(len(rows), 4)
        s.write_rows(np.array(rows), ids, [None] * len(rows), np.full(len(rows), 32 * step),
                     np.arange(len(rows)), np.zeros(len(rows), dtype=np.int64))
        s.flush()
        s.apply_staged()
        sync()
        assert s.ids[rows].cpu().tolist() == ids.tolist()
        assert s.row_start[rows].cpu().tolist() == [32 * step] * len(rows)
        before = s.ids.clone()
        s.sent = True  # as after a replay that took the message: an apply finds nothing new
        s.apply_staged()
        sync()
        assert torch.equal(s.ids, before)
    assert int(s.ring.cursor.item()) == s.ring.queued
