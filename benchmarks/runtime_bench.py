"""The runtime side by side (issue 12): FDFO against sync, the wavefront against W=1.

    python benchmarks/runtime_bench.py --suite default-model --out results/runtime_default.json
    python benchmarks/runtime_bench.py --suite mini-lognormal mini-histogram --out results/r.json
    python benchmarks/runtime_bench.py --suite default-model --device cpu --concurrency 16

Suites (each setting is one Engine; per concurrency C, C prompts run at once, the measured call
once as warm-up, then --repeats timed runs of which the fastest is reported; with --interleave
all of a suite's engines are up at once and their timed runs take turns, so a drift of the
host's speed during the run moves every setting alike):
- default-model: the built-in model (its weights), LowConfidence, EOS honoured, 128 new tokens,
  GSM8K questions; FDFO and sync at W=1, and FDFO at W=2 (at the W=2 concurrencies).
- default-heldout: the same model on what it was trained for (held-out arithmetic word
  problems, benchmarks/results/default_model/heldout_seed7_256.jsonl) with JointThreshold,
  where blocks finish in a few forwards and the wavefront raises tokens per forward; FDFO and
  sync at W=1 and FDFO at W=2, at the W=2 concurrencies.
- mini-lognormal / mini-histogram: LLaDA2.0-mini's shapes with random weights (no checkpoint
  on disk) and the benchmark-only algorithm benchmarks/scheduled_denoise.py: each block takes a
  forward count drawn from a lognormal (mean 12, spread 0.5, 2..32) or from the built-in model's
  measured histogram; 256 new tokens; FDFO and sync.
--prompts-per-slot P > 1 gives each run P x C prompts with at most C in flight (C clients,
each sending its next prompt when its last one finished): a queue, as a server sees it. The
clients are coroutines in one event loop (Engine.async_generate); runs before run 28 used
C client threads (--clients threads), whose contention for the interpreter lock in the
engine's own process added milliseconds to every request's round trip
(benchmarks/results/h200/runtime/README.md, run 26). With --clients engine all P x C prompts go
to the engine in one call and its scheduler runs at most C (--max-running-requests C) and
queues the rest, as an offline batch job does: a finished request's slot is refilled from the
scheduler's queue, without the round trip through the front and the client (each setting then
needs a single concurrency).
Per run: output tokens/s, and from the worker's trace (benchmarks/trace_summary.py) the device's
busy and idle shares of the run, mean forward time and host work per forward (--no-trace: the
workers run without their trace, whose timing events and writes are in those host figures; then
tok/s only). The JSON keeps every run and the ratios FDFO / sync and W=2 / W=1 per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit, gsm8k_questions, write_json
from benchmarks.trace_summary import read_trace, summarize
from dllm_serve.default_model import default_model_path
from dllm_serve.managers.round_trace import TRACE_ENV
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

PLUGIN = "benchmarks.scheduled_denoise:ScheduledDenoise"
HISTOGRAM = Path(__file__).parent / "data" / "default_model_block_forwards.json"
HELDOUT = Path(__file__).parent / "results" / "default_model" / "heldout_seed7_256.jsonl"


@dataclass
class Setting:
    name: str
    engine: dict[str, Any]
    concurrency: list[int]


@dataclass
class Suite:
    name: str
    max_new_tokens: int
    ignore_eos: bool
    settings: list[Setting] = field(default_factory=list)
    mini: bool = False  # random weights at LLaDA2.0-mini's shapes
    algorithm_yaml: str | None = None  # the ScheduledDenoise settings
    algorithm: str | None = None  # default: the engine's
    data_path: str | None = None  # prompts ("question" lines); default: GSM8K test


def suites(ns: argparse.Namespace) -> dict[str, Suite]:
    c, w2 = ns.concurrency, ns.w2_concurrency
    default = Suite("default-model", 128, False, [
        Setting("fdfo", {"dllm_fdfo": True, "dllm_wavefront_size": 1}, c),
        Setting("sync", {"dllm_fdfo": False, "dllm_wavefront_size": 1}, c),
        *wavefront_settings(w2)])
    heldout = Suite("default-heldout", 128, False, [
        Setting("fdfo", {"dllm_fdfo": True, "dllm_wavefront_size": 1}, w2),
        Setting("sync", {"dllm_fdfo": False, "dllm_wavefront_size": 1}, w2),
        *wavefront_settings(w2)], algorithm="JointThreshold", data_path=str(HELDOUT))
    mc = ns.mini_concurrency
    mini = [Setting("fdfo", {"dllm_fdfo": True, "dllm_wavefront_size": 1}, mc),
            Setting("sync", {"dllm_fdfo": False, "dllm_wavefront_size": 1}, mc)]
    return {"default-model": default, "default-heldout": heldout,
            "mini-lognormal": Suite("mini-lognormal", 256, True, mini, True, "mean: 12.0\n"),
            "mini-histogram": Suite("mini-histogram", 256, True, mini, True,
                                    f"histogram: {HISTOGRAM}\n")}


def wavefront_settings(concurrency: list[int]) -> list[Setting]:
    """W = 2 as served by default (gated spawning on CUDA, host spawning on the CPU), W = 2
    with host spawning, W = 2 with gated spawning, W = 1 with standby."""
    return [Setting("fdfo-w2", {"dllm_fdfo": True, "dllm_wavefront_size": 2}, concurrency),
            Setting("fdfo-w2-host", {"dllm_fdfo": True, "dllm_wavefront_size": 2,
                                     "dllm_gated_spawn": False}, concurrency),
            Setting("fdfo-w2-gated", {"dllm_fdfo": True, "dllm_wavefront_size": 2,
                                      "dllm_gated_spawn": True}, concurrency),
            Setting("fdfo-standby", {"dllm_fdfo": True, "dllm_wavefront_size": 1,
                                     "dllm_standby": True}, concurrency)]


SETTING_NAMES = ["fdfo", "sync", "fdfo-w2", "fdfo-w2-host", "fdfo-w2-gated", "fdfo-standby"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", nargs="+", default=["default-model"],
                   choices=["default-model", "default-heldout", "mini-lognormal",
                            "mini-histogram"])
    p.add_argument("--settings", nargs="+", default=None, choices=SETTING_NAMES,
                   help="run only these settings of each suite (default: all)")
    p.add_argument("--interleave", action="store_true",
                   help="start all of a suite's engines at once and let their timed runs take "
                   "turns (default: one engine after another)")
    p.add_argument("--clients", default="async", choices=["async", "threads", "engine"],
                   help="the closed loop's clients: coroutines in one event loop (default), or "
                   "C threads calling Engine.generate (the H200 runs before run 28); engine: "
                   "no clients, every prompt in one call, queued by the engine's scheduler")
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 32, 64])
    p.add_argument("--w2-concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--mini-concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the suites'")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts-per-slot", type=int, default=1,
                   help="P x C prompts per run, at most C in flight (default 1: C at once)")
    p.add_argument("--pipeline-depth", default="auto", choices=["1", "2", "auto"],
                   help="the worker's --dllm-pipeline-depth in every setting")
    p.add_argument("--multi-step", default="1", choices=["1", "2", "auto"],
                   help="the worker's --dllm-multi-step in every setting")
    p.add_argument("--admit-ahead", type=int, default=None,
                   help="the engine's --dllm-admit-ahead in every setting (default: its own)")
    p.add_argument("--no-trace", action="store_true",
                   help="run the workers without their trace (its two timing events per "
                   "device item and its writes, in every host figure otherwise): tok/s only, "
                   "no busy / idle / host figures")
    p.add_argument("--out", default=None, help="JSON results")
    ns = p.parse_args(argv)
    if ns.clients == "engine" and max(len(ns.concurrency), len(ns.w2_concurrency),
                                      len(ns.mini_concurrency)) > 1:
        p.error("--clients engine runs each engine at max_running_requests = its concurrency: "
                "give one value each to --concurrency, --w2-concurrency, --mini-concurrency")
    return ns


def engine_kwargs(ns: argparse.Namespace, suite: Suite, setting: Setting, model: str | None,
                  yaml_path: str | None) -> dict[str, Any]:
    mrr = max(setting.concurrency)
    kw: dict[str, Any] = {"device": ns.device, "max_running_requests": mrr,
                          "log_level": "warning", "dllm_pipeline_depth": ns.pipeline_depth,
                          "dllm_multi_step": ns.multi_step,
                          "dllm_admit_ahead": ns.admit_ahead, **setting.engine}
    if suite.algorithm is not None:
        kw.update(dllm_algorithm=suite.algorithm)
    if suite.mini:
        kw.update(model_path=model, load_format="dummy", dllm_algorithm=PLUGIN,
                  dllm_algorithm_config=yaml_path, context_length=1024,
                  max_total_tokens=(mrr + 1) * 1024)
    elif ns.interleave:  # engines side by side: a KV pool of their own size, not a GPU share
        kw.update(max_total_tokens=(mrr + 1) * default_context())
    return kw


def default_context() -> int:
    """The built-in model's context length (its config's max_position_embeddings)."""
    config = json.loads((default_model_path() / "config.json").read_text())
    return int(config["max_position_embeddings"])


@dataclass
class Opened:
    engine: Any
    trace: str | None  # its worker's trace file (None: --no-trace)
    startup_s: float
    warmup_s: float


def run_suite(ns: argparse.Namespace, suite: Suite, settings: list[Setting],
              kws: dict[str, dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """Each setting's engine measured at its concurrencies: one engine after another, or with
    --interleave all at once, their timed runs taking turns (a host whose speed drifts
    during the run then shifts every setting alike, not the ratios)."""
    groups = [settings] if ns.interleave else [[s] for s in settings]
    rows: list[dict[str, Any]] = []
    for group in groups:
        with ExitStack() as stack:
            opened = {s.name: open_engine(stack, kws[s.name], None if ns.no_trace
                                          else str(tmp / f"{suite.name}_{s.name}"))
                      for s in group}
            for c in sorted({c for s in group for c in s.concurrency}):
                here = {s.name: opened[s.name] for s in group if c in s.concurrency}
                rows += measure(ns, suite, here, c)
    return rows


def open_engine(stack: ExitStack, kw: dict[str, Any], trace: str | None) -> Opened:
    from dllm_serve import Engine

    if trace is not None:
        os.environ[TRACE_ENV] = trace  # read by the worker when it starts
    t0 = time.monotonic()
    engine = stack.enter_context(Engine(**kw))
    startup = time.monotonic() - t0
    os.environ.pop(TRACE_ENV, None)
    warmup = engine.get_server_info().get("startup", {}).get("warmup_s", 0.0)
    return Opened(engine, trace, startup, warmup)


def measure(ns: argparse.Namespace, suite: Suite, engines: dict[str, Opened],
            c: int) -> list[dict[str, Any]]:
    """Per engine: the measured call once as warm-up, then --repeats timed runs (the engines
    take turns); the fastest is reported, with every run's tokens/s."""
    tokens = ns.max_new_tokens or suite.max_new_tokens
    params = {"max_new_tokens": tokens, "ignore_eos": suite.ignore_eos, "temperature": 0.0}
    prompts = gsm8k_questions(c * ns.prompts_per_slot, suite.data_path, seed=c)
    for o in engines.values():
        generate(o.engine, prompts, params, c, ns.clients)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(ns.repeats):
        for name, o in engines.items():
            runs[name].append(timed(o.engine, o.trace, prompts, params, c, ns.clients))
    rows = []
    for name, done in runs.items():
        best = max(done, key=lambda r: r["output_tokens_per_s"])
        o = engines[name]
        rows.append({"suite": suite.name, "setting": name, "startup_s": o.startup_s,
                     "warmup_s": o.warmup_s, "concurrency": c, "prompts": len(prompts), **best,
                     "tok_s_repeats": [r["output_tokens_per_s"] for r in done]})
        print_row(rows[-1])
    return rows


