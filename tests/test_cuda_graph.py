"""Bucketed forwards and their CUDA graphs (model/buckets.py, graph_layout.py, cuda_graph.py,
denoise_graphs.py, prefill_graphs.py).

On the CPU: bucket choice, the packed metadata (padding blocks on the scratch slot, length-0
tiles, stale fields overwritten), and the static padded forwards run eagerly through the Triton
interpreter: the same logits as the eager path, K/V written only to the requests' pages and the
scratch page (denoise and prefill), the warm-up touching nothing but the scratch page, and a
worker round (FDFO, wavefront W=2: the layout changes inside the round) giving the same tokens.
Capture and replay run in the `gpu` tests at the end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.dllm.modes import RoundMode, WavefrontConfig
from dllm_serve.engine_config import EngineConfig
from dllm_serve.managers.messages import AddPages, Admit, ReqSettings
from dllm_serve.managers.worker import Worker
from dllm_serve.model.buckets import denoise_buckets, pick_bucket
from dllm_serve.model.denoise_graphs import DenoiseGraphs
from dllm_serve.model.graph_layout import MetaLayout, MetaWriter, fill_meta
from dllm_serve.model.runner import ModelRunner
from dllm_serve.server_args import ServerArgs
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

K = 32
PAGES = [np.array([3, 7, 1, 9]), np.array([0, 5, 2, 11])]
PROMPTS = [np.arange(5, 5 + 64), np.arange(9, 9 + 32)]


def test_buckets() -> None:
    assert denoise_buckets(1) == [1]
    assert denoise_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert denoise_buckets(100)[-3:] == [80, 96, 100]
    assert denoise_buckets(400)[-4:] == [256, 320, 384, 400]
    assert [pick_bucket(n, [1, 2, 4, 8]) for n in (1, 3, 8, 9)] == [1, 4, 8, None]


def test_fill_meta_pads_with_scratch_blocks() -> None:
    layout = MetaLayout(max_blocks=8, block_size=4, tiles_per_block=1)
    buf = np.full(layout.size, -7, dtype=np.int64)
    # request in slot 3: two blocks from position 12; slot 0: one block at 4; bucket 4
    fill_meta(buf, layout, 4, [3, 0], [12, 4], [2, 1], tokens_per_tile=8, scratch_slot=9)
    field = {f: buf[layout.offset(f):] for f in ("positions", "token_slot", "seg_req",
                                                 "seg_starts", "seg_lens")}
    assert field["positions"][:16].tolist() == [*range(12, 20), *range(4, 8), 0, 1, 2, 3]
    assert field["token_slot"][:16].tolist() == [3] * 8 + [0] * 4 + [9] * 4
    assert field["seg_req"][:4].tolist() == [3, 0, 9, 9]  # 2 real, 1 pad, 1 unused
    assert field["seg_starts"][:4].tolist() == [12, 4, 0, 0]
    assert field["seg_lens"][:4].tolist() == [8, 4, 4, 0]
    tiles = layout.tiles_view(buf, 4)
    assert tiles.tolist() == [[0, 0, 12, 8, 0], [1, 0, 4, 4, 8], [2, 0, 0, 4, 12],
                              [0, 0, 0, 0, 0]]
    fill_meta(buf, layout, 4, [5], [40], [1], tokens_per_tile=8, scratch_slot=9)  # refill
    assert field["positions"][:16].tolist() == [*range(40, 44)] + [0, 1, 2, 3] * 3
    assert field["seg_lens"][:4].tolist() == [4, 4, 4, 4]
    assert layout.tiles_view(buf, 4)[:, 3].tolist() == [4, 4, 4, 4]


def test_meta_writer_writes_what_a_full_fill_would_and_skips_repeats() -> None:
    """Every write leaves the buffer equal to a full fill_meta of the forward; a repeat of the
    last forward is reported unchanged (no copy), a prefill's (ids) never is."""
    rng = np.random.default_rng(0)
    for with_ids in (False, True):
        layout = MetaLayout(max_blocks=16, block_size=4, tiles_per_block=2, with_ids=with_ids)
        writer = MetaWriter(layout, tokens_per_tile=2, scratch_slot=30)
        full = np.zeros(layout.size, dtype=np.int64)
        counts, slots, starts = [1, 2, 1], [4, 7, 9], [8, 0, 20]
        repeats = 0
        for i in range(30):
            if i % 3 == 1:  # a layout change (the same call again otherwise)
                counts = rng.integers(1, 3, size=int(rng.integers(1, 6))).tolist()
                slots = rng.permutation(20)[:len(counts)].tolist()
                starts = (4 * rng.integers(0, 50, size=len(counts))).tolist()
            bucket = 16 if sum(counts) > 8 else 8
            ids = rng.integers(0, 99, 4 * sum(counts)) if with_ids else None
            changed = writer.write(bucket, slots, starts, counts, ids)
            fill_meta(full, layout, bucket, slots, starts, counts, 2, 30, ids)
            assert np.array_equal(writer.host, full), i
            repeats += not changed
        assert repeats == (0 if with_ids else 19)  # all but the first write and 10 changes


