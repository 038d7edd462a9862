"""Offline throughput: the same prompts through sync and FDFO at several batch sizes.

    python -m benchmarks.offline_throughput --num-prompts 64 --max-new-tokens 128 \
        --max-running-requests 4 16 --output results/offline.json

Per (mode, max_running_requests) it starts an Engine, warms it up, runs every prompt in one
`generate` call and reports output throughput, tokens per forward (TPF: output tokens / forwards
the blocks needed), forwards per committed block, denoise forwards and rounds, the request-steps
spent on blocks that were already done (sync's waste), and the FDFO / sync throughput ratio.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.common import (
    add_engine_args,
    engine_kwargs,
    git_commit,
    gsm8k_questions,
    now,
    percentile,
    write_json,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, nargs="+", default=[4, 16])
    p.add_argument("--modes", nargs="+", default=["sync", "fdfo"], choices=["sync", "fdfo"])
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-new-tokens per prompt")
    p.add_argument("--data-path", default=None, help="GSM8K-style jsonl (default: shipped test)")
    p.add_argument("--output", default=None, help="write the JSON result here")
    return p.parse_args()


def run_one(ns: argparse.Namespace, prompts: list[str], mode: str, mrr: int) -> dict[str, Any]:
    from dllm_serve import Engine

    params = {"max_new_tokens": ns.max_new_tokens, "temperature": 0.0,
              "ignore_eos": ns.ignore_eos}
    with Engine(**engine_kwargs(ns), dllm_fdfo=(mode == "fdfo"), max_running_requests=mrr,
                log_level="warning") as engine:
        engine.generate(prompts[:1], {**params, "max_new_tokens": 8})  # warm-up
        before = engine.get_server_info()["stats"]
        t0 = now()
        outs = engine.generate(prompts, params)
        wall = now() - t0
        after = engine.get_server_info()["stats"]
    return summarize(mode, mrr, outs, wall, {k: after[k] - before[k] for k in after})


def summarize(mode: str, mrr: int, outs: list[dict[str, Any]], wall: float,
              stats: dict[str, int]) -> dict[str, Any]:
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    per_block = [f for m in metas for f in m["block_forwards"]]
    return {
        "mode": mode, "max_running_requests": mrr, "num_prompts": len(outs),
        "wall_s": wall, "output_tokens": tokens, "output_throughput": tokens / wall,
        "tokens_per_forward": tokens / max(1, sum(per_block)),
        "forwards_per_block_mean": statistics.fmean(per_block) if per_block else 0.0,
        "forwards_per_block_p50": percentile(per_block, 50),
        "forwards_per_block_p90": percentile(per_block, 90),
        "forwards_per_block": per_block,
        "denoise_forwards": stats["forwards"] - stats["prefill_rounds"],
        "rounds": stats["rounds"], "inplace_reloops": stats["inplace_reloops"],
        "request_steps": stats["request_steps"],
        "wasted_request_steps": stats["wasted_request_steps"],
    }


def main() -> None:
    ns = parse_args()
    prompts = gsm8k_questions(ns.num_prompts, ns.data_path)
    runs = [run_one(ns, prompts, mode, mrr) for mrr in ns.max_running_requests
            for mode in ns.modes]
    ratios = fdfo_ratios(runs)
    print_table(runs, ratios)
    write_json(ns.output, {"config": vars(ns), "git_commit": git_commit(), "runs": runs,
                           "fdfo_over_sync": ratios})


def fdfo_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    by = {(r["mode"], r["max_running_requests"]): r["output_throughput"] for r in runs}
    return {str(m): by[("fdfo", m)] / by[("sync", m)] for (mode, m) in by
            if mode == "fdfo" and ("sync", m) in by}


def print_table(runs: list[dict[str, Any]], ratios: dict[str, float]) -> None:
    head = f"{'mode':<5} {'mrr':>4} {'tok/s':>9} {'TPF':>6} {'fwd/blk':>8} {'wasted':>8} {'s':>7}"
    print(head)
    for r in runs:
        print(f"{r['mode']:<5} {r['max_running_requests']:>4} {r['output_throughput']:>9.1f} "
              f"{r['tokens_per_forward']:>6.2f} {r['forwards_per_block_mean']:>8.2f} "
              f"{r['wasted_request_steps']:>8} {r['wall_s']:>7.2f}")
    for mrr, ratio in ratios.items():
        print(f"FDFO / sync at max_running_requests {mrr}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
