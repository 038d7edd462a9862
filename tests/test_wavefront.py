"""FlowBlock wavefront decoding: gate and retirement rules, layout changes, W=1 equals a plain
serial decoder, retired KV equals a serial recomputation, packing, lockstep, aborts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from local_engine import local_engine
from test_kv_exactness import reference_kv

from dllm_serve.dllm.algorithms import DenoiseBatch
from dllm_serve.dllm.algorithms.joint_threshold import JointThreshold, JointThresholdConfig
from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.dllm.denoise_step import StepSpec, denoise_step
from dllm_serve.dllm.modes import RoundMode, WavefrontConfig, plan, plan_one
from dllm_serve.dllm.wavefront import earlier_block_changed, readiness
from dllm_serve.managers.messages import AbortReq, AddPages, Admit, ReqSettings
from dllm_serve.managers.worker import Worker
from dllm_serve.model.denoise_run import DenoiseRun
from dllm_serve.model.runner import ModelRunner

M, V = 9, 10


def test_readiness_counts_confident_masked_positions() -> None:
    masked = torch.tensor([[True, True, False, True], [False] * 4])
    conf = torch.tensor([[0.9, 0.2, 0.99, 0.8], [0.1] * 4])
    assert readiness(masked, conf, 0.8).tolist() == pytest.approx([2 / 3, 1.0])


def test_earlier_block_changed_stays_within_request() -> None:
    changed = torch.tensor([True, False, False, False, True, False])
    row_req = torch.tensor([0, 0, 0, 1, 1, 1])
    row_start = torch.tensor([0, 4, 8, 0, 4, 8])
    assert earlier_block_changed(changed, row_req, row_start).tolist() == [
        False, True, True, False, False, True]
    # the same blocks in another row order: the answer follows the blocks
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    out = earlier_block_changed(changed[order], row_req[order], row_start[order])
    assert out.tolist() == [[False, True, True, False, False, True][i] for i in order.tolist()]


def test_plan_fdfo_retires_leading_converged_and_opens_next() -> None:
    mode = RoundMode(fdfo=True, wavefront=WavefrontConfig(size=2))
    # request 0: 2 blocks, the first converged; 1: 1 block converged; 2: 2 blocks, none
    p = plan(mode, np.array([1, 1, 0]), np.array([2, 1, 2]), np.array([True, False, True]),
             np.array([True, True, True]))
    assert p.retire == [1, 1, 0]
    # 0: window 1 < W with a ready frontier spawns; 1: empty window opens; 2: window full
    assert p.open == [True, True, False]
    p = plan(mode, np.array([1]), np.array([1]), np.array([True]), np.array([False]))
    assert p.retire == [1] and not any(p.open)  # no room: nothing opens


def test_plan_sync_waits_for_the_whole_batch() -> None:
    mode = RoundMode(fdfo=False)
    p = plan(mode, np.array([1, 0]), np.array([1, 1]), np.zeros(2, bool), np.ones(2, bool))
    assert p.retire == [0, 0] and not p.boundary and not any(p.open)
    p = plan(mode, np.array([1, 1]), np.array([1, 1]), np.zeros(2, bool), np.ones(2, bool))
    assert p.retire == [1, 1] and p.boundary and all(p.open)


def test_each_request_is_planned_on_its_own_as_the_rule_says() -> None:
    """plan_one (FDFO's worker plans each request with it; plan too, but for lockstep), over
    every small case: the leading converged blocks retire (FDFO, or sync at a boundary); then
    the next block opens if it fits and the window is empty, or the frontier is ready and
    the window has room for it (fewer than W blocks left)."""
    for size in (1, 2, 3):
        mode = RoundMode(fdfo=True, wavefront=WavefrontConfig(size=size))
        for blocks in range(1, size + 1):
            for leading in range(blocks + 1):
                for ready in (False, True):
                    for fits in (False, True):
                        for retiring in (False, True):
                            retire = leading if retiring else 0
                            left = blocks - retire
                            room = left == 0 or (left < size and ready)
                            got = plan_one(mode, leading, blocks, ready, fits, retiring)
                            assert got == (retire, fits and room), (size, blocks, leading)
                            p = plan(RoundMode(fdfo=retiring, wavefront=mode.wavefront),
                                     [leading], [blocks], [ready], [fits],
                                     batch_done=retiring)
                            assert (p.retire[0], p.open[0]) == got


def test_plan_lockstep_spawns_all_together() -> None:
    mode = RoundMode(fdfo=False, wavefront=WavefrontConfig(size=2, lockstep=True))
    none = np.zeros(3, dtype=np.int64)
    ones = np.ones(3, dtype=np.int64)
    p = plan(mode, none, ones, np.array([True, False, True]), np.ones(3, bool))
    assert not any(p.open)
    p = plan(mode, none, ones, np.array([True, True, True]), np.ones(3, bool))
    assert all(p.open)


def make_batch(rows: list[list[int]], num_blocks: list[int]) -> DenoiseBatch:
    ids = torch.tensor(rows, dtype=torch.int64)
    b = len(num_blocks)
    return DenoiseBatch(ids, num_blocks, [0] * b, [0.0] * b, [1.0] * b, list(range(b)),
                        {}, np.zeros(len(rows), dtype=np.int64))


def logits_for(tokens: list[list[int]], p: float) -> torch.Tensor:
    out = torch.full((len(tokens), len(tokens[0]), V), math.log((1 - p) / (V - 1)))
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            out[b, j, t] = math.log(p)
    return out.view(-1, V)


class ScriptedLogits:
    """A runner whose every forward predicts tokens 1, 2, 1, 2, ... at confidence p."""

    def __init__(self, p: float) -> None:
        self.block_size, self.page_size, self.p = 2, 2, p
        self.max_requests, self.graph_max_blocks = 4, 0
        self.scratch_slot = self.max_requests
        self.bucketed = False
        self.device = torch.device("cpu")
        self.graphs = None
        self.layouts: list[list[int]] = []
        self.page_table = None  # pages go nowhere (add_pages)

    def add_pages(self, slot: int, first: int, pages: np.ndarray) -> None:
        pass

    def add_pages_many(self, writes: list[tuple[int, int, np.ndarray]]) -> None:
        pass

    def warm_up(self, ids: object, step: object, width: int, before, rows=None,  # type: ignore[no-untyped-def]
                replayed=None, open_step=None) -> None:
        self.before = before  # the worker's staged row writes, first in every forward

    def resident_run(self, n: int, block_ids: torch.Tensor) -> None:
        return None  # every run made from the layout's columns

    def prepare_denoise(self, slots, first_starts, num_blocks, block_ids):  # type: ignore[no-untyped-def]
        def run() -> torch.Tensor:
            self.before()
            self.layouts.append(list(num_blocks))
            return logits_for([[1, 2]] * block_ids.shape[0], self.p)

        return DenoiseRun(run)


def scripted_run(wavefront: WavefrontConfig, forwards: int) -> tuple[ScriptedLogits, list]:
    """One request of four 2-token blocks on ScriptedLogits: threshold 0.99 commits one
    position a step (top-1 fallback); tau 0.9: both positions are ready after one step, so the
    block after the frontier may open while the frontier still has a mask. -> the runner (its
    layouts) and the retired blocks (start, forwards, ids)."""
    algo = LowConfidence(LowConfidenceConfig(0.99), 2, M)
    runner = ScriptedLogits(0.95)
    worker = Worker(runner, algo, RoundMode(fdfo=True, wavefront=wavefront),  # type: ignore[arg-type]
                    report_every_s=0.0)
    admit = Admit(1, 0, 0, np.full((1, 2), M), [None], [0], ReqSettings(prompt_len=0, max_end=8))
    retired = []
    for i in range(forwards):
        report = worker.iterate([AddPages(0, 0, np.arange(4)), admit] if i == 0 else [])
        if report is not None and report.retired is not None:
            retired += list(zip(report.retired.starts.tolist(), report.retired.forwards.tolist(),
                                report.retired.ids.tolist(), strict=True))
    assert worker.batch.reqs == {}  # max_end reached: the worker forgot the request
    return runner, retired


def test_frontier_opens_next_block_before_it_is_done_and_blocks_retire_in_order() -> None:
    """Host spawning (the default)."""
    runner, retired = scripted_run(WavefrontConfig(size=2, spawn_threshold=0.6,
                                                   token_threshold=0.9), 9)
    # f1: block 0; f2: block 0 (ready after step 1: block 2 opens for f3); f3: blocks 0, 2
    # (block 0 converged after step 2, so f3 is its final forward) ...
    assert runner.layouts[:4] == [[1], [1], [1, 1], [1]]  # each block a row of its own
    assert [s for s, _, _ in retired] == [0, 2, 4, 6]  # in order, every block once
    assert all(f == 3 for _, f, _ in retired)  # 2 unmasking steps + the done-on-entry forward


def test_gated_spawn_opens_the_next_block_on_the_device() -> None:
    """Gated spawning: block 2 waits in f1 (its frontier not yet ready), opens in f2 (block 0
    was ready after step 1): a forward before the host could open it. Its forwards count from
    there. Where no block waits ahead the host still opens one on a readiness it read back: the
    request takes 7 forwards instead of 9, each block its 3."""
    runner, retired = scripted_run(WavefrontConfig(size=2, spawn_threshold=0.6,
                                                   token_threshold=0.9, gated=True), 7)
    assert [len(layout) for layout in runner.layouts] == [2, 2, 2, 2, 2, 2, 1]
    assert [s for s, _, _ in retired] == [0, 2, 4, 6]
    assert all(f == 3 and ids == [1, 2] for _, f, ids in retired)


@pytest.mark.parametrize("size,standby,forwards,rows", [
    (2, False, 8, [2, 2, 2, 2, 1, 2, 1, 1]),
    (1, True, 11, [2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]),
])
def test_gated_placement_disarms_when_blocks_take_more_forwards(
        size: int, standby: bool, forwards: int, rows: list[int]) -> None:
    """arm_forwards 0: armed at the start (no block retired yet), so the first block's successor
    waits ahead; once a block retired (3 forwards) the flow stops placing blocks ahead and opens
    them as without gating: on readiness read back (W = 2), after the retirement (W = 1)."""
    runner, retired = scripted_run(WavefrontConfig(
        size=size, spawn_threshold=0.6, token_threshold=0.9, gated=size > 1, standby=standby,
        arm_forwards=0.0), forwards)
    assert [len(layout) for layout in runner.layouts] == rows
    assert [s for s, _, _ in retired] == [0, 2, 4, 6]
    assert all(f == 3 and ids == [1, 2] for _, f, ids in retired)


@pytest.mark.parametrize("size,standby,arm", [(2, False, 6.0), (2, False, 0.0), (1, True, 6.0)])
def test_the_step_skips_the_gates_only_where_no_row_waits(
        monkeypatch: pytest.MonkeyPatch, size: int, standby: bool, arm: float) -> None:
    """The worker steps without the gates (`gates_open`: no gate test, nothing held) exactly
    while no block placed gated is still unopened by the host's knowledge; whenever it does,
    every row's gate on the device is 0 (the result is the gated step's)."""
    import dllm_serve.managers.worker as worker_module

    seen = []

    def recording(algo, batch, logits, state, spec, isolate=True, gates_open=False):  # type: ignore[no-untyped-def]
        assert batch.gates is not None  # gated storage
        if gates_open:
            assert (batch.gates[0] == 0).all()
        seen.append(gates_open)
        return denoise_step(algo, batch, logits, state, spec, isolate, gates_open)

    monkeypatch.setattr(worker_module, "denoise_step", recording)
    _, retired = scripted_run(WavefrontConfig(size=size, spawn_threshold=0.6, token_threshold=0.9,
                                              gated=size > 1, standby=standby, arm_forwards=arm),
                              9 if standby else 8)
    assert [s for s, _, _ in retired] == [0, 2, 4, 6]
    assert False in seen and True in seen  # gated steps while blocks waited ahead, open ones


def test_an_open_step_equals_the_gated_step_when_no_row_waits() -> None:
    """gates_open on a batch whose gates are all 0: the same readout, state and flags (the
    flags the next gates read are still written)."""
    algo = JointThreshold(JointThresholdConfig(), 2, M)
    spec = StepSpec(True, 0.9, 0.6)
    out = []
    for gates_open in (False, True):
        batch = make_batch([[M, M], [3, M], [M, M]], [1, 1, 1])
        batch.gates = (torch.zeros(3, dtype=torch.int64), torch.full((3,), 7, dtype=torch.int64))
        state = algo.init_step_state(batch.block_ids)
        readout, failed = denoise_step(algo, batch, logits_for([[1, 2], [1, 2], [2, 1]], 0.95),
                                       state, spec, gates_open=gates_open)
        assert failed == []
        out.append((readout, state, batch.gates[1]))
    (a, sa, fa), (b, sb, fb) = out
    assert torch.equal(a, b) and torch.equal(fa, fb) and (fa != 7).all()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_arm_forwards_must_be_a_number_at_least_zero() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="arm-forwards"):
            WavefrontConfig(size=2, gated=True, arm_forwards=bad)
    assert WavefrontConfig(size=2, gated=True, arm_forwards=float("inf")).arm_forwards == float(
        "inf")


def test_standby_starts_the_next_block_in_its_predecessors_final_forward() -> None:
    """W = 1 with standby: the same blocks as block by block, one forward less each (the
    successor runs in its predecessor's final forward): 9 forwards instead of 12."""
    plain_runner, plain = scripted_run(WavefrontConfig(size=1), 12)
    runner, retired = scripted_run(WavefrontConfig(size=1, standby=True), 9)
    assert len(plain_runner.layouts) == 12 and len(runner.layouts) == 9
    assert retired == plain


def test_joint_threshold_reopens_later_block_when_left_block_edits() -> None:
    algo = JointThreshold(JointThresholdConfig(), 2, M)
    batch = make_batch([[3, 3], [4, 4]], [2])
    state = algo.init_step_state(batch.block_ids)
    state["prompt_mask"][:] = False
    state["finished"][1] = True  # block 1 had converged against the old block 0
    algo.step(batch, logits_for([[5, 3], [4, 4]], 0.9), state)  # block 0 edits position 0
    changed = torch.tensor([True, False])
    algo.reopen(state, earlier_block_changed(changed, batch.row_req, batch.row_start))
    assert state["finished"].tolist() == [False, False]


@torch.inference_mode()
def serial_generate(runner: ModelRunner, algo, prompt: list[int], max_new: int) -> list[int]:
    """A plain block-by-block decoder at batch size 1: no scheduler, no rounds."""
    k = runner.block_size
    runner.add_pages(0, 0, np.arange(runner.kv.max_pages_per_req))
    out, start = [], len(prompt) // k * k
    if start:
        runner.prefill([0], [0], [np.asarray(prompt[:start])])
    tail = prompt[start:]
    while len(out) < max_new:
        ids = torch.full((1, k), algo.mask_id, dtype=torch.int64)
        ids[0, :len(tail)] = torch.tensor(tail, dtype=torch.int64)
        batch = DenoiseBatch(ids, [1], [start], [0.0], [1.0], [0], {},
                             np.zeros(1, dtype=np.int64))
        state = algo.init_step_state(ids)
        forward = runner.eager_forward([0], [start], [1], ids)
        while not algo.step(batch, forward(), state).done.item():
            batch.block_steps += 1
        out += ids[0, len(tail):].tolist()
        tail, start = [], start + k
    return out[:max_new]


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
@pytest.mark.parametrize("fdfo,standby", [(True, False), (False, False), (True, True)])
def test_w1_equals_a_plain_serial_decoder(tiny_model_dir: Path, algorithm: str,
                                          fdfo: bool, standby: bool) -> None:
    """standby: each next block waits in a row and runs in its predecessor's final forward
    (the same tokens, every block one forward sooner)."""
    engine = local_engine(tiny_model_dir, algorithm, fdfo, wavefront=1, standby=standby)
    prompt = list(range(5, 5 + 40))
    engine.submit("a", prompt, max_new_tokens=50, ignore_eos=True)
    engine.run()
    outs = engine.tokens("a")
    worker = engine.worker
    assert len(outs) == 50
    assert outs == serial_generate(worker.runner, worker.algo, prompt, 50)


@pytest.mark.parametrize("wavefront", [2, 3])
@pytest.mark.parametrize("fdfo", [True, False])
@pytest.mark.parametrize("gated", [False, True])
def test_retired_kv_equals_serial_recomputation(tiny_model_dir: Path, wavefront: int,
                                                fdfo: bool, gated: bool) -> None:
    engine = local_engine(tiny_model_dir, "JointThreshold", fdfo, wavefront=wavefront,
                          gated=gated)
    sched, runner = engine.sched, engine.worker.runner
    assert isinstance(runner, ModelRunner)
    for rid, ids in {"a": list(range(3, 78)), "b": list(range(40, 49))}.items():
        engine.submit(rid, ids, max_new_tokens=300, ignore_eos=True)
    while min((r.blocks for r in sched.running.values()), default=0) < 2:
        engine.step()
    assert sched.stats["committed_blocks"] >= 4
    for req in sched.running.values():
        n = req.committed_len
        tokens = (list(req.input_ids) + req.output_ids)[:n]
        slots = runner.kv.slots(torch.full((n,), req.holding.slot), torch.arange(n))
        for layer, (k_ref, v_ref) in enumerate(reference_kv(runner, tokens)):
            torch.testing.assert_close(runner.kv.k[layer][slots], k_ref, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(runner.kv.v[layer][slots], v_ref, atol=2e-5, rtol=1e-4)


def test_packing_opens_blocks_per_request_and_abort_mid_wavefront_frees_all(
        tiny_model_dir: Path) -> None:
    # every masked position counts as ready: the frontier opens the next block at once
    engine = local_engine(tiny_model_dir, "LowConfidence", True, wavefront=3,
                          token_threshold=0.0)
    for i in range(2):
        engine.submit(f"r{i}", list(range(3, 3 + 5 + 30 * i)), max_new_tokens=200,
                      ignore_eos=True)
    widths: set[int] = {0}
    for _ in range(40):
        engine.step()
        widths |= {len(r.blocks) for r in engine.worker.batch.reqs.values()}
        if max(widths) > 1:
            break
    assert max(widths) > 1, "no request ever had more than one active block"
    engine.sched.abort(AbortReq(abort_all=True))
    engine.run()
    assert engine.worker.batch.reqs == {} and engine.worker.batch.num_rows == 0
    engine.assert_whole()


def test_lockstep_baseline_completes(tiny_model_dir: Path) -> None:
    engine = local_engine(tiny_model_dir, "JointThreshold", False, wavefront=2, lockstep=True)
    for i in range(2):
        engine.submit(f"r{i}", list(range(3, 10 + 20 * i)), max_new_tokens=40, ignore_eos=True)
    outs = engine.run()
    assert sorted(o[-1].completion_tokens for o in outs.values()) == [40, 40]
    engine.sched.check_integrity()
