"""The engine's GPU speed path end to end: `--load-format dummy` (random weights from
config.json alone), the worker's round trace and the end-to-end benchmark (on the CPU here, with
the tiny preset), and on the GPU: bs=1 sync-vs-FDFO parity with the Triton kernels and CUDA
graphs, and graph replay decoding the same tokens as eager forwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import engine_gpu
from benchmarks.trace_summary import read_trace, stalls, summarize
from dllm_serve import Engine
from dllm_serve.engine_config import EngineConfig
from dllm_serve.model.runner import ModelRunner
from dllm_serve.server_args import ServerArgs
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint


@pytest.fixture(scope="module")
def no_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("no_weights"), weights=False)


def test_dummy_load_format_builds_from_config_alone(no_weights_dir: Path) -> None:
    assert not list(no_weights_dir.glob("*.safetensors"))
    args = ServerArgs(model_path=str(no_weights_dir), device="cpu", load_format="dummy",
                      max_total_tokens=256)
    model = ModelRunner(EngineConfig.resolve(args).worker().runner).model
    weights = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in weights.values())
    assert weights["model.layers.0.input_layernorm.weight"].eq(1).all()
    assert weights["model.embed_tokens.weight"].std() > 0.01
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(EngineConfig.resolve(args.replace(load_format="auto")).worker().runner)
    with pytest.raises(ValueError, match="--load-format"):
        ServerArgs(load_format="npz")


def test_auto_backends_are_triton_on_cuda_and_torch_on_the_cpu(no_weights_dir: Path) -> None:
    cpu, cuda = ServerArgs(device="cpu"), ServerArgs(device="cuda")
    assert cpu.attention_backend == cpu.moe_backend == "auto"
    assert cpu.resolved_attention_backend == cpu.resolved_moe_backend == "torch"
    assert cuda.resolved_attention_backend == cuda.resolved_moe_backend == "triton"
    mixed = ServerArgs(device="cuda", attention_backend="torch")
    assert (mixed.resolved_attention_backend, mixed.resolved_moe_backend) == ("torch", "triton")
    runner = EngineConfig.resolve(ServerArgs(model_path=str(no_weights_dir), device="cpu",
                                             load_format="dummy")).worker().runner
    assert (runner.attention_backend, runner.moe_backend) == ("torch", "torch")


def test_gated_spawning_is_on_by_default_on_cuda_only(no_weights_dir: Path) -> None:
    """--dllm-gated-spawn auto: on with CUDA (the host reads each step back after launching
    the next), off on the CPU; an explicit value wins; the worker's mode follows."""
    assert ServerArgs(device="cpu").dllm_gated_spawn is None
    assert not ServerArgs(device="cpu").resolved_gated_spawn
    assert ServerArgs(device="cuda").resolved_gated_spawn
    assert not ServerArgs(device="cuda", dllm_gated_spawn=False).resolved_gated_spawn
    assert ServerArgs(device="cpu", dllm_gated_spawn=True).resolved_gated_spawn
    for device, gated in (("cpu", False), ("cuda", True)):
        cfg = EngineConfig.resolve(ServerArgs(model_path=str(no_weights_dir), device=device,
                                              load_format="dummy"))
        assert cfg.mode.wavefront.gated == gated and (cfg.mode.gate != 0) == gated


