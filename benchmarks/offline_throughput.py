"""Offline throughput: the same prompts through sync and FDFO at several batch sizes.

    python -m benchmarks.offline_throughput --num-prompts 64 --max-new-tokens 128 \
        --max-running-requests 4 16 --output results/offline.json

Per (mode, max_running_requests) it starts an Engine, warms it up, runs every prompt in one
`generate` call and reports output throughput, tokens per forward (TPF: output tokens / forwards
the blocks needed), tokens per request-forward (every denoise forward a request sat in counts,
the fair measure when a wavefront puts several of its blocks in one forward), forwards per
committed block, denoise forwards and rounds, the request-steps spent on blocks that were already
done (sync's waste), per-request latency, and each mode's throughput over sync's at the same
max_running_requests (the FDFO / sync ratio). The modes are the entries of
benchmarks.common.MODES: sync and fdfo decode one block at a time (SGLang's setting), wavefront
keeps up to two blocks per request in flight.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from benchmarks.common import (
    MODES,
    add_engine_args,
    engine_kwargs,
    git_commit,
    gsm8k_questions,
    now,
    per_request_forward,
    percentile,
    positive_int,
    run_cli,
    summary,
    write_json,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, nargs="+", default=[4, 16])
    p.add_argument("--modes", nargs="+", default=["sync", "fdfo"], choices=list(MODES),
                   help="execution modes to compare (benchmarks.common.MODES)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per setting; the fastest is reported (noisy machines)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-new-tokens per prompt")
    p.add_argument("--data-path", default=None, help="GSM8K-style jsonl (default: shipped test)")
    p.add_argument("--output", default=None, help="write the JSON result here")
    return p.parse_args(argv)


Timed = tuple[list[dict[str, Any]], float, dict[str, int]]  # outputs, wall seconds, stats delta


def run_one(ns: argparse.Namespace, prompts: list[str], mode: str, mrr: int) -> dict[str, Any]:
    """One Engine per (mode, mrr); the fastest of --repeats timed runs is reported."""
    from dllm_serve import Engine

    params = {"max_new_tokens": ns.max_new_tokens, "temperature": 0.0,
              "ignore_eos": ns.ignore_eos}
    with Engine(**engine_kwargs(ns), **MODES[mode], max_running_requests=mrr,
                log_level="warning") as engine:
        # Warm-up on every measured prompt for one block: prefill shapes compile (Triton) and
        # every batch size the timed runs reach has been seen once.
        engine.generate(prompts, {**params, "max_new_tokens": 1})
        timed = [timed_run(engine, prompts, params, f"{mode} mrr={mrr} #{i + 1}")
                 for i in range(ns.repeats)]
    outs, wall, stats = min(timed, key=lambda t: t[1])
    return {**summarize(mode, mrr, outs, wall, stats), "wall_s_repeats": [t[1] for t in timed]}


def timed_run(engine: Any, prompts: list[str], params: dict[str, Any], desc: str) -> Timed:
    before = engine.get_server_info()["stats"]
    t0 = now()
    outs, t1 = generate_with_progress(engine, prompts, params, desc)
    wall = t1 - t0
    after = engine.get_server_info()["stats"]
    return outs, wall, {k: after[k] - before[k] for k in after}


def generate_with_progress(engine: Any, prompts: list[str], params: dict[str, Any],
                           desc: str) -> tuple[list[dict[str, Any]], float]:
    """One `generate` call for all prompts (SGLang's offline shape), with a progress bar fed by
    the number of requests still pending at the front. Returns the outputs and the clock when
    `generate` returned (taken in its thread, so the bar's polling does not round it up)."""

    def generate() -> tuple[list[dict[str, Any]], float]:
        outs = engine.generate(prompts, params)
        return outs, now()

    with ThreadPoolExecutor(max_workers=1) as pool, \
            tqdm(total=len(prompts), desc=desc, unit="req", leave=False) as bar:
        fut = pool.submit(generate)
        started = False
        while not wait([fut], timeout=0.2).done:
            pending = engine.front.num_pending()
            started = started or pending > 0
            if started:
                bar.update(len(prompts) - pending - bar.n)
        bar.update(len(prompts) - bar.n)
        return fut.result()


def summarize(mode: str, mrr: int, outs: list[dict[str, Any]], wall: float,
              stats: dict[str, int]) -> dict[str, Any]:
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    per_block = [f for m in metas for f in m["block_forwards"]]
    return {
        "mode": mode, "max_running_requests": mrr, "num_prompts": len(outs),
        "wall_s": wall, "input_tokens": sum(m["prompt_tokens"] for m in metas),
        "output_tokens": tokens, "output_throughput": tokens / wall,
        "request_throughput": len(outs) / wall,
        "e2e_latency_s": summary([m["e2e_latency"] for m in metas]),
        "time_to_first_block_s": summary([m["time_to_first_block"] for m in metas]),
        "tokens_per_forward": tokens / max(1, sum(per_block)),
        "tokens_per_request_forward": per_request_forward(
            tokens, [m.get("denoise_steps") for m in metas]),
        "forwards_per_block_mean": statistics.fmean(per_block) if per_block else 0.0,
        "forwards_per_block_p50": percentile(per_block, 50),
        "forwards_per_block_p90": percentile(per_block, 90),
        "forwards_per_block": per_block,
        "denoise_forwards": stats["forwards"] - stats["prefill_rounds"],
        "rounds": stats["rounds"], "inplace_reloops": stats["inplace_reloops"],
        "request_steps": stats["request_steps"],
        "wasted_request_steps": stats["wasted_request_steps"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    prompts = gsm8k_questions(ns.num_prompts, ns.data_path)
    grid = [(mode, mrr) for mrr in ns.max_running_requests for mode in ns.modes]
    runs = []
    for mode, mrr in (bar := tqdm(grid, desc="offline", unit="run")):
        bar.set_postfix_str(f"{mode} mrr={mrr}")
        runs.append(run_one(ns, prompts, mode, mrr))
    ratios = ratios_over_sync(runs)
    print_table(runs, ratios)
    result = {"benchmark": "offline_throughput", "config": vars(ns), "git_commit": git_commit(),
              "runs": runs, "fdfo_over_sync": ratios.get("fdfo", {}), "over_sync": ratios}
    write_json(ns.output, result)
    return result


def ratios_over_sync(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{mode: {max_running_requests: throughput / sync's}} for every mode but sync."""
    by = {(r["mode"], r["max_running_requests"]): r["output_throughput"] for r in runs}
    out: dict[str, dict[str, float]] = {}
    for (mode, m), tput in by.items():
        if mode != "sync" and ("sync", m) in by:
            out.setdefault(mode, {})[str(m)] = tput / by[("sync", m)]
    return out


def print_table(runs: list[dict[str, Any]], ratios: dict[str, dict[str, float]]) -> None:
    print(f"{'mode':<9} {'mrr':>4} {'tok/s':>9} {'TPF':>6} {'TPF/req':>7} {'fwd/blk':>8} "
          f"{'wasted':>8} {'p50 e2e s':>9} {'s':>7}")
    for r in runs:
        per_req = r["tokens_per_request_forward"]
        print(f"{r['mode']:<9} {r['max_running_requests']:>4} {r['output_throughput']:>9.1f} "
              f"{r['tokens_per_forward']:>6.2f} "
              f"{(f'{per_req:.2f}' if per_req is not None else 'n/a'):>7} "
              f"{r['forwards_per_block_mean']:>8.2f} {r['wasted_request_steps']:>8} "
              f"{r['e2e_latency_s']['median']:>9.2f} {r['wall_s']:>7.2f}")
    for mode, by_mrr in ratios.items():
        for mrr, ratio in by_mrr.items():
            print(f"{mode} / sync at max_running_requests {mrr}: {ratio:.2f}x")


if __name__ == "__main__":
    run_cli(main)
