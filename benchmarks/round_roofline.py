"""One denoise round at a real model's shapes against its roofline floor (issues 6 and 17).

    python benchmarks/round_roofline.py --out results/roofline.json          # LLaDA2.0-mini
    python benchmarks/round_roofline.py --preset sdar-8b-shape --out results/roofline_sdar8b.json
    python benchmarks/round_roofline.py --preset sdar-30b-a3b-shape \
        --out results/roofline_sdar30b.json
    python benchmarks/round_roofline.py --set num_hidden_layers=2 --batch-sizes 1 4   # smoke
    python benchmarks/round_roofline.py --preset tiny --arch sdar --device cpu   # CPU smoke

The model is built in memory with random weights at the real config (presets
"llada2-mini-shape", "sdar-8b-shape", "sdar-30b-a3b-shape" of dllm_serve.tools.tiny_checkpoint:
no checkpoint on disk) and run through the real ModelRunner. For each batch size B and prefix
length (~1k, ~4k: each request's prefix drawn in [0.9 P, P], block-aligned, its pages scattered
in the pool) one round = forward over the B blocks (the architecture's block size: 32 for
LLaDA2, 4 for SDAR) + LowConfidence's step (at the architecture's default threshold), timed
with CUDA events (median of --iters after --warmup). Each row reports its ratio to the floor
(round_ms / floor_ms), and each backend its startup: building the runner and the worker, whose
warm-up compiles every prefill and denoise bucket (and captures their graphs) as at serving.
The round runs on the worker's own path (managers/worker.py: its row storage, and for
"triton+graphs" the CUDA graph of forward + greedy step captured for the batch size).
Backends: "triton+graphs" (the engine's default GPU path), "triton" (the same kernels, eager:
Triton attention and MoE, fused norms/RoPE/KV store, the fused step) and "torch" (the plain
PyTorch reference, no custom kernels, no graphs). The floor
is the larger of exact bytes / measured copy bandwidth and exact FLOPs / measured bf16 matmul rate
(benchmarks/round_cost.py); the serial floor, the same counts cut into the stages that data
dependencies order (each layer's attention, then its experts; the LM head), each stage at its
own bound, summed: what kernels that run one after another can reach. Runs on the CPU too
(wall-clock timing, assumed ceilings) for a smoke test with --preset tiny.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch import nn

from benchmarks.common import git_commit, write_json
from benchmarks.round_cost import RoundCost, round_cost, serial_floor_s, stage_costs
from dllm_serve.dllm.algorithms import DenoiseBatch, build_algorithm
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.dllm.denoise_step import denoise_step
from dllm_serve.dllm.modes import RoundMode
from dllm_serve.layers.moe import Experts
from dllm_serve.layers.moe_router import route, sum_logit_parts
from dllm_serve.managers.worker import Worker
from dllm_serve.model.config import ModelConfig, RunnerConfig
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.model.loader import random_model
from dllm_serve.model.runner import ModelRunner
from dllm_serve.tools.tiny_checkpoint import ARCHES, PRESETS, checkpoint_config, preset_arch

CPU_CEILINGS = (50e9, 1e12)  # bytes/s, FLOP/s: placeholders for a CPU smoke run
# name -> (attention backend, MoE backend, DllmAlgorithm.fused_predict, CUDA graphs)
BACKENDS = {"triton+graphs": ("triton", "triton", True, True),
            "triton": ("triton", "triton", True, False), "torch": ("torch", "torch", False, False)}


def model_config(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig(path=Path("(random weights)"), architecture=hf["architectures"][0],
                       hf=hf, vocab_size=hf["vocab_size"],
                       max_position_embeddings=hf["max_position_embeddings"])


def dllm_config(hf: dict[str, Any]) -> DllmConfig:
    """LowConfidence with the architecture's block size, mask id and default threshold."""
    return DllmConfig.build(model_config(hf), "LowConfidence", None, True)


def make_runner(hf: dict[str, Any], model: nn.Module, backend: str, max_batch: int,
                max_prefix: int, device: torch.device, dtype: torch.dtype) -> ModelRunner:
    attention, moe, _, graphs = BACKENDS[backend]
    dllm = dllm_config(hf)
    block = dllm.block_size
    context = max_prefix + 2 * block
    cfg = RunnerConfig(
        model=model_config(hf), block_size=block, mask_id=dllm.mask_id, device=device.type,
        dtype=str(dtype).removeprefix("torch."), attention_backend=attention, moe_backend=moe,
        context_length=context, max_running_requests=max_batch, cuda_graphs=graphs,
        graph_max_blocks=max_batch, max_total_tokens=max_batch * context + 64 * block)
    runner = ModelRunner(cfg, model=model)
    with torch.no_grad():
        for t in runner.kv.k + runner.kv.v:
            t.normal_()
    return runner


