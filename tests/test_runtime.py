"""The runtime's guarantees that span processes: the wire protocol round-trips, and a busy
scheduler still answers info requests at once (it never blocks on the worker)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from http_helpers import pools_whole, start_server
from local_engine import local_engine

from dllm_serve.managers import messages as m
from dllm_serve.sampling_params import SamplingParams

IDS = np.arange(6, dtype=np.int64)
SETTINGS = m.ReqSettings(prompt_len=5, max_end=64, temperature=0.5, top_p=0.9, seed=3,
                         params={"threshold": 0.8}, stop_ids=np.array([2, 9]))
RETIRED = m.Retired(np.array([4]), np.array([32]), np.arange(32).reshape(1, 32),
                    np.array([3]), np.array([1]), np.array([7]))
EXAMPLES: list[object] = [
    m.GenerateReq("r", IDS, SamplingParams(max_new_tokens=4, stop=["x"]), 1.5),
    m.AbortReq("r"), m.AbortReq(abort_all=True, message="bye"), m.InfoReq(7),
    m.FlushCacheReq(8), m.FlushCacheResp(8, False, "busy", 0),
    m.ReqOutput("r", IDS, True, {"type": "length", "length": 4}, 5, 4, 6, 5, 1, [3], [0]),
    m.BatchOutput([m.ReqOutput("r", IDS), m.ReqOutput("s", np.zeros(0, np.int64), True, {
        "type": "abort", "message": "gone", "status_code": 499})]),
    m.BatchOutput([m.ReqOutput("t", IDS[:2], True, {"type": "stop", "matched": 2}, 5, 2, 3, 2,
                               1, [2], [0]), m.ReqOutput("u", IDS, False)]),  # packed ids, in order
    m.BatchOutput([]),
    m.InfoResp(7, {"a": 1}), m.Ready({"b": 2}),
    m.Fatal("boom"), SETTINGS, m.AddPages(3, 2, np.array([9, 4])),
    m.Prefill([0, 1], [0, 32], [IDS, IDS]),
    m.Admit(4, 3, 32, np.zeros((2, 32), np.int64), [None, {"finished": np.array(True)}],
            [0, 2], SETTINGS),
    m.Release(4), m.Preempt(4),
    m.WorkerBatch([m.Release(1), m.AddPages(0, 0, np.array([1]))]),
    m.WorkerBatch([  # packed: every kind of item, in order
        m.AddPages(3, 0, np.array([9, 4])), m.Prefill([3], [0], [IDS]),
        m.Admit(4, 3, 32, np.arange(64).reshape(2, 32), [None, {"age": np.array(2)}], [0, 2],
                SETTINGS),
        m.AddPages(5, 2, np.zeros(0, np.int64)), m.Release(2), m.Preempt(4),
        m.Admit(6, 5, 0, np.ones((1, 32), np.int64), [None], [0], m.ReqSettings(3, 32))]),
    m.WorkerBatch([  # stop sets: none (its empty array's offset is the next block's), one
        # array shared by two admissions (packed once), another
        m.Admit(1, 0, 0, np.ones((1, 32), np.int64), [None], [0],
                m.ReqSettings(3, 32, stop_ids=np.zeros(0, np.int64))),
        *[m.Admit(uid, uid, 0, np.full((1, 32), uid), [None], [0], m.ReqSettings(
            3, 64, stop_ids=SETTINGS.stop_ids)) for uid in (2, 3)],
        m.Admit(4, 4, 32, np.zeros((1, 32), np.int64), [None], [1],
                m.ReqSettings(5, 64, stop_ids=np.array([7])))]),
    m.WorkerBatch([]), m.Shutdown(),
    m.WorkerReady(100, 32, {"x": 1}), RETIRED,
    m.Preempted(4, 32, np.zeros((1, 32), np.int64), [{"age": np.array(2)}], [2], 9),
    m.Failed(4, "non-finite logits"),
    m.WorkerReport(RETIRED, [], [m.Failed(1, "x")], 3, 1, 2, 40, 5), m.WorkerFailed("tb"),
    m.Retired(*[np.zeros(0, np.int64)] * 2, np.zeros((0, 32), np.int64),
              *[np.zeros(0, np.int64)] * 3),  # packed as one table: none retired
]


def same(a: object, b: object) -> bool:
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)  # type: ignore[union-attr]
    return a == b


def test_every_wire_message_round_trips() -> None:
    assert {type(x) for x in EXAMPLES} == set(m.MESSAGE_TYPES)
    for msg in EXAMPLES:
        assert same(m.decode(m.encode(msg)), msg), msg


def test_decoded_arrays_are_writable() -> None:
    """Arrays sent as raw bytes come back as arrays of their own (torch.from_numpy warns on a
    read-only one, e.g. when the worker copies a page list into the CPU page table)."""
    admit, pages = (m.decode(m.encode(next(x for x in EXAMPLES if isinstance(x, kind))))
                    for kind in (m.Admit, m.AddPages))
    batch = m.decode(m.encode(m.WorkerBatch([m.AddPages(0, 0, np.array([1, 2])), m.Admit(
        1, 0, 0, np.zeros((1, 32), np.int64), [None], [0], SETTINGS)])))
    packed_pages, packed_admit = batch.items
    for a in (admit.blocks, admit.settings.stop_ids, pages.pages, packed_pages.pages,
              packed_admit.blocks, packed_admit.settings.stop_ids):
        assert a.flags.writeable


def test_codec_refuses_what_is_not_a_message() -> None:
    with pytest.raises(TypeError):
        m.encode({"not": "a message"})
    import pickle

    with pytest.raises(TypeError):
        m.decode(pickle.dumps([1, 2]))


def test_busy_server_answers_info_and_metrics_at_once(tiny_model_dir: Path) -> None:
    """16 requests in long sync rounds: /get_server_info and /metrics still answer in < 0.5 s
    each, and their counters move between calls (the scheduler never waits for a round)."""
    server = start_server(tiny_model_dir, "--no-dllm-fdfo", "--max-running-requests", "16",
                          "--dllm-wavefront-size", "1")
    try:
        body = {"prompt": "busy", "max_tokens": 200, "ignore_eos": True}
        threads = [threading.Thread(target=server.post, args=("/v1/completions", body))
                   for _ in range(16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while server.get("/get_server_info").json()["num_running_reqs"] < 16:
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.05)
        forwards, timings = [], []
        for _ in range(5):
            for path in ("/get_server_info", "/metrics"):
                t0 = time.monotonic()
                r = server.get(path)
                timings.append((path, time.monotonic() - t0))
                assert r.status_code == 200
                if path == "/get_server_info":
                    forwards.append(r.json()["stats"]["forwards"])
            time.sleep(0.3)
        assert max(t for _, t in timings) < 0.5, timings
        assert forwards == sorted(forwards) and forwards[-1] > forwards[0], forwards
        for t in threads:
            t.join(120)
        pools_whole(server)
    finally:
        server.stop()


@pytest.mark.parametrize("fdfo", [True, False])
def test_per_request_thresholds_reach_their_rows(tiny_model_dir: Path, fdfo: bool) -> None:
    """Requests with different dllm_threshold share the device batch; each row steps with its
    own request's value (RowStorage.write_params when it joins the layout): threshold 0
    unmasks a whole block in one step, threshold 1 one position a step (the top-1 fallback)."""
    e = local_engine(tiny_model_dir, "LowConfidence", fdfo=fdfo, mrr=4)
    for i, threshold in enumerate([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]):  # 6 > 4: joins and leaves
        e.submit(f"r{i}", list(range(5, 12 + i)), max_new_tokens=64, ignore_eos=True,
                 dllm={"threshold": threshold})
    outs = e.run()
    k = e.worker.k
    for i in range(6):
        forwards = outs[f"r{i}"][-1].block_forwards
        assert len(forwards) >= 2, forwards
        if i % 2:  # every block done in one step, then its final forward
            assert max(forwards) <= 2, (i, forwards)
        else:  # a block of k masks takes k steps (its first may keep part of the prompt)
            assert max(forwards) >= k, (i, forwards)
    e.assert_whole()