def generate(engine: Any, prompts: list[str], params: dict[str, Any], c: int,
             clients: str = "async") -> list[dict[str, Any]]:
    """All prompts, at most c in flight: one call when they fit, else c clients, each sending
    its next prompt when its last one finished: coroutines in one event loop
    (Engine.async_generate), or with clients="threads" c threads calling Engine.generate. With
    clients="engine" one call (the engine, at max_running_requests c, queues the rest)."""
    if len(prompts) <= c or clients == "engine":
        return engine.generate(prompts, params)
    if clients == "threads":
        with ThreadPoolExecutor(max_workers=c) as pool:
            return list(pool.map(lambda p: engine.generate(p, params), prompts))
    return asyncio.run(closed_loop(engine, prompts, params, c))


async def closed_loop(engine: Any, prompts: list[str], params: dict[str, Any],
                      c: int) -> list[dict[str, Any]]:
    outs: list[dict[str, Any]] = [{} for _ in prompts]
    todo = iter(range(len(prompts)))

    async def client() -> None:
        for i in todo:
            outs[i] = await engine.async_generate(prompts[i], params)

    await asyncio.gather(*(client() for _ in range(c)))
    return outs


def timed(engine: Any, trace: str | None, prompts: list[str], params: dict[str, Any],
          c: int, clients: str) -> dict[str, Any]:
    before = engine.get_server_info()["stats"]
    start = time.monotonic()
    outs = generate(engine, prompts, params, c, clients)
    end = time.monotonic()
    after = engine.get_server_info()["stats"]
    if trace is not None:
        time.sleep(0.3)  # the worker writes its last trace records once it is idle
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    per_block = [f for o in outs for f in o["meta_info"]["block_forwards"]]
    return {"wall_s": end - start, "output_tokens": tokens,
            "output_tokens_per_s": tokens / (end - start),
            "forwards_per_block_mean": sum(per_block) / max(1, len(per_block)),
            "scheduler_stats": {k: after[k] - before[k] for k in after},
            **({} if trace is None else summarize(read_trace(trace, start, end)))}