def test_trace_summary() -> None:
    def item(kind: str, gpu: float, gap: float) -> dict:
        return {"kind": kind, "t0": 0.0, "t1": 0.0, "rows": 4, "gpu_ms": gpu, "gap_ms": gap}

    records = [item("prefill", 2.0, 50.0), item("denoise", 6.0, 1.0), item("denoise", 1.0, 0.0),
               {"kind": "host", "t0": 0.0, "t1": 0.003, "wait_ms": 1.0,
                "phases_ms": [0.5, 0.25, 1.75]},
               {"kind": "host", "t0": 0.0, "t1": 0.002, "wait_ms": 0.0,
                "phases_ms": [0.0, 1.0, 0.5]}]
    s = summarize(records)
    assert s["forwards"] == 2 and s["prefills"] == 1
    assert s["span_s"] == pytest.approx(0.010)  # 9 ms of items + 1 ms of gap (the 50 excluded)
    assert s["idle_fraction"] == pytest.approx(0.1) and s["busy_fraction"] == pytest.approx(0.9)
    assert s["forward_ms_mean"] == pytest.approx(3.5)
    assert s["host_ms_per_forward"] == pytest.approx((3.0 - 1.0 + 2.0) / 2)
    split = s["host_split_ms_per_forward"]  # collect without the wait; messages: the rest
    assert split == pytest.approx({"changes": 0.25, "launch": 0.625, "collect": 0.625,
                                   "messages": 0.5})
    assert sum(split.values()) == pytest.approx(s["host_ms_per_forward"])
    assert s["median_round_ms"] == pytest.approx(3.5) and s["worst_item_kind"] == "denoise"
    assert s["worst_item_ratio"] == pytest.approx(6.0 / 3.5)
    assert [r["gpu_ms"] for r in stalls(records, factor=1.5)["slow"]] == [6.0]


def test_stalls_per_kind_hold_prefills_to_their_own_median() -> None:
    """A long prefill takes several small rounds' time: per kind, only what stands out among
    its own kind is a stall (a compile: seconds); a slow round stays one either way."""
    def item(kind: str, gpu: float) -> dict:
        return {"kind": kind, "t0": 0.0, "t1": 0.0, "rows": 4, "gpu_ms": gpu, "gap_ms": 0.0}

    records = [item("prefill", g) for g in (4.0, 5.0, 30.0)] + \
        [item("denoise", g) for g in (1.0, 1.0, 1.0, 4.0)]
    assert [r["gpu_ms"] for r in stalls(records, factor=3.0)["slow"]] == [4.0, 5.0, 30.0, 4.0]
    assert [r["gpu_ms"] for r in stalls(records, factor=3.0, per_kind=True)["slow"]] == [30.0,
                                                                                          4.0]


