"""The MoE choice sum with the next layer's input norm fused (kernels/moe_sum.py
`sum_choices(..., norm=...)`, one program a row) under several warp counts, against the sum
without it followed by the RMSNorm kernel; 32 / 128 / 512 / 2048 tokens of LLaDA2.0-mini
(top-8, the shared expert's rows and the residual as addends), CUDA graphs of 20 calls:

    python3 benchmarks/results/h200/gpupath/sumnorm_probe.py sumnorm_probe.json

The warps are set through moe_sum's SUM_NORM_MAX_WARPS, with SUM_NORM_COLUMNS_PER_WARP at 1
(restored after; at 188c17b a fixed SUM_NORM_WARPS)."""
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import dllm_serve.kernels.moe_sum as fm
from benchmarks.round_roofline import graphed, time_ms
from dllm_serve.kernels.norm import fused_rms_norm


def graph_us(fn, n=20, iters=15):
    """Microseconds per call of fn() replayed n times in one CUDA graph."""
    burst = graphed(lambda: [fn() for _ in range(n)], torch.device("cuda"))
    return 1e3 * time_ms(burst, 1, iters, torch.device("cuda")) / n


def case(t, dev):
    bf = torch.bfloat16
    y = torch.randn(t * 8, 2048, device=dev, dtype=bf)
    w = torch.rand(t, 8, device=dev)
    addends = (torch.randn(t, 2048, device=dev, dtype=bf),
               torch.randn(t, 2048, device=dev, dtype=bf))
    norm = (torch.ones(2048, device=dev, dtype=bf), 1e-6)

    def apart():
        fused_rms_norm(fm.sum_choices(y, w, bf, addends), *norm)

    row = dict(tokens=t, apart_us=graph_us(apart),
               sum_only_us=graph_us(lambda: fm.sum_choices(y, w, bf, addends)))
    ref = fused_rms_norm(fm.sum_choices(y, w, bf, addends), *norm)
    saved = fm.SUM_NORM_MAX_WARPS, fm.SUM_NORM_COLUMNS_PER_WARP
    fm.SUM_NORM_COLUMNS_PER_WARP = 1
    for warps in (1, 2, 4, 8, 16):
        fm.SUM_NORM_MAX_WARPS = warps
        row[f"fused_w{warps}_us"] = graph_us(lambda: fm.sum_choices(y, w, bf, addends, norm))
        got = fm.sum_choices(y, w, bf, addends, norm)[1]
        row[f"fused_w{warps}_equal_to_apart"] = bool(torch.equal(got, ref))
    fm.SUM_NORM_MAX_WARPS, fm.SUM_NORM_COLUMNS_PER_WARP = saved
    return row


def main(path):
    dev = torch.device("cuda")
    res = []
    for t in (32, 128, 512, 2048):
        res.append(case(t, dev))
        print(res[-1], flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