def runner_for(args: ServerArgs) -> tuple[ModelRunner, int]:
    """A runner with its bucketed forwards, warmed up and captured on CUDA (the worker would
    add its step)."""
    cfg = EngineConfig.resolve(args).worker().runner
    runner = ModelRunner(cfg)
    runner.warm_up()
    return runner, cfg.mask_id


def make_runner(model_dir: Path, device: str = "cpu", moe_backend: str = "triton",
                **kw: object) -> tuple[ModelRunner, int]:
    args = ServerArgs(model_path=str(model_dir), device=device, attention_backend="triton",
                      moe_backend=moe_backend, max_running_requests=4, max_total_tokens=2048,
                      chunked_prefill_size=256, **kw)  # type: ignore[arg-type]
    runner, mask_id = runner_for(args)
    for slot, pages in enumerate(PAGES):
        runner.add_pages(slot, 0, pages)
    runner.prefill([0, 1], [0, 0], PROMPTS)
    return runner, mask_id


def uncaptured_graphs(runner: ModelRunner, mask_id: int, max_blocks: int = 8) -> DenoiseGraphs:
    return DenoiseGraphs(runner.model, runner.kv, runner.attn, K, max_blocks,  # type: ignore[arg-type]
                         runner.model.config.vocab_size, mask_id, runner.scratch_slot)


def real_kv(runner: ModelRunner) -> list[torch.Tensor]:
    """Every layer's K and V cache without the scratch page (the last one)."""
    end = runner.num_pages * runner.page_size
    return [t[:end] for t in runner.kv.k + runner.kv.v]


INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="interpreter test; CUDA runs the gpu ones")


@INTERPRETER_ONLY
@torch.inference_mode()
def test_static_forward_equals_eager(tiny_model_dir: Path) -> None:
    runner, mask_id = make_runner(tiny_model_dir)
    graphs = uncaptured_graphs(runner, mask_id)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (3, K), generator=gen)
    ids[:, 12:] = mask_id
    # slot 0: two blocks after its 64-token prompt (wavefront); slot 1: one block; bucket 4
    for slots, blocks, starts in (([0, 1], [2, 1], [64, 32]), ([1, 0], [1, 2], [32, 64])):
        block_ids = ids.clone()
        ref = runner.eager_forward(slots, starts, blocks, block_ids)().clone()
        kv_before = [t.clone() for t in runner.kv.k]
        out = graphs.prepare(slots, starts, blocks, block_ids).forward()  # type: ignore[union-attr]
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
        scratch = slice(runner.num_pages * K, (runner.num_pages + 1) * K)
        for before, after in zip(kv_before, runner.kv.k, strict=True):
            before[scratch] = after[scratch]  # padding writes the scratch page only
            torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@INTERPRETER_ONLY
@torch.inference_mode()
def test_padded_prefill_equals_unpadded(tiny_model_dir: Path) -> None:
    """Two prompts (64 + 96 tokens = 5 blocks) prefilled in one forward padded to the 8-block
    bucket write the same K/V as the unpadded eager prefill and nothing else but the scratch
    page; the denoise logits over them are the same."""
    prompts = [np.arange(5, 69), np.arange(100, 196)]
    pages = [np.array([3, 7, 1]), np.array([0, 5, 2, 11])]
    ids = torch.randint(0, 300, (2, K), generator=torch.Generator().manual_seed(1))
    out = {}
    for padded in (False, True):
        args = ServerArgs(model_path=str(tiny_model_dir), device="cpu",
                          attention_backend="triton", moe_backend="triton",
                          max_running_requests=4, max_total_tokens=2048,
                          chunked_prefill_size=256)
        runner = ModelRunner(EngineConfig.resolve(args).worker().runner)
        assert runner.prefill_graphs is not None
        assert runner.prefill_graphs.bucket_tokens(160) == 256
        if not padded:
            runner.prefill_graphs = None
        for slot, p in enumerate(pages):
            runner.add_pages(slot, 0, p)
        runner.prefill([0, 1], [0, 0], prompts)
        logits = runner.eager_forward([0, 1], [64, 96], [1, 1], ids.clone())()
        out[padded] = [t.clone() for t in real_kv(runner)], logits
    (kv_ref, logits_ref), (kv_pad, logits_pad) = out[False], out[True]
    for ref, pad in zip(kv_ref, kv_pad, strict=True):
        torch.testing.assert_close(pad, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits_pad, logits_ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits_pad.argmax(-1), logits_ref.argmax(-1))


