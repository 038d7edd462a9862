"""FlowBlock wavefront sweep: accuracy, tokens per forward and forwards per request for each
wavefront size W and spawn threshold theta, on held-out generated problems (issue 7).

    python -m benchmarks.wavefront_sweep --sizes 1 2 3 --thetas 0.1 0.3 0.6 0.9 \
        --num-problems 256 --output results/wavefront_sweep.json

Every setting runs the same prompts at temperature 0 through an in-process Engine (default:
the built-in trained model, JointThreshold). W = 1 is block-by-block decoding (theta unused).
TPF here is per request-forward: completion tokens / denoise forwards the request took part in,
so a forward that advances two blocks of a request counts once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from benchmarks.common import (
    add_engine_args,
    engine_kwargs,
    git_commit,
    now,
    positive_int,
    run_cli,
    write_json,
)
from training.evaluate import held_out_problems, score


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.set_defaults(dllm_algorithm="JointThreshold")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--thetas", type=float, nargs="+", default=[0.1, 0.3, 0.6, 0.9])
    p.add_argument("--num-problems", type=positive_int, default=256)
    p.add_argument("--seed", type=int, default=1, help="held-out problem seed (training: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--gated-spawn", action=argparse.BooleanOptionalAction, default=None,
                   help="W > 1: the next block waits in a row and the device opens it when its "
                   "frontier is ready (--dllm-gated-spawn), or (--no-gated-spawn) the host "
                   "opens it; default: as the server (gated on CUDA, the host on the CPU)")
    p.add_argument("--standby", action="store_true",
                   help="W = 1: the next block waits in a row and starts in its predecessor's "
                   "final forward (--dllm-standby)")
    p.add_argument("--output", default=None, help="write the JSON result here")
    return p.parse_args(argv)


def settings(ns: argparse.Namespace) -> list[tuple[int, float | None]]:
    return [(w, None) if w == 1 else (w, t) for w in ns.sizes
            for t in ([None] if w == 1 else ns.thetas)]


def run_one(ns: argparse.Namespace, prompts: list[str], answers: list[int], size: int,
            theta: float | None) -> dict[str, Any]:
    from dllm_serve import Engine

    extra: dict[str, Any] = {} if theta is None else {"dllm_spawn_threshold": theta}
    with Engine(**engine_kwargs(ns), dllm_wavefront_size=size, log_level="warning",
                dllm_gated_spawn=ns.gated_spawn, dllm_standby=ns.standby,
                max_running_requests=ns.max_running_requests, **extra) as engine:
        t0 = now()
        outs = engine.generate(prompts, {"max_new_tokens": ns.max_new_tokens, "temperature": 0})
        wall = now() - t0
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    forwards = [m["denoise_steps"] for m in metas]
    return {"wavefront_size": size, "spawn_threshold": theta,
            "gated": "auto" if ns.gated_spawn is None else size > 1 and ns.gated_spawn,
            "standby": size == 1 and ns.standby,
            **score([o["text"] for o in outs], answers),
            "tokens_per_forward": tokens / max(1, sum(forwards)),
            "forwards_per_request_mean": statistics.fmean(forwards),
            "output_tokens": tokens, "wall_s": wall, "output_throughput": tokens / wall,
            "edit_blocks": sum(e > 0 for m in metas for e in m["block_edits"]),
            "blocks": sum(m["blocks"] for m in metas)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    held = held_out_problems(ns.num_problems, ns.seed)
    runs = [run_one(ns, held.prompts, held.answers, w, t)
            for w, t in tqdm(settings(ns), desc="wavefront sweep", unit="setting")]
    print(f"{'W':>2} {'theta':>6} {'exact':>6} {'TPF':>6} {'fwd/req':>8} {'tok/s':>8}")
    for r in runs:
        theta = "-" if r["spawn_threshold"] is None else f"{r['spawn_threshold']:.1f}"
        print(f"{r['wavefront_size']:>2} {theta:>6} {r['exact_match']:>6.3f} "
              f"{r['tokens_per_forward']:>6.2f} {r['forwards_per_request_mean']:>8.2f} "
              f"{r['output_throughput']:>8.1f}")
    result = {"config": vars(ns), "git_commit": git_commit(), "runs": runs}
    write_json(ns.output, result)
    return result


if __name__ == "__main__":
    run_cli(main)