def scatter_pages(runner: ModelRunner, prefixes: list[int], rng: np.random.Generator) -> None:
    """Request b (slot b) gets enough pages for prefix + block, drawn at random from the pool."""
    need = [-(-(p + runner.block_size) // runner.page_size) for p in prefixes]
    pool = rng.permutation(runner.num_pages)
    ends = np.cumsum(need)
    for slot, (e, n) in enumerate(zip(ends, need, strict=True)):
        runner.add_pages(slot, 0, pool[e - n:e])


def round_fn(worker: Worker, prefixes: list[int], rng: np.random.Generator,
             ) -> tuple[Callable[[], None], ForwardBatch, int]:
    """One round (forward + step) over fresh half-masked blocks in the worker's row storage,
    repeatable, run as the worker runs it (one graph replay when a step graph holds the
    batch); fb: an eager ForwardBatch of the same blocks; the masked rows (those the step
    reads)."""
    runner, algo, storage = worker.runner, worker.algo, worker.storage
    b = len(prefixes)
    shape = (b, runner.block_size)
    init = torch.from_numpy(rng.integers(0, runner.model.config.vocab_size, shape))
    init = torch.where(torch.rand(shape) < 0.5, algo.mask_id, init).to(runner.device)
    storage.write_rows(np.arange(b), None, None, np.asarray(prefixes, dtype=np.int64),
                       np.arange(b), np.zeros(b, np.int64))
    storage.write_params(np.arange(b), np.repeat(storage.defaults[:, None], b, axis=1))
    storage.flush()  # applied by the first round's forward
    ids, state = storage.views(b)
    batch = DenoiseBatch(block_ids=ids, num_blocks=[1] * b, first_starts=prefixes,
                         temperatures=[0.0] * b, top_ps=[1.0] * b, seeds=[0] * b,
                         params=storage.req_params, block_steps=np.zeros(b, dtype=np.int64))
    batch.bind_rows(storage.row_req[:b], storage.row_start[:b], storage.row_seed[:b])
    slots, blocks = list(range(b)), [1] * b
    run = runner.prepare_denoise(slots, prefixes, blocks, ids)

    def one_round() -> None:
        ids.copy_(init)
        if run.step is not None:
            run.step()
        else:
            denoise_step(algo, batch, run.forward(), state, worker.spec)

    asked = int((init == algo.mask_id).sum())
    return one_round, runner.denoise_batch(slots, prefixes, blocks, ids), asked


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """fn captured in a CUDA graph (after one warm call on a side stream): calling the result
    replays it, so a timing of a few short kernels measures the device, not Python's launches.
    fn as it is off CUDA."""
    if device.type != "cuda":
        def call() -> None:
            fn()
        return call
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_ms(fn: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds of fn (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


@torch.inference_mode()
def experts_touched(runner: ModelRunner, fb: ForwardBatch) -> dict[int, int]:
    """MoE layer -> distinct experts the round's tokens chose (one extra forward)."""
    counts: dict[int, int] = {}
    hooks = []
    for name, module in runner.model.named_modules():
        if isinstance(module, Experts):
            layer = int(name.split(".layers.")[1].split(".")[0])

            def record(m: nn.Module, args: tuple, out: torch.Tensor, layer: int = layer) -> None:
                ids, _ = route(sum_logit_parts(args[1]), args[2], args[3])
                counts[layer] = int(ids.unique().numel())

            hooks.append(module.register_forward_hook(record))
    runner.model(fb)
    for h in hooks:
        h.remove()
    return counts


def profile_table(fn: Callable[[], None], rounds: int = 3) -> str:
    """torch.profiler's per-kernel table over a few rounds (device time first)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(rounds):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=30)


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth bytes/s counting read + write, bf16 matmul FLOP/s), measured."""
    if device.type != "cuda":
        return CPU_CEILINGS
    src = torch.randn(2 ** 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), 3, 20, device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, 3, 20, device)
    return 2 * src.numel() * 2 / (copy_ms / 1e3), 2 * 8192 ** 3 / (mm_ms / 1e3)


def ragged_prefixes(batch: int, prefix: int, block: int, rng: np.random.Generator) -> list[int]:
    low = max(0, int(0.9 * prefix) // block)
    return (rng.integers(low, prefix // block + 1, batch) * block).tolist()


def run_backend(hf: dict[str, Any], model: nn.Module, backend: str, args: argparse.Namespace,
                device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    start = time.perf_counter()
    runner = make_runner(hf, model, backend, max(args.batch_sizes), max(args.prefixes), device,
                         dtype)
    algo = build_algorithm(dllm_config(hf))
    algo.fused_predict = BACKENDS[backend][2]
    worker = Worker(runner, algo, RoundMode())  # its row storage; warms up, captures the graphs
    startup = {"startup_s": time.perf_counter() - start, "warmup_s": runner.warmup_s}
    print(f"{backend}: startup {startup['startup_s']:.1f} s (warm-up and capture "
          f"{startup['warmup_s']:.1f} s)", flush=True)
    if BACKENDS[backend][3] and device.type == "cuda" and runner.graphs is None:
        print(f"{backend}: graph capture failed (see the log): these rows run eagerly",
              flush=True)
    rows = []
    for prefix in args.prefixes:
        for batch in args.batch_sizes:
            rng = np.random.default_rng(batch * 7919 + prefix)
            prefixes = ragged_prefixes(batch, prefix, runner.block_size, rng)
            scatter_pages(runner, prefixes, rng)
            fn, fb, asked = round_fn(worker, prefixes, rng)
            with torch.inference_mode():
                ms = time_ms(fn, args.warmup, args.iters, device)
                if args.out and [batch, prefix] == args.profile:
                    path = Path(args.out).parent / f"profile_{backend}_B{batch}_P{prefix}.txt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(profile_table(fn))
            rows.append({"backend": backend, "batch": batch, "prefix": prefix,
                         "block": runner.block_size, "asked_rows": asked, **startup,
                         "prefixes": prefixes, "round_ms": ms,
                         "experts_touched": experts_touched(runner, fb)})
            print(f"{backend:13s} B={batch:3d} prefix~{prefix:5d}: {ms:8.2f} ms", flush=True)
    del runner, worker, fn, fb  # frees the KV pool and the graphs before the next backend
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_floor(row: dict[str, Any], model: nn.Module, hf: dict[str, Any], itemsize: int,
              ceilings: tuple[float, float]) -> None:
    args = (model, row["prefixes"], row["block"], row["experts_touched"], itemsize)
    cost: RoundCost = round_cost(*args)
    floor_ms = 1e3 * cost.floor_s(*ceilings)
    serial_ms = 1e3 * serial_floor_s(stage_costs(*args, row["asked_rows"]), *ceilings)
    row.update(weight_gb=cost.weight_bytes / 1e9, kv_gb=cost.kv_bytes / 1e9,
               tflop=cost.flops / 1e12, floor_ms=floor_ms, bound=cost.bound(*ceilings),
               ratio=row["round_ms"] / floor_ms, serial_floor_ms=serial_ms,
               serial_ratio=row["round_ms"] / serial_ms)


def table(rows: list[dict[str, Any]]) -> str:
    def ms_of(backend: str) -> dict[tuple[int, int], float]:
        return {(r["batch"], r["prefix"]): r["round_ms"] for r in rows if r["backend"] == backend}

    refs = [ms_of("torch"), ms_of("triton")]
    lines = ["| backend | B | prefix | round ms | floor ms | ratio to floor | bound | serial floor "
             "ms | ratio to serial floor | GB | TFLOP | vs torch | vs triton eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speedups = [ref.get((r["batch"], r["prefix"])) for ref in refs]
        cells = " | ".join(f"{s / r['round_ms']:.2f}x" if s else "-" for s in speedups)
        lines.append(f"| {r['backend']} | {r['batch']} | ~{r['prefix']} | {r['round_ms']:.2f} | "
                     f"{r['floor_ms']:.2f} | {r['ratio']:.2f} | {r['bound']} | "
                     f"{r['serial_floor_ms']:.2f} | {r['serial_ratio']:.2f} | "
                     f"{r['weight_gb'] + r['kv_gb']:.2f} | {r['tflop']:.3f} | {cells} |")
    lines += ["", "| backend | startup s | warm-up and capture s |", "|---|---|---|"]
    for backend in dict.fromkeys(r["backend"] for r in rows):
        r = next(r for r in rows if r["backend"] == backend)
        lines.append(f"| {backend} | {r['startup_s']:.1f} | {r['warmup_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llada2-mini-shape", choices=PRESETS)
    parser.add_argument("--arch", default=None, choices=ARCHES,
                        help="architecture of the preset (default: the preset's own; "
                        "tiny: llada2_moe)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config.json override (repeatable), JSON value")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--backends", nargs="+", default=["triton+graphs", "triton", "torch"],
                        choices=sorted(BACKENDS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON results; a .md table beside it")
    parser.add_argument("--profile", type=int, nargs=2, default=[16, 4096], metavar=("B", "P"),
                        help="write a torch.profiler kernel table for this case beside --out")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    _, hf = checkpoint_config(preset_arch(args.preset, args.arch), args.preset, **overrides)
    model = random_model(hf, dtype, device, args.seed)
    ceilings = measure_ceilings(device)
    print(f"ceilings: {ceilings[0] / 1e12:.2f} TB/s, {ceilings[1] / 1e12:.0f} TFLOP/s", flush=True)
    rows = [r for b in args.backends for r in run_backend(hf, model, b, args, device, dtype)]
    for r in rows:
        add_floor(r, model, hf, torch.finfo(dtype).bits // 8, ceilings)
    text = table(rows)
    print(text)
    write_json(args.out, {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
                          "device": torch.cuda.get_device_name(device)
                          if device.type == "cuda" else "cpu",
                          "ceilings": {"bytes_per_s": ceilings[0], "flops": ceilings[1]},
                          "itemsize": torch.finfo(dtype).bits // 8,
                          "config": {k: hf.get(k) for k in ("architectures", "hidden_size",
                                                             "num_hidden_layers", "num_experts",
                                                             "vocab_size")},
                          "rows": rows})
    if args.out:
        Path(args.out).with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