@INTERPRETER_ONLY
@torch.inference_mode()
def test_warm_up_writes_only_the_scratch_page(tiny_model_dir: Path) -> None:
    """The warm-up forwards (every prefill and denoise bucket, all pad blocks) leave the
    cached K/V of real requests as they were."""
    runner, mask_id = make_runner(tiny_model_dir)
    assert runner.prefill_graphs is not None and runner.graphs is not None
    assert runner.prefill_graphs.buckets == [1, 2, 4, 8] and runner.graphs.buckets == [1, 2, 4, 8]
    before = [t.clone() for t in real_kv(runner)]
    for forwards in (runner.prefill_graphs, runner.graphs):
        forwards.warm_up()
    for b, a in zip(before, real_kv(runner), strict=True):
        assert torch.equal(a, b)
    assert all(t[runner.num_pages * K:].abs().sum() > 0 for t in runner.kv.k)  # pads wrote there


# The worker test below checks the static forwards' layout, metadata and step against the eager
# path, not the experts' kernel (tests/test_kernels_moe.py checks it against the reference):
# its forwards take the PyTorch experts, which run ~3x faster than the Triton kernel under the
# interpreter (two thirds of the test's time was the kernel's).
MOE_UNDER_TEST = "torch"


@torch.inference_mode()
def worker_tokens(model_dir: Path, static: bool, step: bool = False, rows: bool = True,
                  gated: bool = False) -> tuple[np.ndarray, list[int], bool]:
    """Six worker iterations, FDFO, wavefront W=2, LowConfidence threshold 1 (one token a step)
    with every masked position counted as ready (tau 0): each request opens its second block
    after one step, so the layout changes while the forward loop runs. rows: the forward's
    metadata computed from the storage's rows (as the worker builds it), else written by the
    host. gated: the second block placed at once, opened by the step (else by the host after
    the readout). Returns the final ids, the row counts, and whether the last layout made its
    host columns."""
    runner, mask_id = make_runner(model_dir, moe_backend=MOE_UNDER_TEST)
    algo = LowConfidence(LowConfidenceConfig(threshold=1.0), K, mask_id)
    algo.fused_predict = True
    mode = RoundMode(fdfo=True, wavefront=WavefrontConfig(size=2, spawn_threshold=0.5,
                                                          token_threshold=0.0, gated=gated))
    worker = Worker(runner, algo, mode, report_every_s=0.0)  # builds the bucketed forwards
    assert runner.graphs is not None and runner.graphs.step is not None
    if not static:  # the unpadded eager path
        runner.graphs = None
    elif not step:  # the static forward eagerly, the step after it on its logits
        runner.graphs = DenoiseGraphs(
            runner.model, runner.kv, runner.attn, K, 8, runner.model.config.vocab_size,  # type: ignore[arg-type]
            mask_id, runner.scratch_slot, ids=worker.storage.ids,
            before=worker.storage.apply_staged,
            rows=(worker.storage.row_req, worker.storage.row_start) if rows else None)
    items: list[AddPages | Admit] = [AddPages(slot, 0, p) for slot, p in enumerate(PAGES)]
    for slot, start in ((0, 64), (1, 32)):
        block = np.full((1, K), mask_id, dtype=np.int64)
        block[0, :5] = 17
        items.append(Admit(slot + 1, slot, start, block, [None], [0],
                           ReqSettings(prompt_len=start, max_end=start + 4 * K)))
    widths = []
    for i in range(6):
        worker.iterate(items if i == 0 else [])
        widths.append(worker.batch.num_rows)
    layout = worker.batch.layout()
    made = layout._cols is not None
    return layout.batch.block_ids.cpu().numpy(), widths, made


@INTERPRETER_ONLY
@pytest.mark.parametrize("gated", [False, True])
def test_worker_round_with_static_forwards_matches_eager(tiny_model_dir: Path,
                                                         gated: bool) -> None:
    ref_ids, ref_widths, made = worker_tokens(tiny_model_dir, static=False, gated=gated)
    # both requests opened a second block (gated: placed at once, opened by the first step)
    assert ref_widths == ([4] * 6 if gated else [2, 4, 4, 4, 4, 4])
    assert made  # an eager forward reads the layout's host columns
    # the step eager on the graph's logits (metadata from the host / the rows), inside the
    # "graph" (as the worker builds it: metadata from the rows)
    for step, rows in ((False, False), (False, True), (True, True)):
        ids, widths, made = worker_tokens(tiny_model_dir, static=True, step=step, rows=rows,
                                          gated=gated)
        assert widths == ref_widths
        np.testing.assert_array_equal(ids, ref_ids)
        # forward + step in one run, metadata from the rows: no host column is ever made
        assert made != (step and rows)