def print_row(r: dict[str, Any]) -> None:
    split = " ".join(f"{k} {v:.3f}" for k, v in r.get("host_split_ms_per_forward", {}).items())
    print(f"{r['suite']:15s} {r['setting']:8s} C={r['concurrency']:3d}: "
          f"{r['output_tokens_per_s']:9.1f} tok/s  busy {100 * r.get('busy_fraction', 0):5.1f}%"
          f"  idle {100 * r.get('idle_fraction', 0):5.2f}%  fwd {r.get('forward_ms_mean', 0):6.2f}"
          f" ms  host/fwd {r.get('host_ms_per_forward', 0):6.3f} ms ({split})  "
          f"fwd/block {r['forwards_per_block_mean']:5.1f}", flush=True)


RATIOS = {"fdfo_over_sync": ("fdfo", "sync"), "w2_over_w1": ("fdfo-w2", "fdfo"),
          "w2_host_over_w1": ("fdfo-w2-host", "fdfo"),
          "w2_gated_over_w1": ("fdfo-w2-gated", "fdfo"),
          "w2_gated_over_host": ("fdfo-w2-gated", "fdfo-w2-host"),
          "standby_over_w1": ("fdfo-standby", "fdfo")}


def ratios(rows: list[dict[str, Any]], interleaved: bool = False) -> dict[str, dict[str, Any]]:
    """FDFO / sync and W=2 / W=1 (fdfo) output tokens/s of the fastest runs, per suite and
    concurrency; interleaved, also per turn (run i of one engine against run i of the other,
    adjacent in time) under `<name>_turns`, with their median under `<name>_median`."""
    by = {(r["suite"], r["setting"], r["concurrency"]): r for r in rows}
    out: dict[str, dict[str, Any]] = {}
    for name, (top, bottom) in RATIOS.items():
        for (suite, setting, c), row in by.items():
            other = by.get((suite, bottom, c))
            if setting != top or other is None:
                continue
            key = f"{suite} C={c}"
            out.setdefault(name, {})[key] = (row["output_tokens_per_s"]
                                              / other["output_tokens_per_s"])
            if interleaved:
                turns = [a / b for a, b in zip(row["tok_s_repeats"], other["tok_s_repeats"],
                                               strict=True)]
                out.setdefault(f"{name}_turns", {})[key] = turns
                out.setdefault(f"{name}_median", {})[key] = statistics.median(turns)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    all_suites = suites(ns)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="runtime_bench_") as tmp_name:
        tmp = Path(tmp_name)
        model = str(build_tiny_checkpoint(tmp / "mini", preset="llada2-mini-shape",
                                          weights=False)) if any(
            all_suites[s].mini for s in ns.suite) else None
        for name in ns.suite:
            suite = all_suites[name]
            yaml_path = None
            if suite.algorithm_yaml is not None:
                yaml_path = str(tmp / f"{name}.yaml")
                Path(yaml_path).write_text(suite.algorithm_yaml)
            chosen = [s for s in suite.settings if ns.settings is None or s.name in ns.settings]
            kws = {s.name: engine_kwargs(ns, suite, s, model, yaml_path) for s in chosen}
            rows += run_suite(ns, suite, chosen, kws, tmp)
    device = ns.device
    if device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    result = {"benchmark": "runtime_bench", "config": vars(ns), "git_commit": git_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "runs": rows,
              **ratios(rows, ns.interleave)}
    for kind in RATIOS:
        for key, value in result.get(kind, {}).items():
            turns = result.get(f"{kind}_turns", {}).get(key)
            each = "" if turns is None else (
                f" (per turn {', '.join(f'{t:.2f}' for t in turns)}; median "
                f"{result[f'{kind}_median'][key]:.2f}x)")
            print(f"{kind:15s} {key}: {value:.2f}x{each}")
    write_json(ns.out, result)
    return result


if __name__ == "__main__":
    main()
