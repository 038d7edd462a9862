"""The fused LM head + greedy prediction (kernels/lm_head.py) against the LM head's cuBLAS GEMM
into bf16 logits + the fused step kernel (kernels/step.py), at LLaDA2.0-mini's head (vocabulary
157,184, hidden 2,048, bf16), for T = 32 .. 2048 rows (B = 1 .. 64 blocks of 32) with every row
asked and with half of them (random), each launch variant timed in a CUDA graph of 10 calls
(median of 15 replays after 3) and its x checked against the baseline's:

    python3 benchmarks/results/h200/gpupath/lm_head_probe.py lm_head_probe.json
"""
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.round_roofline import graphed, time_ms
from dllm_serve.kernels.lm_head import HeadLaunch, head_greedy
from dllm_serve.kernels.step import argmax_confidence

V, H, MASK = 157184, 2048, 156895
VARIANTS = [HeadLaunch(*v) for v in (
    (64, 128, 128, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (64, 256, 128, 8, 3),
    (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
    (128, 128, 128, 8, 3))]


def timed(fn, dev, n=10):
    f = graphed(lambda: [fn() for _ in range(n)], dev)
    return 1e3 * time_ms(f, 3, 15, dev) / n


def main(out):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16)
    res = []
    for t in (32, 128, 512, 1024, 2048):
        h = torch.randn(t, H, device=dev).to(torch.bfloat16)
        logits = torch.empty(t, V, device=dev, dtype=torch.bfloat16)

        def base(h=h, logits=logits):
            torch.mm(h, w.t(), out=logits)
            return argmax_confidence(logits, MASK)
        bx, bp = base()
        gemm_us = timed(lambda h=h, logits=logits: torch.mm(h, w.t(), out=logits), dev)
        base_us = timed(base, dev)
        print(f"T={t}: cuBLAS GEMM {gemm_us:.1f} us, + step {base_us:.1f} us", flush=True)
        res.append(dict(rows=t, variant="cublas+step", us=base_us, gemm_us=gemm_us))
        half = torch.rand(t, device=dev) < 0.5
        for v in VARIANTS:
            for frac, rows in ((1.0, None), (0.5, half)):
                try:
                    x, p = head_greedy(h, w, MASK, rows, launch=v)
                    asked = torch.ones(t, dtype=torch.bool, device=dev) if rows is None else rows
                    agree = (x[asked] == bx[asked]).float().mean().item()
                    perr = (p[asked] - bp[asked]).abs().max().item()
                    us = timed(lambda v=v, rows=rows, h=h: head_greedy(h, w, MASK, rows, launch=v),
                               dev)
                except Exception as e:  # noqa: BLE001
                    print(t, v, frac, "failed", type(e).__name__, str(e)[:200], flush=True)
                    continue
                row = dict(rows=t, asked=frac, variant=[v.block_m, v.block_n, v.block_k,
                                                        v.num_warps, v.num_stages],
                           us=us, x_agree=agree, p_max_err=perr, vs_base=us / base_us)
                res.append(row)
                print("  ", row, flush=True)
        json.dump(res, open(out, "w"), indent=1)
    for t in (32, 128, 512, 1024, 2048):
        for frac in (1.0, 0.5):
            rows = sorted((r for r in res if r["rows"] == t and r.get("asked") == frac),
                          key=lambda r: r["us"])
            if rows:
                print(f"T={t} asked {frac}: best {rows[0]['variant']} {rows[0]['us']:.1f} us "
                      f"({rows[0]['vs_base']:.2f}x the cuBLAS + step)")


if __name__ == "__main__":
    main(sys.argv[1])
