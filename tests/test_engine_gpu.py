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
from dllm_serve import Engine
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.managers.round_trace import read_trace, summarize
from dllm_serve.model.config import ModelConfig
from dllm_serve.model.runner import ModelRunner
from dllm_serve.server_args import ServerArgs
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint


@pytest.fixture(scope="module")
def no_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("no_weights"), weights=False)


def test_dummy_load_format_builds_from_config_alone(no_weights_dir: Path) -> None:
    assert not list(no_weights_dir.glob("*.safetensors"))
    config = ModelConfig.load(no_weights_dir)
    dllm = DllmConfig.build(config, "LowConfidence", None, True)
    args = ServerArgs(model_path=str(no_weights_dir), device="cpu", load_format="dummy",
                      max_total_tokens=256)
    model = ModelRunner(config, dllm, args).model
    weights = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in weights.values())
    assert weights["model.layers.0.input_layernorm.weight"].eq(1).all()
    assert weights["model.embed_tokens.weight"].std() > 0.01
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(config, dllm, args.replace(load_format="auto"))
    with pytest.raises(ValueError, match="--load-format"):
        ServerArgs(load_format="npz")


def test_trace_summary() -> None:
    records = [{"kind": "prefill", "t0": 0.0, "t1": 1.0, "forwards": 1, "forward_ms": 0.0},
               {"kind": "denoise", "t0": 1.5, "t1": 3.5, "forwards": 4, "forward_ms": 1600.0},
               {"kind": "denoise", "t0": 4.0, "t1": 5.0, "forwards": 2, "forward_ms": 800.0}]
    s = summarize(records)
    assert s["rounds"] == 2 and s["forwards"] == 6 and s["prefills"] == 1
    assert s["idle_fraction"] == pytest.approx(1.0 / 5.0)
    assert s["rounds_per_s"] == pytest.approx(2 / 5.0)
    assert s["forward_fraction"] == pytest.approx(2.4 / 5.0)
    assert s["in_round_host_ms_per_forward"] == pytest.approx(1e3 * 0.6 / 6)


def test_engine_benchmark_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    result = engine_gpu.main(["--preset", "tiny", "--device", "cpu", "--concurrency", "2",
                              "--max-new-tokens", "32", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == result["runs"]
    run = result["runs"][0]
    assert run["concurrency"] == 2 and run["output_tokens"] == 64
    assert run["rounds"] >= 1 and run["forwards"] >= run["rounds"]
    assert 0.0 <= run["idle_fraction"] < 1.0 and run["forward_fraction"] > 0.0
    assert run["rounds_per_s"] > 0 and run["output_tokens_per_s"] > 0


def test_engine_benchmark_sync_on_a_real_checkpoint(tiny_model_dir: Path) -> None:
    """--load-format auto runs the checkpoint's weights and --mode sync the sync mode; the
    result records both."""
    result = engine_gpu.main(["--model-path", str(tiny_model_dir), "--load-format", "auto",
                              "--mode", "sync", "--device", "cpu", "--concurrency", "2",
                              "--max-new-tokens", "32"])
    run = result["runs"][0]
    assert result["config"]["load_format"] == "auto" and run["mode"] == "sync"
    assert run["concurrency"] == 2 and run["output_tokens"] == 64
    assert run["forwards"] >= run["rounds"] >= 1


def test_trace_file_is_written_by_the_worker(no_weights_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("DLLM_SERVE_ROUND_TRACE", str(trace))
    with Engine(model_path=str(no_weights_dir), load_format="dummy", device="cpu",
                log_level="warning", max_running_requests=2) as e:
        e.generate(["a " * 40, "b"], {"max_new_tokens": 32, "ignore_eos": True})  # a prefills
    records = read_trace(str(trace), 0.0, float("inf"))
    header = read_trace(str(trace), 0.0, float("inf"), kinds=("worker",))
    assert header[0]["cuda_graphs"] is False  # the CPU never captures
    assert {r["kind"] for r in records} == {"prefill", "denoise"}
    assert all(r["t1"] >= r["t0"] for r in records)
    assert sum(r["forwards"] for r in records if r["kind"] == "denoise") == sum(
        r["timed_forwards"] for r in records if r["kind"] == "denoise")


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
