"""The split-K GEMM of `tried_splitk_gemm_188c17b.patch` (kernels/dense_gemm.py there: a program
per N tile and slice of K, the tile's last program summing the fp32 partials) against cuBLAS at
LLaDA2.0-mini's dense shapes, 32 and 64 token rows. Each timing replays a CUDA graph of 40 GEMMs
cycling through weight copies past the L2 cache; each output is checked against the fp64
product and against a second call (deterministic). Needs the patch applied:

    git apply benchmarks/results/h200/gpupath/tried_splitk_gemm_188c17b.patch
    python3 benchmarks/results/h200/gpupath/splitk_probe.py splitk_probe.json
"""
import itertools
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from dllm_serve.layers.linear import linear

from benchmarks.round_roofline import graphed, time_ms
from dllm_serve.kernels import dense_gemm as dg

SHAPES = {"qkv": (3072, 2048, None), "o": (2048, 2048, None),
          "router3": (768, 2048, torch.float32), "dense_gate_up": (10240, 2048, None),
          "dense_down": (2048, 5120, None)}


def graph_us(fn, launches=40, iters=15):
    """Microseconds per call of fn(i), i = 0..launches-1 replayed as one CUDA graph."""
    burst = graphed(lambda: [fn(i) for i in range(launches)], torch.device("cuda"))
    return 1e3 * time_ms(burst, 1, iters, torch.device("cuda")) / launches


def sweep(rows, name, n, k, out_dtype, dev):
    copies = max(2, (256 << 20) // (n * k * 2))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    exact = x.double() @ ws[0].double().t()
    cublas = graph_us(lambda i: linear(x, ws[i % copies], None, out_dtype))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = []
    for bn, bk in itertools.product((32, 64), (128, 256)):
        dg.LAUNCH = dg.GemmLaunch(bn, bk, 4, 3)
        got = dg.splitk_linear(x, ws[0], None, out_dtype)
        err = float(((got.double() - exact).abs() / (exact.abs() + 1e-2)).max())
        us = graph_us(lambda i: dg.splitk_linear(x, ws[i % copies], None, out_dtype))
        same = bool(torch.equal(dg.splitk_linear(x, ws[0], None, out_dtype), got))
        out.append(dict(name=name, rows=rows, n=n, k=k, block_n=bn, block_k=bk,
                        programs_per_sm=dg.PROGRAMS_PER_SM, stages=3,
                        splits=dg.choose_splits(-(-n // bn), k, min(bk, k), sms), us=us,
                        rel_err=err, deterministic=same, cublas_us=cublas,
                        floor_us=n * k * 2 / 4.17e6))
    return out


def main(path):
    dev = torch.device("cuda")
    res = []
    for rows in (32, 64):
        for name, (n, k, out_dtype) in SHAPES.items():
            rows_ = sweep(rows, name, n, k, out_dtype, dev)
            best = min(rows_, key=lambda r: r["us"])
            print(f"{name} rows {rows}: cublas {best['cublas_us']:.2f} us, best "
                  f"{best['us']:.2f} ({best['block_n']}, {best['block_k']}, {best['splits']} "
                  f"splits)", flush=True)
            res += rows_
    dg.LAUNCH = dg.GemmLaunch()
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
