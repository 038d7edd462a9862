"""Held-out accuracy of a trained small dLLM through dllm_serve.Engine, per decoding algorithm.

    python scripts/eval_small_dllm.py --model-path runs/small/model --num-problems 256 \
        --output runs/small/eval.json

Per algorithm (LowConfidence and JointThreshold by default, each with its default settings or
--algorithm-config NAME=FILE.yaml), at temperature 0: exact-match accuracy on generated problems
that the training run never saw, the distribution of forwards per committed block, and (when
the engine reports `block_edits`) the share of committed blocks with a T2T edit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import positive_int, run_cli  # noqa: E402
from training.data import DataConfig  # noqa: E402
from training.evaluate import (  # noqa: E402
    HeldOut,
    edits_summary,
    forwards_summary,
    held_out_problems,
    score,
)

DEMO = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="checkpoint (default: the built-in model)")
    p.add_argument("--algorithms", nargs="+", default=["LowConfidence", "JointThreshold"])
    p.add_argument("--algorithm-config", action="append", default=[], metavar="NAME=FILE",
                   help="YAML settings for one algorithm (repeatable)")
    p.add_argument("--num-problems", type=positive_int, default=256)
    p.add_argument("--seed", type=int, default=DataConfig().eval_seed,
                   help="seed of the held-out problems (training used --train-seed)")
    p.add_argument("--train-seed", type=int, default=DataConfig().seed)
    p.add_argument("--train-count", type=int, default=DataConfig().num_generated,
                   help="generated problems of the training pool (excluded from the set)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--dllm-wavefront-size", type=int, default=None,
                   help="wavefront size W (default: the engine's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--output", type=Path, default=None, help="write the JSON result here")
    return p.parse_args()


def run_algorithm(ns: argparse.Namespace, name: str, configs: dict[str, str],
                  held: HeldOut) -> dict[str, Any]:
    from dllm_serve import Engine

    params = {"max_new_tokens": ns.max_new_tokens, "temperature": 0.0}
    with Engine(model_path=ns.model_path, dllm_algorithm=name,
                dllm_algorithm_config=configs.get(name), device=ns.device, dtype=ns.dtype,
                max_running_requests=ns.max_running_requests, log_level="warning",
                **wavefront_kwargs(ns)) as engine:
        start = time.monotonic()
        outs = engine.generate(held.prompts, params)
        wall = time.monotonic() - start
        demo = engine.generate(DEMO, params)["text"]
    texts, metas = [o["text"] for o in outs], [o["meta_info"] for o in outs]
    return {"algorithm": name, "config": configs.get(name), **score(texts, held.answers),
            "forwards_per_block": forwards_summary([f for m in metas
                                                    for f in m["block_forwards"]]),
            "t2t_edits": edits_summary(metas), "wall_s": wall,
            "completion_tokens": sum(m["completion_tokens"] for m in metas),
            "demo": demo, "samples": [{"prompt": p, "text": t, "answer": a} for p, t, a in
                                      zip(held.prompts[:5], texts[:5], held.answers[:5],
                                          strict=True)]}


def wavefront_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.dllm_wavefront_size is None:
        return {}
    return {"dllm_wavefront_size": ns.dllm_wavefront_size}


def report(r: dict[str, Any]) -> None:
    fpb = r["forwards_per_block"]
    print(f"\n== {r['algorithm']} ==")
    print(f"exact match {r['exact_match']:.3f}  strict {r['strict_match']:.3f}  "
          f"({r['completion_tokens']} tokens in {r['wall_s']:.1f} s)")
    if fpb["blocks"]:
        print(f"forwards per block: mean {fpb['mean']:.2f}  p10 {fpb['p10']}  p50 {fpb['p50']}  "
              f"p90 {fpb['p90']}  min {fpb['min']}  max {fpb['max']}  over {fpb['blocks']} blocks")
        print(f"  histogram {fpb['histogram']}")
    edits = r["t2t_edits"]
    print("T2T edits: " + ("not reported by this engine (meta_info has no block_edits)"
                           if edits is None else json.dumps(edits)))
    print(f"demo: {DEMO!r} -> {r['demo']!r}")
    for s in r["samples"][:3]:
        print(f"  [{s['answer']}] {s['text']!r}")


def main() -> None:
    ns = parse_args()
    configs = dict(c.split("=", 1) for c in ns.algorithm_config)
    held = held_out_problems(ns.num_problems, ns.seed, ns.train_seed, ns.train_count)
    results = [run_algorithm(ns, name, configs, held) for name in ns.algorithms]
    for r in results:
        report(r)
    if ns.output is not None:
        ns.output.parent.mkdir(parents=True, exist_ok=True)
        ns.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(ns).items()},
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    run_cli(main)