# ---- on the GPU: capture and replay ---------------------------------------------------------


@pytest.mark.gpu
@torch.inference_mode()
def test_graph_replay_equals_eager(tiny_model_dir: Path) -> None:
    """Replays equal the same static forward run eagerly, bit for bit, across layouts and
    prefix lengths in one bucket; and match the unpadded eager path within bf16 rounding."""
    runner, mask_id = make_runner(tiny_model_dir, device="cuda")
    graphs = runner.graphs
    assert graphs is not None and graphs.captured and graphs.buckets == [1, 2, 4, 8]
    ids = torch.randint(0, 300, (3, K), device="cuda")
    ids[:, 12:] = mask_id
    for slots, blocks, starts in (([0, 1], [2, 1], [64, 32]), ([1, 0], [1, 2], [32, 64]),
                                  ([1], [1], [32])):
        block_ids = ids[:sum(blocks)].clone()
        replay = graphs.prepare(slots, starts, blocks, block_ids).forward().clone()  # type: ignore[union-attr]
        bucket = graphs.forwards[pick_bucket(sum(blocks), graphs.buckets)]  # type: ignore[index]
        eager_static = graphs.logits_of(bucket)[:replay.shape[0]]
        diff = (replay - eager_static).abs().max().item()
        assert torch.equal(replay, eager_static), f"replay differs from eager by {diff}"
        ref = runner.eager_forward(slots, starts, blocks, block_ids)()
        err = ((replay - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"relative error {err:.2e}"


@pytest.mark.gpu
def test_capture_failure_runs_eagerly(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: DenoiseGraphs) -> None:
        raise RuntimeError("capture broke")

    monkeypatch.setattr(DenoiseGraphs, "capture", broken)
    runner, mask_id = make_runner(tiny_model_dir, device="cuda")
    assert "CUDA graph capture failed" in caplog.text
    assert runner.graphs is not None and not runner.graphs.captured  # bucketed, eager
    assert runner.prefill_graphs is not None and not runner.prefill_graphs.captured
    ids = torch.full((1, K), mask_id, device="cuda")
    with torch.inference_mode():
        logits = runner.prepare_denoise([1], [32], [1], ids).forward()
    assert logits.shape == (K, runner.model.config.vocab_size)


@pytest.mark.gpu
@torch.inference_mode()
def test_llada2_mini_shape_graphs(tmp_path: Path) -> None:
    """Two layers at LLaDA2.0-mini's shapes (GQA 16/4, 256 experts, vocab 157k): a padded
    bucket (13 -> 16 blocks) and a full one (64) with ~1k-4k prefixes in scattered pages."""
    folder = build_tiny_checkpoint(tmp_path / "mini", preset="llada2-mini-shape", weights=False,
                                   num_hidden_layers=2)
    args = ServerArgs(model_path=str(folder), load_format="dummy", device="cuda",
                      attention_backend="triton", moe_backend="triton", max_running_requests=64,
                      dllm_wavefront_size=1, context_length=4200, max_total_tokens=64 * 4300,
                      chunked_prefill_size=64)  # few prefill buckets: this test is denoise
    runner, mask_id = runner_for(args)
    graphs = runner.graphs
    assert graphs is not None and graphs.buckets[-1] == 64
    for t in runner.kv.k + runner.kv.v:
        t.normal_()
    rng = np.random.default_rng(0)
    for batch_size in (13, 64):
        starts = (rng.integers(1000 // K, 4096 // K, batch_size) * K).tolist()
        need = [s // K + 1 for s in starts]
        pool = rng.permutation(runner.num_pages)
        ends = np.cumsum(need)
        for slot, (e, n) in enumerate(zip(ends, need, strict=True)):
            runner.add_pages(slot, 0, pool[e - n:e])
        ids = torch.randint(0, 150000, (batch_size, K), device="cuda")
        ids[:, ::2] = mask_id
        slots, blocks = list(range(batch_size)), [1] * batch_size
        replay = graphs.prepare(slots, starts, blocks, ids).forward().clone()  # type: ignore[union-attr]
        static = graphs.forwards[pick_bucket(batch_size, graphs.buckets)]  # type: ignore[index]
        eager_static = graphs.logits_of(static)[:replay.shape[0]]
        diff = (replay - eager_static).abs().max().item()
        assert torch.equal(replay, eager_static), f"replay differs from eager by {diff}"
        ref = runner.eager_forward(slots, starts, blocks, ids)()
        err = ((replay - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"B={batch_size}: relative error {err:.2e} against the eager path"
