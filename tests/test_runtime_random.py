"""Randomized workloads against the scheduler + worker (hypothesis): admissions, aborts,
preemptions and resumptions, and finishes in random order, checked after every step against
the pool invariants; at batch size 1 with the real tiny model, every request that completes
decodes exactly what a plain sync run decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from local_engine import LocalEngine, local_engine, scripted_engine

from dllm_serve.managers.batch_layout import COLUMN_FIELDS, Block, Columns, DeviceReq, Layout
from dllm_serve.managers.messages import AbortReq, AddPages, ReqSettings
from dllm_serve.managers.pacing import Pacing

K = 4

OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 13), st.integers(0, 14), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("abort_all")),
    st.tuples(st.just("preempt"), st.integers(0, 20)),
    st.tuples(st.just("resume"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.integers(1, 4)),
), min_size=1, max_size=40)


def apply(e: LocalEngine, op: tuple, submitted: list[str]) -> None:
    kind = op[0]
    if kind == "submit":
        rid = f"r{len(submitted)}"
        submitted.append(rid)
        e.submit(rid, list(range(1, op[1] + 1)), max_new_tokens=op[2], ignore_eos=op[3])
    elif kind in ("abort", "preempt", "resume") and submitted:
        rid = submitted[op[1] % len(submitted)]
        if kind == "abort":
            e.sched.abort(AbortReq(rid))
        else:
            getattr(e.sched, kind)(rid)
    elif kind == "abort_all":
        e.sched.abort(AbortReq(abort_all=True))
    elif kind == "step":
        for _ in range(op[1]):
            e.step()
            check(e)


def check(e: LocalEngine) -> None:
    """Pools whole (every page and slot owned once); the worker never holds more rows than its
    storage, and only requests the scheduler admitted; its count of gated blocks is exact."""
    e.sched.check_integrity()
    assert e.worker.batch.num_rows <= e.worker.storage.capacity
    live = {uid for uid in e.sched.running} | {x.uid for x in e.sched.to_worker
                                                if hasattr(x, "uid")}
    assert set(e.worker.batch.reqs) <= live | released(e)
    batch = e.worker.batch  # its count of gated blocks (the step skips the gates at 0)
    assert batch.gated == sum(b.gate != 0 for r in batch.reqs.values() for b in r.blocks)
    if e.worker.batch.num_rows:
        check_layout(e.worker.batch.layout())
    check_rows(e)


def check_rows(e: LocalEngine) -> None:
    """Once the launched layout's staged writes are applied, each row's metadata on the
    device is its block's (request key, start; a hole's: the free key, 0) and the rows past
    the layout hold no request."""
    w = e.worker
    layout, storage = w.batch.current, w.storage
    if layout is None or w.prepared is not layout or storage.pending or storage.sent:
        return
    n = len(layout.rows)
    assert storage.row_req[:n].tolist() == [r.slot for r in layout.reqs]
    assert storage.row_start[:n].tolist() == [b.start for b in layout.rows]
    assert (storage.row_req[n:] == storage.free_key).all()


def check_layout(layout: Layout) -> None:
    """The incrementally patched per-row columns equal columns made afresh from the layout's
    rows; holes, row owners and rows agree: every active block of a request in the layout has
    exactly one row, and that row knows it."""
    fresh = Columns.of(layout.reqs, layout.rows)
    for name in COLUMN_FIELDS:
        assert getattr(layout.cols, name) == getattr(fresh, name), name
    assert layout.holes == [i for i, r in enumerate(layout.reqs) if r.hole]
    assert all(b.row == x for x, b in enumerate(layout.rows) if b.alive)
    owners = {id(r): r for r in layout.reqs if not r.hole}
    assert all(b in r.blocks for r, b in zip(layout.reqs, layout.rows, strict=True)
               if not r.hole)
    placed = [b for b in layout.rows if b.alive]
    assert sorted(map(id, placed)) == sorted(id(b) for r in owners.values() for b in r.blocks)
    assert layout.batch.num_blocks == [1] * len(layout.rows) == [1] * len(layout.cols.slots)


def released(e: LocalEngine) -> set[int]:
    """uids the scheduler has released whose Release the worker has not yet seen."""
    return {x.uid for x in e.sent if type(x).__name__ == "Release"}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, fdfo=st.booleans(), wavefront=st.sampled_from([1, 2]),
       needs=st.lists(st.integers(2, 6), min_size=8, max_size=8), depth=st.sampled_from([1, 2]),
       mrr=st.sampled_from([3, 8]), multi_step=st.sampled_from([1, 2]), overlap=st.booleans(),
       gated=st.booleans())
def test_random_workload_keeps_pools_whole(ops: list[tuple], fdfo: bool, wavefront: int,
                                           needs: list[int], depth: int, mrr: int,
                                           multi_step: int, overlap: bool, gated: bool) -> None:
    """depth: forwards the worker keeps queued (2: what a host-bound GPU worker runs); mrr 8:
    enough rows that requests leaving leave holes in the device batch for others to take;
    multi_step: forwards launched per pass over one layout (2: a host-bound GPU worker's);
    overlap: the launch before the scheduler's changes (what a CUDA worker does); gated: the
    device opens a request's next block (W = 2: gated spawning, W = 1: standby)."""
    e = scripted_engine(fdfo=fdfo, mrr=mrr, pages=8 * mrr, wavefront=wavefront, depth=depth,
                        need=lambda start: needs[(start // K) % len(needs)],
                        multi_step=multi_step, gated=gated, standby=gated)
    e.worker.pacing.overlap = overlap
    submitted: list[str] = []
    for op in ops:
        apply(e, op, submitted)
    for _ in range(3000):  # whatever is held goes back (once its preemption came back)
        for req in list(e.sched.held.values()):
            e.sched.resume(req.rid)
        if not e.step():
            break
        check(e)
    assert e.sched.idle and e.worker.idle and e.worker.batch.reqs == {}
    e.assert_whole()
    for rid in submitted:
        outs = e.outputs.get(rid, [])
        assert outs and outs[-1].finished and sum(o.finished for o in outs) == 1, rid
        last = outs[-1]
        if last.finish_reason["type"] == "length":
            assert last.completion_tokens == last.finish_reason["length"]


@pytest.fixture(scope="module")
def sync_reference(tiny_model_dir: Path) -> dict[tuple[int, int], list[int]]:
    """Plain sync decoding at bs=1 of every prompt the bs=1 test may use."""
    e = local_engine(tiny_model_dir, "JointThreshold", fdfo=False, mrr=1)
    ref = {}
    for n in (3, 9, 33, 40):
        e.submit(f"p{n}", list(range(5, 5 + n)), max_new_tokens=70, ignore_eos=True)
        e.run()
        ref[(n, 70)] = e.tokens(f"p{n}")
    return ref


@settings(max_examples=8, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(script=st.lists(st.tuples(st.sampled_from([3, 9, 33, 40]), st.integers(0, 30),
                                 st.sampled_from(["none", "preempt", "abort"])),
                       min_size=1, max_size=3), depth=st.sampled_from([1, 2]))
def test_bs1_with_preemptions_matches_sync(tiny_model_dir: Path, script: list[tuple],
                                           sync_reference: dict, depth: int) -> None:
    """FDFO at bs=1: a request preempted mid-block (its blocks and algorithm state taken off
    the device and sent back) still decodes exactly the sync tokens; aborted ones free all;
    with two forwards queued too (a converged block's extra forward changes nothing)."""
    e = local_engine(tiny_model_dir, "JointThreshold", fdfo=True, mrr=1, depth=depth)
    for i, (n, when, event) in enumerate(script):
        rid = f"q{i}"
        e.submit(rid, list(range(5, 5 + n)), max_new_tokens=70, ignore_eos=True)
        for _ in range(when):
            e.step()
        if event == "preempt" and e.sched.preempt(rid):
            e.step()
            e.step()
            e.sched.resume(rid)
        elif event == "abort":
            e.sched.abort(AbortReq(rid))
        e.run()
        last = e.outputs[rid][-1]
        if last.finish_reason["type"] == "length":
            assert e.tokens(rid) == sync_reference[(n, 70)], (rid, n, when, event)
        else:
            assert event == "abort"
        e.assert_whole()


def bs1_run(model_dir: Path, algorithm: str, depth: int, multi_step: int,
            overlap: bool = False) -> tuple:
    """One 100-token FDFO request at bs=1: (tokens, finish reason, each block's reported
    forwards, the forwards its blocks took part in); then the pools are whole. overlap: the
    worker launches before it applies the scheduler's changes, as on CUDA."""
    e = local_engine(model_dir, algorithm, fdfo=True, mrr=1, depth=depth, multi_step=multi_step)
    e.worker.pacing.overlap = overlap
    e.submit("r", list(range(5, 25)), max_new_tokens=100, ignore_eos=True)
    e.run()
    final = e.outputs["r"][-1]
    e.assert_whole()
    return (e.tokens("r"), final.finish_reason, final.block_forwards,
            e.sched.stats["request_steps"])


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
def test_two_forwards_ahead_decodes_the_same_tokens(tiny_model_dir: Path, algorithm: str) -> None:
    """The worker's deeper pipeline (two forwards queued, as on a host-bound GPU) at bs=1:
    every block takes one extra, no-op forward after it converged, and the tokens and the
    reported forward counts are those of one forward ahead; then the pools are whole."""
    one, two = (bs1_run(tiny_model_dir, algorithm, depth, 1) for depth in (1, 2))
    assert two[:3] == one[:3] and len(one[0]) == 100
    assert two[3] > one[3]  # the extra forwards were run (and counted as such)


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
def test_launch_before_the_changes_decodes_the_same_tokens(tiny_model_dir: Path,
                                                           algorithm: str) -> None:
    """The CUDA worker's order (launch, then the scheduler's changes) at bs=1: the same tokens,
    finish, per-block forward counts and forwards as changes-first; then the pools are
    whole."""
    first, later = (bs1_run(tiny_model_dir, algorithm, 1, 1, overlap) for overlap in (False, True))
    assert later == first and len(first[0]) == 100


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
@pytest.mark.parametrize("depth", [1, 2])
def test_two_forwards_a_pass_decode_the_same_tokens(tiny_model_dir: Path, algorithm: str,
                                                    depth: int) -> None:
    """Multi-step (two forwards launched over one layout per pass) at bs=1: the tokens, the
    finish and each block's reported forward count are those of one forward a pass; a block
    that converged inside a pass took at most one more, no-op forward; the pools are whole."""
    one, two = (bs1_run(tiny_model_dir, algorithm, depth, steps) for steps in (1, 2))
    assert two[:3] == one[:3] and len(one[0]) == 100
    # each block takes at most one more (no-op) forward: one converged inside a pass
    assert one[3] <= two[3] <= one[3] + len(one[2])


@pytest.mark.parametrize("fdfo", [False, True])
def test_two_forwards_a_pass_keep_the_batch_full(fdfo: bool) -> None:
    """A queue of requests at 2 running, two forwards a pass: every request decodes the
    tokens of one forward a pass, and the forwards grow by at most one a block (a block that
    converged inside a pass waits for its end). Sync lets the waiting requests in at every
    batch boundary although a pass collects two readouts (the boundary found by the first
    stays until the requests have joined)."""
    out, forwards = {}, {}
    for steps in (1, 2):
        e = scripted_engine(fdfo=fdfo, mrr=2, pages=128, multi_step=steps,
                            need=lambda start: 2 + (start // K) % 3)
        for i in range(8):  # of different lengths: a request finishes while another goes on
            e.submit(f"q{i}", [1, 2, 3], max_new_tokens=K * (2 + i % 3), ignore_eos=True)
        e.run()
        e.assert_whole()
        out[steps] = {f"q{i}": e.tokens(f"q{i}") for i in range(8)}
        forwards[steps] = sum(r.forwards for r in e.reports)
    blocks = sum(2 + i % 3 for i in range(8))
    assert out[2] == out[1]
    assert forwards[1] <= forwards[2] <= forwards[1] + blocks


def test_sync_boundary_stays_until_the_waiting_requests_join() -> None:
    """Sync, two forwards a pass (a pass collects two readouts): whenever an advance of a pass
    found the batch boundary, the requests waiting at the worker have joined by the pass's end
    (a later readout of the same pass, which finds the next blocks not done, must not take the
    boundary back)."""
    e = scripted_engine(fdfo=False, mrr=2, pages=128, multi_step=2,
                        need=lambda start: 2 + (start // K) % 3)
    for i in range(8):
        e.submit(f"q{i}", [1, 2, 3], max_new_tokens=K * (2 + i % 3), ignore_eos=True)
    w, flow = e.worker, e.worker.flow
    found: list[bool] = []  # the boundary after each advance of the current pass
    boundaries, waited = 0, 0
    advance, iterate = flow.advance, w.iterate

    def recording_advance() -> None:
        advance()
        found.append(flow.boundary)

    def checked_iterate(items: list) -> object:
        nonlocal boundaries, waited
        found.clear()
        report = iterate(items)
        if any(found):
            boundaries += 1
            waited += bool(flow.waiting)
        return report

    flow.advance = recording_advance  # type: ignore[method-assign]
    w.iterate = checked_iterate  # type: ignore[method-assign]
    e.run()
    e.assert_whole()
    assert boundaries > 8 and waited == 0


@pytest.mark.parametrize("knob", ["depth", "multi_step"])
def test_pacing_follows_the_hosts_wait(knob: str) -> None:
    """A knob on auto (CUDA: the pipeline depth, the forwards per pass): two once the host
    stops waiting for readouts (it is the bottleneck), back to one once it waits a millisecond
    and more on average; the other knob stays what was asked. On the CPU auto stays one."""
    p = Pacing(None, 1, cuda=True) if knob == "depth" else Pacing(1, None, cuda=True)
    p.retired([26] * 100)  # long blocks: depth 2 pays (see the next test)
    other = "multi_step" if knob == "depth" else "depth"
    assert (getattr(p, knob), p.most_in_flight) == (1, 3)
    for _ in range(30):
        p.observe(0.0)
    assert (getattr(p, knob), getattr(p, other)) == (2, 1)
    for _ in range(3):
        p.observe(0.0005)
    assert getattr(p, knob) == 2  # hysteresis: a few half-millisecond waits do not switch back
    for _ in range(30):
        p.observe(0.005)
    assert getattr(p, knob) == 1
    cpu = Pacing(None, None, cuda=False)
    for _ in range(30):
        cpu.observe(0.0)
    assert (cpu.depth, cpu.multi_step, cpu.most_in_flight) == (1, 1, 2)


def test_auto_depth_goes_deep_before_multi_step() -> None:
    """With long blocks, depth goes to 2 once the host's wait for a readout stays under a
    quarter millisecond (bursts of bookkeeping would otherwise leave the device idle), while
    multi-step waits until the host no longer waits at all; a device-bound wait (milliseconds)
    brings both back to 1."""
    p = Pacing(None, None, cuda=True)
    p.retired([26] * 100)
    for _ in range(30):
        p.observe(0.00015)
    assert (p.depth, p.multi_step) == (2, 1)
    for _ in range(30):
        p.observe(0.0006)
    assert (p.depth, p.multi_step) == (2, 1)  # between the bounds: no change
    for _ in range(30):
        p.observe(0.005)
    assert (p.depth, p.multi_step) == (1, 1)


def test_auto_depth_needs_long_blocks() -> None:
    """Auto depth stays 1 while the retired blocks are short (its extra forward a block would
    cost more than the idle it saves), goes to 2 once they are long and the host is the
    bottleneck, and back to 1 when the blocks get short again, the host still the bottleneck;
    multi-step on auto follows the wait alone."""
    p = Pacing(None, None, cuda=True)
    for _ in range(30):
        p.observe(0.0)
        p.retired([3, 4])
    assert (p.depth, p.multi_step) == (1, 2)
    for _ in range(60):
        p.retired([26])
        p.observe(0.0)
    assert (p.depth, p.multi_step) == (2, 2)
    for _ in range(60):
        p.retired([3])
        p.observe(0.0)
    assert (p.depth, p.multi_step) == (1, 2)


def test_auto_depth_sees_the_blocks_that_retire(tiny_model_dir: Path) -> None:
    """With auto depth the worker hands Pacing every retired block's forward count: those the
    scheduler reports for the request, in order (auto is CUDA's; forced on here)."""
    e = local_engine(tiny_model_dir, "LowConfidence", fdfo=True, mrr=1, depth=1, multi_step=1)
    seen: list[int] = []
    e.worker.pacing.auto_depth = True
    e.worker.pacing.retired = seen.extend  # type: ignore[method-assign]
    e.submit("r", list(range(5, 25)), max_new_tokens=100, ignore_eos=True)
    e.run()
    assert seen == e.outputs["r"][-1].block_forwards and len(seen) >= 3
    e.assert_whole()


def test_pipeline_depth_flag_reaches_the_worker_config(tiny_model_dir: Path) -> None:
    from dllm_serve.engine_config import EngineConfig
    from dllm_serve.server_args import ServerArgs

    def depth(value: str) -> int | None:
        args = ServerArgs(model_path=str(tiny_model_dir), device="cpu", dllm_pipeline_depth=value)
        return EngineConfig.resolve(args).worker().depth

    assert (depth("1"), depth("2"), depth("auto")) == (1, 2, None)
    default = ServerArgs(model_path=str(tiny_model_dir), device="cpu")
    assert EngineConfig.resolve(default).worker().depth is None  # auto (1 on the CPU)
    with pytest.raises(ValueError, match="--dllm-pipeline-depth must be one of 1, 2, auto"):
        depth("3")


def test_multi_step_flag_reaches_the_worker_config(tiny_model_dir: Path) -> None:
    from dllm_serve.engine_config import EngineConfig
    from dllm_serve.server_args import ServerArgs

    def steps(**kw: str) -> int | None:
        args = ServerArgs(model_path=str(tiny_model_dir), device="cpu", **kw)
        return EngineConfig.resolve(args).worker().multi_step

    assert (steps(dllm_multi_step="2"), steps(dllm_multi_step="auto"), steps()) == (2, None, 1)
    with pytest.raises(ValueError, match="--dllm-multi-step must be one of 1, 2, auto"):
        steps(dllm_multi_step="4")


@pytest.mark.parametrize("depth", [1, 2])
def test_holes_stay_and_are_taken(depth: int) -> None:
    """FDFO, 8 rows: requests of different lengths leave holes that stay while nobody waits,
    and requests submitted later take them. After every step the patched columns equal fresh
    ones; holes did persist across layouts; every request decodes all its tokens."""
    e = scripted_engine(fdfo=True, mrr=8, pages=128, depth=depth,
                        need=lambda start: 2 + (start // K) % 3)
    lengths = {f"a{i}": K * (1 if i in (2, 5) else 5 + i % 3) for i in range(8)}
    for rid, n in lengths.items():
        e.submit(rid, [1, 2, 3], max_new_tokens=n, ignore_eos=True)
    kept = 0  # layouts that inherited a hole from the one before
    previous = None
    for step in range(400):
        if step == 12:  # late joiners take the holes left so far
            for i in range(3):
                lengths[f"b{i}"] = 2 * K
                e.submit(f"b{i}", [4, 5], max_new_tokens=2 * K, ignore_eos=True)
        if not e.step() and step > 12:
            break
        check(e)
        layout = e.worker.batch.current
        if layout is not None and previous is not None and previous is not layout:
            kept += bool(set(previous.holes) & set(layout.holes))
        previous = layout
    assert kept > 0
    assert {rid: len(e.tokens(rid)) for rid in lengths} == lengths
    e.assert_whole()


def test_wavefront_changes_patch_without_moving_rows() -> None:
    """FDFO, W=2 (host spawning): a spawned block takes a hole or appends a row and a retired
    leading block leaves a hole, so a block that stays keeps its row through layout changes that
    alter a request's block count, unless holes cost and it is moved into one (a staged move); the
    layout checks hold after every step and every request decodes all its tokens."""
    e = scripted_engine(fdfo=True, mrr=6, pages=160, wavefront=2,
                        need=lambda start: 2 + (start // K) % 3)
    batch, storage = e.worker.batch, e.worker.storage
    counts = {"in_place": 0, "moved": 0}  # count changes with no row moved / with moves
    rebuild, write = batch._rebuild, storage.write_rows
    moved: list[int] = []

    def write_rows(*args, sources=None, **kwargs):  # type: ignore[no-untyped-def]
        moved.extend([] if sources is None else sources.tolist())
        return write(*args, sources=sources, **kwargs)

    def counting() -> Layout:
        old = batch.current
        before = {} if old is None else {id(b): i for i, b in enumerate(old.rows)}
        changed = old is not None and any(
            r.alive and sum(1 for x in old.reqs if x is r) not in (0, len(r.blocks))
            for r in batch.touched.values())
        moved.clear()
        out = rebuild()
        for i, b in enumerate(out.rows):  # a block that stayed: its row, or a move's target
            assert (not b.alive or id(b) not in before or before[id(b)] == i  # (not b.alive:
                    or before[id(b)] in moved)  # the holes' one placeholder)
        if changed:
            counts["moved" if moved else "in_place"] += 1
        return out

    batch._rebuild = counting  # type: ignore[method-assign]
    storage.write_rows = write_rows  # type: ignore[method-assign]
    lengths = {f"r{i}": K * (4 + i % 3) for i in range(10)}
    for rid, n in lengths.items():
        e.submit(rid, [1, 2, 3], max_new_tokens=n, ignore_eos=True)
    widest = 0
    for _ in range(600):
        if not e.step():
            break
        check(e)
        widest = max([widest, *(len(r.blocks) for r in batch.reqs.values())])
    assert widest == 2 and counts["in_place"] > counts["moved"] > 0, counts
    for rid in lengths:  # each block took exactly its scripted forwards: moved rows carried
        out = e.outputs[rid][-1]  # their ids and step counts
        assert out.block_forwards == [2 + (s // K) % 3 for s in range(0, 3 + lengths[rid], K)]
    assert {rid: len(e.tokens(rid)) for rid in lengths} == lengths
    e.assert_whole()


def test_columns_set_writes_every_column_as_of_does() -> None:
    """A row rewritten by Columns.set equals the row Columns.of makes, every setting away from
    its default (the random workload's requests keep the defaults)."""
    settings_ = ReqSettings(prompt_len=5, max_end=96, temperature=0.7, top_p=0.9, seed=11,
                            top_k=5, min_p=0.1)
    req, other = DeviceReq(1, 3, settings_, 64), DeviceReq(2, 4, ReqSettings(1, 32), 32)
    block, old = Block(64), Block(0)
    cols = Columns.of([other, other], [old, old])
    cols.set(1, req, block)
    fresh = Columns.of([other, req], [old, block])
    for name in COLUMN_FIELDS:
        assert getattr(cols, name) == getattr(fresh, name), name


@pytest.mark.parametrize(("device", "overlap"), [
    ("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_every_mapping_is_on_the_device_before_a_forward_or_prefill_reads_it(
        tiny_model_dir: Path, device: str, overlap: bool) -> None:
    """Page mappings ride the row storage's inbox (applied first thing by the next denoise
    forward: no device copy of their own) unless a prefill follows them in the same batch of
    changes (then they are written at once, after whatever was staged). Whichever way, when
    a prefill or an eager denoise forward reads the page table it holds every mapping the
    worker was sent, the later write of an entry holding, and after every iteration (what is
    still staged applied, the device idle) the table holds them all; both ways are taken here
    (requests with and without a prefill, prompts of several pages, slots reused). On CUDA the
    forwards are CUDA graphs whose first kernel applies the inbox (their KV slots are computed
    inside the graph: checked after each iteration only)."""
    e = local_engine(tiny_model_dir, "LowConfidence", fdfo=True, mrr=3, depth=1, multi_step=1,
                     device=device)
    w = e.worker
    w.pacing.overlap = overlap
    sent: dict[tuple[int, int], int] = {}  # (slot, entry) -> page, as the worker was sent
    counts = {"staged": 0, "direct": 0, "checked": 0}
    apply_all, stage, add_pages = w.apply_all, w.storage.stage_pages, w.runner.add_pages_many
    slots = w.runner.kv.slots

    def logged_apply_all(items: list) -> None:  # type: ignore[type-arg]
        for item in items:
            if isinstance(item, AddPages):
                sent.update({(item.slot, item.first + i): int(p)
                             for i, p in enumerate(item.pages)})
        apply_all(items)

    def staged(writes: list) -> bool:  # type: ignore[type-arg]
        counts["staged"] += len(writes)
        return stage(writes)

    def direct(writes: list) -> None:  # type: ignore[type-arg]
        counts["direct"] += len(writes)
        add_pages(writes)

    def check() -> None:
        table = w.runner.page_table
        assert all(int(table[slot, entry]) == page for (slot, entry), page in sent.items())
        counts["checked"] += 1

    def checked_slots(*args):  # type: ignore[no-untyped-def]
        check()  # the KV slots of a prefill's or an eager forward's tokens, from the table
        return slots(*args)

    w.apply_all = logged_apply_all  # type: ignore[method-assign]
    w.storage.stage_pages = staged  # type: ignore[method-assign]
    w.runner.add_pages_many = direct  # type: ignore[method-assign]
    w.runner.kv.slots = checked_slots  # type: ignore[method-assign]
    def step() -> bool:
        busy = e.step()
        e.sched.check_integrity()
        w.storage.apply_pages()
        if device == "cuda":
            torch.cuda.synchronize()
        check()
        return busy

    for i in range(8):  # prompts of 92 / 2 tokens: three pages / below a block (no prefill)
        e.submit(f"r{i}", list(range(5 + i, 7 + i + 90 * (i % 2 == 0))), max_new_tokens=40,
                 ignore_eos=True)
        step()
    while step():
        pass
    assert len(e.outputs) == 8 and counts["checked"] > 8
    assert counts["staged"] > 0 and (counts["direct"] > 0 or overlap)
    e.assert_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_launch_comes_after_the_cheap_changes_and_before_a_prefill(tiny_model_dir: Path,
                                                                      overlap: bool) -> None:
    """On CUDA (overlap), with blocks on the device, the worker applies the leading run of
    cheap changes (AddPages, Admit, Release) before the launch, so a request admitted without
    a prefill joins that very forward; from a Prefill on, the changes are applied after the
    launch (while the forward runs) and what they admit joins the next one. An idle worker
    applies everything and launches what it was given at once. On the CPU (a forward runs
    inside its launch) all the changes come first."""
    e = local_engine(tiny_model_dir, "LowConfidence", fdfo=True, mrr=3, depth=1, multi_step=1)
    w = e.worker
    w.pacing.overlap = overlap
    events: list[tuple[str, object]] = []
    apply, launch, add_pages = w.apply, w.launch, w.runner.add_pages_many
    stage_pages = w.storage.stage_pages

    def logged_apply(item: object) -> None:
        events.append(("apply", type(item).__name__))
        apply(item)  # type: ignore[arg-type]

    def logged_pages(writes: list) -> None:  # type: ignore[type-arg]
        events.extend(("apply", "AddPages") for _ in writes)  # the worker maps them together
        add_pages(writes)

    def logged_stage(writes: list) -> bool:  # type: ignore[type-arg]
        events.extend(("apply", "AddPages") for _ in writes)  # staged for the next forward
        return stage_pages(writes)

    def logged_launch():  # type: ignore[no-untyped-def]
        out = launch()
        events.append(("launch", sorted(r.uid for r in out.layout.reqs if not r.hole)))
        return out

    def names() -> list[str]:
        return [str(v) if k == "apply" else "launch" for k, v in events]

    w.apply, w.launch = logged_apply, logged_launch  # type: ignore[method-assign]
    w.runner.add_pages_many = logged_pages  # type: ignore[method-assign]
    w.storage.stage_pages = logged_stage  # type: ignore[method-assign]
    e.submit("a", list(range(5, 25)), max_new_tokens=64, ignore_eos=True)
    e.step()  # idle worker: a's pages, prefill and admission, then a's first forward
    kinds = [k for k, _ in events]
    assert kinds.index("launch") == len(kinds) - 1 and ("apply", "Admit") in events
    (a,) = events[-1][1]  # type: ignore[misc]
    e.step()
    events.clear()
    e.submit("b", [7, 8, 9], max_new_tokens=64, ignore_eos=True)  # shorter than a block
    e.step()
    at = names().index("launch")
    assert "Prefill" not in names()
    assert sorted(names()[:at]) == ["AddPages", "Admit"] and events[at][1] == [a, a + 1]  # b
    events.clear()
    e.submit("c", list(range(30, 130)), max_new_tokens=64, ignore_eos=True)  # prefilled
    e.step()
    at = names().index("launch")
    assert "Prefill" in names() and "Admit" in names()
    if not overlap:
        assert "launch" not in names()[:names().index("Admit")]
        assert events[at][1] == [a, a + 1, a + 2]
    else:
        assert names()[:at] == ["AddPages"] and names()[at + 1] == "Prefill"
        assert events[at][1] == [a, a + 1]  # c is not in this forward ...
        events.clear()
        e.step()
        assert events[0] == ("launch", [a, a + 1, a + 2])  # ... but in the next
    e.run()
    assert {o[-1].completion_tokens for o in e.outputs.values()} == {64}
    e.assert_whole()
