"""The engine end to end (scheduler + worker processes) at a real model's shapes (issues 6, 17).

    python benchmarks/engine_gpu.py --out results/engine_gpu.json    # LLaDA2.0-mini's shapes
    python benchmarks/engine_gpu.py --preset sdar-8b-shape --concurrency 64 128 \
        --out results/engine_gpu_sdar8b.json
    python benchmarks/engine_gpu.py --preset tiny --device cpu --concurrency 2   # smoke

The model folder holds config.json and the tokenizer only (`make_tiny_model.py --no-weights`,
written to a temporary folder unless --model-path is given) and the worker builds the model
with random weights in memory (`--load-format dummy`). Per engine setting (--graphs on: CUDA
graphs, off: eager) and per concurrency C, C GSM8K prompts run at once with FDFO, each for
exactly --max-new-tokens tokens (random weights never converge early: every block takes its
full block size + 1 forwards, 33 for LLaDA2, 5 for SDAR). `--load-format auto --model-path DIR`
runs a real checkpoint instead, and `--mode sync` the sync execution mode. Reported per run:
output tokens/s, rounds/s and denoise forwards/s, and the fraction of wall time the device sat
idle between rounds.

Method (dllm_serve/managers/round_trace.py, benchmarks/trace_summary.py): the worker puts CUDA
events around every device item (a prefill forward, or a denoise forward + step) and records
the device idle time before each (from the previous item's end event to this one's start
event), and its own host work per loop iteration (time not spent waiting for the device).
busy_fraction / idle_fraction: device time inside items / between items, over the device span
of the timed run; host_ms_per_forward: the worker's host work per denoise forward;
worst_item_ratio: the slowest item (prefill or round) over the median round (a compile inside
serving would show as seconds). floor_ms / ratio: the roofline floor of one round
(benchmarks/round_cost.py, ceilings measured on this device as round_roofline.py does) at the
run's mean batch (rows_mean blocks) and a prefix of the mean prompt plus half the new tokens,
with the distinct experts uniform routing would touch; ratio = forward_ms_mean / floor_ms, an
estimate (the batch and prefixes vary within a run; round_roofline.py measures exact ones).
startup_s: Engine() until ready; warmup_s: the part of it the worker spent compiling and
capturing every bucket. compiles_after_ready: Triton kernels the worker compiled since it was
ready, up to the end of the row's run (kernels/compile_watch.py; each is named in its log).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import git_commit, gsm8k_questions, write_json
from benchmarks.round_cost import meta_model, round_cost
from benchmarks.round_roofline import dllm_config, measure_ceilings
from benchmarks.trace_summary import read_trace, summarize
from dllm_serve.managers.round_trace import TRACE_ENV
from dllm_serve.model.config import ModelConfig
from dllm_serve.tools.tiny_checkpoint import ARCHES, PRESETS, build_tiny_checkpoint, preset_arch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None,
                   help="config.json + tokenizer folder (default: written for --preset)")
    p.add_argument("--preset", default="llada2-mini-shape", choices=PRESETS)
    p.add_argument("--arch", default=None, choices=ARCHES,
                   help="architecture of the preset (default: the preset's own; tiny: "
                   "llada2_moe)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--graphs", nargs="+", default=["on"], choices=["on", "off"],
                   help="engine settings to run: CUDA graphs on, off (eager)")
    p.add_argument("--eager-concurrency", type=int, nargs="+", default=None,
                   help="concurrencies for --graphs off (default: --concurrency)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--wavefront-size", type=int, default=1)
    p.add_argument("--algorithm", default="LowConfidence")
    p.add_argument("--mode", default="fdfo", choices=["fdfo", "sync"],
                   help="execution mode (sync: every block of a round finishes together)")
    p.add_argument("--load-format", default="dummy", choices=["dummy", "auto"],
                   help="dummy: random weights from config.json (default); auto: the "
                   "checkpoint's weights (--model-path; blocks then finish early)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="every request runs exactly --max-new-tokens tokens")
    p.add_argument("--backend", default="auto",
                   help="attention and MoE backend (default auto: triton on cuda, torch on cpu)")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--out", default=None, help="JSON results")
    return p.parse_args(argv)


def engine_kwargs(ns: argparse.Namespace, model_path: str, graphs: bool) -> dict[str, Any]:
    backend = ns.backend
    return dict(model_path=model_path, load_format=ns.load_format, device=ns.device,
                attention_backend=backend, moe_backend=backend, dllm_algorithm=ns.algorithm,
                dllm_fdfo=ns.mode == "fdfo", dllm_wavefront_size=ns.wavefront_size,
                max_running_requests=max(ns.concurrency), context_length=ns.context_length,
                max_total_tokens=(max(ns.concurrency) + 1) * ns.context_length,
                disable_cuda_graph=not graphs, log_level="warning")


def run_concurrency(engine: Any, trace: str, prompts: list[str], max_new_tokens: int,
                    ignore_eos: bool = True) -> dict[str, Any]:
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos, "temperature": 0.0}
    # Warm-up: the measured call itself, once. Before issue 15 the first forwards of a new shape
    # compiled Triton kernels for seconds (17 s of an 18.7 s span on an H200, results/h200/perf/
    # engine_gpu_repeat.json); the worker's warm-up now compiles every bucket before ready
    # (compiles_after_ready says so), and the call stays so that every row, old and new, times
    # the second run of its prompts (whose pages the radix cache may then hold).
    engine.generate(prompts, params)
    before = engine.get_server_info()["stats"]
    start = time.monotonic()
    outs = engine.generate(prompts, params)
    end = time.monotonic()
    after = engine.get_server_info()["stats"]
    time.sleep(0.3)  # the worker writes its last trace records once it is idle
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs) / len(outs)
    wall = end - start
    return {"concurrency": len(prompts), "wall_s": wall, "output_tokens": tokens,
            "prompt_tokens_mean": prompt_tokens,
            "output_tokens_per_s": tokens / wall,
            "scheduler_stats": {k: after[k] - before[k] for k in after},
            "compiles_after_ready": after["kernel_compiles_after_ready"],
            **summarize(read_trace(trace, start, end))}


def run_engine(ns: argparse.Namespace, model_path: str, graphs: bool, trace_dir: Path,
               concurrency: list[int], floor: Floor) -> list[dict[str, Any]]:
    from dllm_serve import Engine

    trace = str(trace_dir / f"trace_graphs_{'on' if graphs else 'off'}.jsonl")
    os.environ[TRACE_ENV] = trace  # the worker process inherits it
    t0 = time.monotonic()
    with Engine(**engine_kwargs(ns, model_path, graphs)) as engine:
        startup = time.monotonic() - t0
        warmup = engine.get_server_info().get("startup", {}).get("warmup_s", 0.0)
        print(f"graphs={'on' if graphs else 'off'}: startup {startup:.1f} s (warm-up and "
              f"capture {warmup:.1f} s)", flush=True)
        worker = read_trace(trace, 0.0, float("inf"), kinds=("worker",))[-1]
        engine.generate(["warm up"], {"max_new_tokens": 32, "ignore_eos": True})
        rows = []
        for c in concurrency:
            row = run_concurrency(engine, trace, gsm8k_questions(c, seed=c), ns.max_new_tokens,
                                  ns.ignore_eos)
            rows.append({"mode": ns.mode, "graphs": graphs, "graphs_active": worker["cuda_graphs"],
                         "graph_buckets": worker["graph_buckets"], "startup_s": startup,
                         "warmup_s": warmup, **row, **floor.of(row, ns.max_new_tokens)})
            print_row(rows[-1])
    del os.environ[TRACE_ENV]
    return rows


def print_row(r: dict[str, Any]) -> None:
    active = "" if r["graphs_active"] == r["graphs"] else " (no graphs captured: eager)"
    print(f"{r['mode']} graphs={'on ' if r['graphs'] else 'off'}{active} "
          f"C={r['concurrency']:3d}: "
          f"{r['output_tokens_per_s']:8.1f} tok/s  {r.get('forwards_per_s', 0):7.1f} fwd/s  "
          f"busy {100 * r.get('busy_fraction', 0):5.1f}%  idle "
          f"{100 * r.get('idle_fraction', 0):5.2f}%  fwd {r.get('forward_ms_mean', 0):7.2f} ms"
          f" (floor {r.get('floor_ms', 0):6.2f}, {r.get('ratio', 0):5.2f}x)"
          f"  host/fwd {r.get('host_ms_per_forward', 0):6.3f} ms"
          f"  worst item {r.get('worst_item_ratio', 0):5.2f}x the median round"
          f"  compiles after ready {r['compiles_after_ready']}", flush=True)


class Floor:
    """The roofline floor of one round at the model's shapes (a meta-device model: shapes
    only), with ceilings measured on the device (assumed on the CPU)."""

    def __init__(self, model_path: str, device: str) -> None:
        cfg = ModelConfig.load(model_path)
        self.hf = cfg.hf
        self.block = dllm_config(cfg.hf).block_size
        self.model = meta_model(cfg.hf)
        self.ceilings = measure_ceilings(torch.device(device))
        if device == "cuda":
            torch.cuda.empty_cache()

    def experts_touched(self, tokens: int) -> dict[int, int]:
        """Distinct experts per layer when each token picks top_k of E uniformly at random."""
        e, k = self.hf.get("num_experts", 0), self.hf.get("num_experts_per_tok", 0)
        touched = round(e * (1 - (1 - k / e) ** tokens)) if e else 0
        return dict.fromkeys(range(self.hf["num_hidden_layers"]), touched)

    def of(self, row: dict[str, Any], max_new_tokens: int) -> dict[str, float]:
        if not row.get("forward_ms_mean"):
            return {}
        b, k = max(1, round(row["rows_mean"])), self.block
        prefix = int(row["prompt_tokens_mean"] + max_new_tokens / 2) // k * k
        cost = round_cost(self.model, [prefix] * b, k, self.experts_touched(b * k), 2)
        floor_ms = 1e3 * cost.floor_s(*self.ceilings)
        return {"floor_ms": floor_ms, "ratio": row["forward_ms_mean"] / floor_ms}


def model_folder(ns: argparse.Namespace, tmp: Path) -> str:
    if ns.model_path:
        return ns.model_path
    return str(build_tiny_checkpoint(tmp / "model", arch=preset_arch(ns.preset, ns.arch),
                                     preset=ns.preset, weights=False))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="engine_gpu_") as tmp_name:
        tmp = Path(tmp_name)
        model_path = model_folder(ns, tmp)
        floor = Floor(model_path, ns.device)
        rows = []
        for setting in ns.graphs:
            graphs = setting == "on"
            concurrency = ns.concurrency if graphs else (ns.eager_concurrency or ns.concurrency)
            rows += run_engine(ns, model_path, graphs, tmp, concurrency, floor)
    device = ns.device
    if device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    result = {"benchmark": "engine_gpu", "config": vars(ns), "git_commit": git_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "runs": rows}
    write_json(ns.out, result)
    return result


if __name__ == "__main__":
    main()