def test_engine_benchmark_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    result = engine_gpu.main(["--preset", "tiny", "--device", "cpu", "--concurrency", "2",
                              "--max-new-tokens", "32", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == result["runs"]
    run = result["runs"][0]
    assert run["concurrency"] == 2 and run["output_tokens"] == 64
    stats = run["scheduler_stats"]
    assert stats["rounds"] >= 1 and stats["forwards"] >= stats["rounds"]
    assert run["forwards"] == stats["forwards"] - stats["prefill_rounds"]
    assert 0.0 <= run["idle_fraction"] < 1.0 and run["busy_fraction"] > 0.0
    assert run["forwards_per_s"] > 0 and run["output_tokens_per_s"] > 0
    assert run["compiles_after_ready"] == 0  # the CPU runs no Triton kernel


def test_engine_benchmark_sync_on_a_real_checkpoint(tiny_model_dir: Path) -> None:
    """--load-format auto runs the checkpoint's weights and --mode sync the sync mode; the
    result records both."""
    result = engine_gpu.main(["--model-path", str(tiny_model_dir), "--load-format", "auto",
                              "--mode", "sync", "--device", "cpu", "--concurrency", "2",
                              "--max-new-tokens", "32"])
    run = result["runs"][0]
    assert result["config"]["load_format"] == "auto" and run["mode"] == "sync"
    assert run["concurrency"] == 2 and run["output_tokens"] == 64
    assert run["scheduler_stats"]["forwards"] >= run["scheduler_stats"]["rounds"] >= 1


def test_trace_file_is_written_by_the_worker(no_weights_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("DLLM_SERVE_ROUND_TRACE", str(trace))
    with Engine(model_path=str(no_weights_dir), load_format="dummy", device="cpu",
                log_level="warning", max_running_requests=2) as e:
        e.generate(["a " * 40, "b"], {"max_new_tokens": 32, "ignore_eos": True})  # a prefills
        startup = e.get_server_info()["startup"]
    assert startup["worker_s"] > 0 and startup["warmup_s"] == 0.0  # the CPU compiles nothing
    assert startup["prefill_buckets"] == [] and not startup["cuda_graphs"]  # torch: unbucketed
    records = read_trace(str(trace), 0.0, float("inf"))
    header = read_trace(str(trace), 0.0, float("inf"), kinds=("worker",))
    assert header[0]["cuda_graphs"] is False  # the CPU never captures
    # the GC's collections, when one ran, are records too
    assert {"prefill", "denoise", "host"} <= {r["kind"] for r in records} <= {
        "prefill", "denoise", "host", "gc"}
    assert all(r["t1"] >= r["t0"] for r in records)
    items = [r for r in records if r["kind"] in ("prefill", "denoise")]
    assert all(r["gpu_ms"] > 0 and r["gap_ms"] >= 0 for r in items)
    assert sum(r["kind"] == "prefill" for r in items) == 1
    assert summarize(records)["forwards"] == sum(r["kind"] == "denoise" for r in items)
    for r in (r for r in records if r["kind"] == "host"):  # the phases lie inside the iteration
        assert len(r["phases_ms"]) == 3 and min(r["phases_ms"]) >= 0
        assert sum(r["phases_ms"]) <= 1e3 * (r["t1"] - r["t0"]) + 1e-6


# ---- on the GPU ------------------------------------------------------------------------------

PROMPTS = ["Natalia sold clips to 48 of her friends", "The capital of France is",
           "Q: What is 12 times 13? A:"]


def gpu_outputs(model_dir: Path, algorithm: str, **kw: object) -> list[list[int]]:
    with Engine(model_path=str(model_dir), device="cuda", attention_backend="triton",
                moe_backend="triton", dllm_algorithm=algorithm, max_running_requests=1,
                max_total_tokens=16384, log_level="warning", **kw) as e:
        outs = e.generate(PROMPTS, {"max_new_tokens": 100, "ignore_eos": True})
    return [o["output_ids"] for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
def test_bs1_parity_with_kernels_and_graphs(tiny_model_dir: Path, algorithm: str) -> None:
    """bs=1: FDFO and sync decode byte-identical tokens with the Triton kernels and CUDA graphs,
    and the graphs decode the same tokens as eager forwards (buckets 1 and 2 hold bs=1 with a
    wavefront of 2 without padding, so graph and eager run the same shapes)."""
    fdfo = gpu_outputs(tiny_model_dir, algorithm, dllm_fdfo=True)
    assert all(len(o) == 100 for o in fdfo)
    assert gpu_outputs(tiny_model_dir, algorithm, dllm_fdfo=False) == fdfo
    if algorithm == "LowConfidence":  # the step runs eagerly either way: one algorithm will do
        eager = gpu_outputs(tiny_model_dir, algorithm, dllm_fdfo=True, disable_cuda_graph=True)
        assert eager == fdfo


@pytest.mark.gpu
def test_gates_in_the_captured_step(tiny_model_dir: Path) -> None:
    """Gated rows in the CUDA-graph step (dllm/wavefront.py `open_gates`): bs=1 FDFO and sync
    decode the same tokens with gated spawning (JointThreshold, W = 2), and W = 1 with standby
    decodes the tokens of plain W = 1 (its next block runs in its predecessor's final forward)."""
    gated = gpu_outputs(tiny_model_dir, "JointThreshold", dllm_fdfo=True, dllm_gated_spawn=True)
    assert all(len(o) == 100 for o in gated)
    assert gpu_outputs(tiny_model_dir, "JointThreshold", dllm_fdfo=False,
                       dllm_gated_spawn=True) == gated
    plain = gpu_outputs(tiny_model_dir, "LowConfidence", dllm_wavefront_size=1)
    assert gpu_outputs(tiny_model_dir, "LowConfidence", dllm_wavefront_size=1,
                       dllm_standby=True) == plain
