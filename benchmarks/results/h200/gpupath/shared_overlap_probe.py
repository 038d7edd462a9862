"""Does the shared expert on a side stream, beside the router and the expert sort, shorten a
MoE layer?

A probe, not part of the project (its result is in shared_overlap_probe_*.json). Served
(kernels/fused_moe.py): the shared expert is one more expert in the two grouped GEMMs, after the
router GEMM, the routing kernel and the sort, which are short launches that leave most of the
device idle. Here the shared expert (cuBLAS gate/up GEMM, the Triton SiLU-and-mul, cuBLAS down
GEMM) runs on a second stream while the router, routing and sort run, and the routed GEMMs go
without it; the choice sum adds its output. LLaDA2.0-mini's MoE shapes with random weights,
four distinct layers called in turn, eight calls captured in one CUDA graph per variant, timed
by replays (median of 20). Outputs compared against the served layer. Variants
`overlap_pf{n}_bm{b}`: the side stream then reads the first n experts' gate/up weights into L2
(the routed up GEMM's first programs' in block-major order, b = 1) while the sort runs.

    python3 benchmarks/results/h200/gpupath/shared_overlap_probe.py out.json
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from dllm_serve.kernels import fused_moe as fm  # noqa: E402
from dllm_serve.kernels.moe_launch import choose_moe_launches  # noqa: E402
from dllm_serve.kernels.moe_route import fused_route  # noqa: E402
from dllm_serve.kernels.moe_sum import sum_choices  # noqa: E402
from dllm_serve.layers.moe import SparseMoeBlock, set_moe_backend  # noqa: E402
from dllm_serve.layers.moe_router import RoutingParams  # noqa: E402

H, INTER, E, K, LAYERS, CALLS = 2048, 512, 256, 8, 4, 8
P = RoutingParams(top_k=K, score_function="sigmoid", n_group=8, topk_group=4, renormalize=True,
                  scaling=2.5)


def make_layer(gen):
    block = SparseMoeBlock(H, E, INTER, P, expert_bias=True, router_fp32=True,
                           shared_intermediate=INTER)
    block = block.cuda()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("expert_bias"):
                p.copy_(0.01 * torch.randn(p.shape, generator=gen, device="cuda"))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device="cuda"))
    block = block.bfloat16()
    block.gate.float()  # the router's weight and bias stay fp32 (LLaDA2's router_dtype)
    set_moe_backend(block, "triton")
    block.shared_experts.kernel_backend = "triton"
    return block


@triton.jit
def _touch(W, Out, n, BLOCK: tl.constexpr):
    """Read W[0:n] into L2 (kept there: evict_last); the store never happens in practice."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(W + offs, mask=offs < n, other=0.0, eviction_policy="evict_last")
    s = tl.sum(v.to(tl.float32))
    if s == 1.2345e30:
        tl.store(Out + tl.program_id(0), s)


def overlapped(block, x, residual, side, prefetch=0, block_major=False):
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        shared = block.shared_experts(x)
        if prefetch:
            n = prefetch * block.experts.w13[0].numel()
            _touch[(triton.cdiv(n, 8192),)](block.experts.w13, SINK, n, BLOCK=8192)
    ids, weights = fused_route(block.gate(x), block.gate.expert_bias, P)
    blocks = fm.expert_blocks(ids, E)
    up, down = choose_moe_launches(ids.numel())
    if block_major:
        up = dataclasses.replace(up, block_major=True)
    h = fm.up_proj(x, block.experts.w13, blocks, K, up)
    y = fm.down_proj(h, block.experts.w2, blocks, down)
    main.wait_stream(side)
    return sum_choices(y, weights, x.dtype, (shared, residual))


def graph_us(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(times[3:])


SINK = None


def one_size(b, layers, side, gen):
    """Served against overlapped MoE layers at B blocks of 32 tokens (microseconds a layer)."""
    t = 32 * b
    x = torch.randn(t, H, generator=gen, device="cuda").bfloat16()
    res = torch.randn(t, H, generator=gen, device="cuda").bfloat16()
    served = layers[0](x, res)
    mine = overlapped(layers[0], x, res, side)
    torch.cuda.synchronize()
    err = ((served.float() - mine.float()).abs().max() / served.float().abs().max()).item()

    def calls(pf=None, bm=False):
        if pf is None:
            return graph_us(lambda: [layers[i % LAYERS](x, res) for i in range(CALLS)])
        return graph_us(lambda: [overlapped(layers[i % LAYERS], x, res, side, pf, bm)
                                 for i in range(CALLS)])

    row = {"B": b, "tokens": t, "rel_err": err, "served_us": calls(), "overlap_us": calls(0)}
    for pf, bm in ((0, True), (6, True), (10, True), (14, True), (10, False)):
        row[f"overlap_pf{pf}_bm{int(bm)}_us"] = calls(pf, bm)
    row["served_us_again"] = calls()
    print(row, flush=True)
    return row


def main(out_path):
    global SINK
    SINK = torch.zeros(1 << 16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(gen) for _ in range(LAYERS)]
    side = torch.cuda.Stream()
    with torch.inference_mode():
        results = [one_size(b, layers, side, gen) for b in (1, 16, 64)]
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
