"""Launch-configuration sweep of the fused step kernel (argmax + softmax confidence).

    python benchmarks/step_tune.py --out results/step_tune.json

One denoise round's step at LLaDA2.0-mini's vocabulary (157,184, bf16 logits): B blocks of 32
tokens, logits read once. Per launch configuration (vocabulary entries per loop step, warps,
pipeline stages, programs per SM wanted, which sets the vocabulary splits; a swept
entries-per-step value serves split and whole rows alike) it reports the time
per call (median over --iters of --launches back-to-back calls between CUDA events) and the
achieved logits bandwidth, and checks x and p against the default configuration's. The
kernel's launch constants are module globals of kernels/step.py; this script sets them for
each row and restores them. The first row of each batch size is the module's defaults.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json
from benchmarks.round_roofline import time_ms
from dllm_serve.kernels import step
from dllm_serve.kernels.runtime import num_sms

VOCAB, MASK_ID, BLOCK = 157184, 156895, 32
KNOBS = ("BLOCK_V_SPLIT", "BLOCK_V_WHOLE", "NUM_WARPS", "NUM_STAGES", "PROGRAMS_PER_SM")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    p.add_argument("--block-v", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[4, 8])
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--iters", type=int, default=20, help="timed repetitions (median)")
    p.add_argument("--launches", type=int, default=20, help="back-to-back calls per timing")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="JSON results")
    return p.parse_args(argv)


def measure(logits: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], ns: argparse.Namespace,
            ) -> tuple[float, bool]:
    """(ms per call, same x and p as the reference) with the module's current constants."""
    x, p = step.argmax_confidence(logits, MASK_ID)
    same = bool(torch.equal(x, ref[0])) and bool(torch.allclose(p, ref[1], rtol=1e-5, atol=0))

    def calls() -> None:
        for _ in range(ns.launches):
            step.argmax_confidence(logits, MASK_ID)

    return time_ms(calls, 2, ns.iters, logits.device) / ns.launches, same


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    dev = torch.device(ns.device)
    default = {k: getattr(step, k) for k in KNOBS}
    rows: list[dict[str, Any]] = []
    try:
        for b in ns.batch_sizes:
            gen = torch.Generator(device=dev).manual_seed(b)
            logits = (4 * torch.randn(b * BLOCK, ns.vocab, generator=gen, device=dev)
                      ).to(torch.bfloat16)
            ref = step.argmax_confidence(logits, MASK_ID)
            gb = logits.numel() * logits.element_size() / 1e9
            configs = [None, *itertools.product(ns.block_v, ns.warps, ns.stages,
                                                 ns.programs_per_sm)]
            for config in configs:
                values = default if config is None else dict(
                    zip(KNOBS, (config[0], *config), strict=True))
                for k, v in values.items():
                    setattr(step, k, v)
                ms, same = measure(logits, ref, ns)
                splits = step.choose_splits(b * BLOCK, ns.vocab, num_sms(dev))
                row = {"B": b, **{k.lower(): v for k, v in values.items()}, "splits": splits,
                       "ms": ms, "gb_per_s": gb / ms * 1e3, "same": same,
                       "default": config is None}
                rows.append(row)
                print(f"B={b:3d} {_knobs(row)} splits={splits:2d}: {1e3 * ms:8.1f} us  "
                      f"{row['gb_per_s']:7.0f} GB/s{'' if same else '  MISMATCH'}"
                      f"{'  (default)' if config is None else ''}")
            best = min((r for r in rows if r["B"] == b and r["same"]), key=lambda r: r["ms"])
            base = next(r for r in rows if r["B"] == b and r["default"])
            print(f"B={b:3d} best: {_knobs(best)} {1e3 * best['ms']:.1f} us "
                  f"(default {1e3 * base['ms']:.1f} us)")
    finally:
        for k, v in default.items():
            setattr(step, k, v)
    result = {"benchmark": "step_tune", "vocab": ns.vocab, "default": default, "rows": rows}
    if ns.out:
        write_json(ns.out, result)
    return result


def _knobs(row: dict[str, Any]) -> str:
    return " ".join(f"{k.lower()}={row[k.lower()]}" for k in KNOBS)


if __name__ == "__main__":
    main()
