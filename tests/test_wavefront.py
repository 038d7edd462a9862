"""FlowBlock wavefront decoding: gate and retirement rules, layout changes, W=1 equals a plain
serial decoder, retired KV equals a serial recomputation, packing, lockstep, aborts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kv_exactness import local_engine, reference_kv

from dllm_serve.dllm.algorithms import DenoiseBatch, RoundMode
from dllm_serve.dllm.algorithms.joint_threshold import JointThreshold, JointThresholdConfig
from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.dllm.wavefront import (
    WavefrontConfig,
    earlier_block_changed,
    readiness,
    retire_counts,
    spawn_mask,
)
from dllm_serve.managers.messages import AbortReq, GenerateReq
from dllm_serve.model.runner import ModelRunner
from dllm_serve.sampling_params import SamplingParams

M, V = 9, 10


def test_readiness_counts_confident_masked_positions() -> None:
    masked = torch.tensor([[True, True, False, True], [False] * 4])
    conf = torch.tensor([[0.9, 0.2, 0.99, 0.8], [0.1] * 4])
    assert readiness(masked, conf, 0.8).tolist() == pytest.approx([2 / 3, 1.0])


def test_earlier_block_changed_stays_within_request() -> None:
    changed = torch.tensor([True, False, False, False, True, False])
    row_req = torch.tensor([0, 0, 0, 1, 1, 1])
    assert earlier_block_changed(changed, row_req).tolist() == [False, True, True, False,
                                                                 False, True]


def test_retire_counts_in_order_only() -> None:
    done = np.array([True, False, False, True, True, True, True])
    assert retire_counts(done, [2, 2, 3]).tolist() == [1, 0, 3]


def test_spawn_mask_gate_window_room_and_lockstep() -> None:
    ready = np.array([False, True, True, False])  # frontiers: rows 1, 2, 3
    cfg = WavefrontConfig(size=2)
    none = np.zeros(3, dtype=np.int64)
    assert spawn_mask(ready, [2, 1, 1], none, [True, True, True], cfg).tolist() == [
        False, True, False]
    # a full window opens a block in the forward where its leftmost block retires
    assert spawn_mask(ready, [2, 1, 1], np.array([1, 0, 0]), [True] * 3, cfg).tolist() == [
        True, True, False]
    assert spawn_mask(ready[:3], [1, 1, 1], none, [True, False, True], cfg).tolist() == [
        False, False, True]
    lock = WavefrontConfig(size=2, lockstep=True)
    assert not spawn_mask(ready[:3], [1, 1, 1], none, [True] * 3, lock).any()
    assert spawn_mask(np.array([True, True]), [1, 1], none[:2], [True, True], lock).all()


def make_batch(rows: list[list[int]], num_blocks: list[int], limits: list[int]) -> DenoiseBatch:
    ids = torch.tensor(rows, dtype=torch.int64)
    b = len(num_blocks)
    return DenoiseBatch(ids, num_blocks, [0] * b, limits, [0.0] * b, [1.0] * b, list(range(b)),
                        {}, np.zeros(len(rows), dtype=np.int64))


def test_with_new_blocks_keeps_requests_contiguous() -> None:
    batch = make_batch([[1, 1], [2, 2], [3, 3]], [2, 1], [8, 8])
    batch.block_steps[:] = [5, 6, 7]
    new, order = batch.with_new_blocks(np.array([True, True]), M)
    assert new.num_blocks == [3, 2]
    assert new.block_ids.tolist() == [[1, 1], [2, 2], [M, M], [3, 3], [M, M]]
    assert new.block_steps.tolist() == [5, 6, 0, 7, 0]
    assert order.tolist() == [0, 1, 3, 2, 4]
    assert new.block_starts() == [0, 2, 4, 0, 2]


def logits_for(tokens: list[list[int]], p: float) -> torch.Tensor:
    out = torch.full((len(tokens), len(tokens[0]), V), math.log((1 - p) / (V - 1)))
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            out[b, j, t] = math.log(p)
    return out.view(-1, V)


def test_round_opens_next_block_when_frontier_is_ready_and_retires_in_order() -> None:
    algo = LowConfidence(LowConfidenceConfig(0.9), 2, M)
    batch = make_batch([[M, M]], [1], [6])
    mode = RoundMode(fdfo=True, wavefront=WavefrontConfig(size=2, spawn_threshold=0.6))
    layouts = []

    def forward(b: DenoiseBatch) -> torch.Tensor:
        layouts.append(list(b.num_blocks))
        return logits_for([[1, 2]] * b.size, 0.95)

    out = algo.run(forward, batch, None, mode)
    # forward 1: block 0 filled (confident) -> frontier ready, block 1 opens;
    # forward 2: block 0 done on entry -> retires; block 1 filled and ready -> block 2 opens
    # (the window counts the retiring block as gone), to run in the next round
    assert layouts == [[1], [2]]
    assert out.retired.tolist() == [1] and out.batch.num_blocks == [3]
    assert out.batch.block_ids.tolist() == [[1, 2], [1, 2], [M, M]]


def test_joint_threshold_reopens_later_block_when_left_block_edits() -> None:
    algo = JointThreshold(JointThresholdConfig(), 2, M)
    batch = make_batch([[3, 3], [4, 4]], [2], [8])
    state = algo.init_step_state(batch.block_ids)
    state["prompt_mask"][:] = False
    state["finished"][1] = True  # block 1 had converged against the old block 0
    algo.step(batch, logits_for([[5, 3], [4, 4]], 0.9), state)  # block 0 edits position 0
    changed = torch.tensor([True, False])
    algo.reopen(state, earlier_block_changed(changed, batch.row_req))
    assert state["finished"].tolist() == [False, False]


@torch.inference_mode()
def serial_generate(runner: ModelRunner, algo, prompt: list[int], max_new: int) -> list[int]:
    """A plain block-by-block decoder at batch size 1: no scheduler, no rounds."""
    k = runner.block_size
    pages = np.arange(runner.kv.max_pages_per_req)
    runner.set_pages([0], [pages])
    out, start = [], len(prompt) // k * k
    if start:
        from dllm_serve.managers.messages import PrefillWork

        work = PrefillWork([0], [pages], [0], [np.asarray(prompt[:start])])
        runner.forward(runner.prefill_batch(work))
    tail = prompt[start:]
    while len(out) < max_new:
        ids = torch.full((1, k), algo.mask_id, dtype=torch.int64)
        ids[0, :len(tail)] = torch.tensor(tail, dtype=torch.int64)
        batch = DenoiseBatch(ids, [1], [start], [start + k], [0.0], [1.0], [0], {},
                             np.zeros(1, dtype=np.int64))
        state = algo.init_step_state(ids)
        fb = runner.denoise_batch([0], batch)
        while not algo.step(batch, runner.forward(fb), state).item():
            batch.block_steps += 1
        out += ids[0, len(tail):].tolist()
        tail, start = [], start + k
    return out[:max_new]


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
@pytest.mark.parametrize("fdfo", [True, False])
def test_w1_equals_a_plain_serial_decoder(tiny_model_dir: Path, algorithm: str,
                                          fdfo: bool) -> None:
    sched = local_engine(tiny_model_dir, algorithm, fdfo, wavefront=1)
    prompt = list(range(5, 5 + 40))
    sched.add_request(GenerateReq("a", np.asarray(prompt),
                                  SamplingParams(max_new_tokens=50, ignore_eos=True), 0.0))
    outs: list[int] = []
    while sched.step():
        outs += [t for o in sched.take_outputs() for t in o.new_ids.tolist()]
    worker = sched.worker  # type: ignore[attr-defined]
    assert len(outs) == 50
    assert outs == serial_generate(worker.runner, worker.algo, prompt, 50)


@pytest.mark.parametrize("wavefront", [2, 3])
@pytest.mark.parametrize("fdfo", [True, False])
def test_retired_kv_equals_serial_recomputation(tiny_model_dir: Path, wavefront: int,
                                                fdfo: bool) -> None:
    sched = local_engine(tiny_model_dir, "JointThreshold", fdfo, wavefront=wavefront)
    runner: ModelRunner = sched.worker.runner  # type: ignore[attr-defined]
    for rid, ids in {"a": list(range(3, 78)), "b": list(range(40, 49))}.items():
        sched.add_request(GenerateReq(rid, np.asarray(ids),
                                      SamplingParams(max_new_tokens=300, ignore_eos=True), 0.0))
    while min((r.blocks for r in sched.running), default=0) < 2:
        sched.step()
    assert sched.stats["committed_blocks"] >= 4
    for req in sched.running:
        n = req.committed_len
        tokens = (list(req.input_ids) + req.output_ids)[:n]
        slots = runner.kv.slots(torch.full((n,), req.holding.slot), torch.arange(n))
        for layer, (k_ref, v_ref) in enumerate(reference_kv(runner, tokens)):
            torch.testing.assert_close(runner.kv.k[layer][slots], k_ref, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(runner.kv.v[layer][slots], v_ref, atol=2e-5, rtol=1e-4)


def test_packing_opens_blocks_per_request_and_abort_mid_wavefront_frees_all(
        tiny_model_dir: Path) -> None:
    # every masked position counts as ready: the frontier opens the next block at once
    sched = local_engine(tiny_model_dir, "LowConfidence", True, wavefront=3,
                         token_threshold=0.0)
    for i in range(2):
        sched.add_request(GenerateReq(f"r{i}", np.arange(3, 3 + 5 + 30 * i),
                                      SamplingParams(max_new_tokens=200, ignore_eos=True), 0.0))
    widths = set()
    for _ in range(40):
        sched.step()
        widths |= {len(r.dllm_incomplete_ids) for r in sched.running
                   if r.dllm_incomplete_ids is not None}
        if 2 in widths or 3 in widths:
            break
    assert max(widths) > 1, "no request ever had more than one active block"
    sched.abort(AbortReq(abort_all=True))
    sched.take_outputs()
    sched.check_integrity()
    stats = sched.alloc.stats()
    assert stats["free_pages"] == stats["total_pages"] and sched.alloc.reserved == 0


def test_lockstep_baseline_completes(tiny_model_dir: Path) -> None:
    sched = local_engine(tiny_model_dir, "JointThreshold", False, wavefront=2, lockstep=True)
    for i in range(2):
        sched.add_request(GenerateReq(f"r{i}", np.arange(3, 10 + 20 * i),
                                      SamplingParams(max_new_tokens=40, ignore_eos=True), 0.0))
    while sched.step():
        pass
    finished = [o for o in sched.take_outputs() if o.finished]
    assert sorted(o.completion_tokens for o in finished) == [40, 40]
    sched.check_integrity()
