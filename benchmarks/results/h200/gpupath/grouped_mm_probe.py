"""Probe (not part of the project): PyTorch's grouped GEMM (`torch._grouped_mm`, CUTLASS's
warp-specialized TMA kernels on Hopper) for the routed experts, against the served Triton
experts, at a denoise round's large batches.

Served (kernels/fused_moe.py): sort into padded blocks, `_up_kernel` (x rows gathered in the
loads, SiLU-and-mul in the epilogue), `_down_kernel`, the choice sum; the shared expert is one
more expert of both GEMMs. Grouped: a stable argsort of the assignments by expert, x gathered
into that order (the shared expert's T rows appended as group E), one `_grouped_mm` for gate/up,
the Triton SiLU-and-mul, one `_grouped_mm` for down, its rows put back in assignment order and
the same choice sum. LLaDA2.0-mini's MoE shapes (E = 256, hidden 2048, I 512, top-8, one shared
expert) with random weights, four distinct layers called in turn, eight calls captured in one
CUDA graph per variant, timed by replays (median of 20). Also each GEMM alone (the served up /
down launches against one grouped GEMM each, same routing). Outputs compared with the served
layer.

    python3 benchmarks/results/h200/gpupath/grouped_mm_probe.py OUT.json
"""

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from dllm_serve.kernels import fused_moe as fm  # noqa: E402
from dllm_serve.kernels.moe_launch import choose_moe_launches  # noqa: E402
from dllm_serve.kernels.moe_route import fused_route  # noqa: E402
from dllm_serve.kernels.moe_sum import sum_choices  # noqa: E402
from dllm_serve.kernels.silu_mul import fused_silu_mul  # noqa: E402
from dllm_serve.layers.moe import SparseMoeBlock, set_moe_backend  # noqa: E402
from dllm_serve.layers.moe_router import RoutingParams  # noqa: E402

H, INTER, E, K, LAYERS, CALLS = 2048, 512, 256, 8, 4, 8
P = RoutingParams(top_k=K, score_function="sigmoid", n_group=8, topk_group=4, renormalize=True,
                  scaling=2.5)


def make_layer(gen):
    block = SparseMoeBlock(H, E, INTER, P, expert_bias=True, router_fp32=True,
                           shared_intermediate=INTER).cuda()
    with torch.no_grad():
        for name, p in block.named_parameters():
            scale = 0.01 if name.endswith("expert_bias") else 0.02
            p.copy_(scale * torch.randn(p.shape, generator=gen, device="cuda"))
    block = block.bfloat16()
    block.gate.float()
    set_moe_backend(block, "triton")
    block.shared_experts.kernel_backend = "triton"
    s = block.shared_experts
    # (E + 1, 2I, hidden), (E + 1, hidden, I): the shared expert as group E
    block.w13_all = torch.cat([block.experts.w13.data, s.gate_up_proj.weight.data[None]])
    block.w2_all = torch.cat([block.experts.w2.data, s.down_proj.weight.data[None]])
    return block


def grouped_plan(ids, t):
    """ids (T, K) -> (order (A,) assignments by expert, src (A + T,) token of each grouped
    row, offs (E + 1,) int32 group ends)."""
    flat = ids.flatten()
    a = flat.shape[0]
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    offs = torch.cat([counts.cumsum(0), counts.new_full((1,), a + t)]).to(torch.int32)
    src = torch.cat([order // K, torch.arange(t, device=ids.device)])
    return order, src, offs


def grouped_up(block, x, src, offs):
    gu = torch._grouped_mm(x.index_select(0, src), block.w13_all.transpose(1, 2), offs=offs)
    return fused_silu_mul(gu)  # (A + T, I)


def grouped_down(block, h, offs):
    return torch._grouped_mm(h, block.w2_all.transpose(1, 2), offs=offs)  # (A + T, hidden)


def grouped_layer(block, x, res):
    ids, weights = fused_route(block.gate(x), block.gate.expert_bias, P)
    t = x.shape[0]
    order, src, offs = grouped_plan(ids, t)
    ys = grouped_down(block, grouped_up(block, x, src, offs), offs)
    a = t * K
    y = torch.empty(a, H, dtype=x.dtype, device=x.device).index_copy_(0, order, ys[:a])
    return sum_choices(y, weights, x.dtype, (ys[a:], res))


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


def timed(name, fn, row):
    try:
        row[name] = graph_us(fn)
    except Exception as exc:  # noqa: BLE001 - a probe records what failed and goes on
        row[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"


def one_size(b, layers, gen):
    t = 32 * b
    x = torch.randn(t, H, generator=gen, device="cuda").bfloat16()
    res = torch.randn(t, H, generator=gen, device="cuda").bfloat16()
    row = {"B": b, "tokens": t}
    try:
        served = layers[0](x, res)
        mine = grouped_layer(layers[0], x, res)
        torch.cuda.synchronize()
        row["rel_err"] = ((served.float() - mine.float()).abs().max()
                          / served.float().abs().max()).item()
    except Exception as exc:  # noqa: BLE001
        row["rel_err"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    timed("served_layer_us", lambda: [layers[i % LAYERS](x, res) for i in range(CALLS)], row)
    timed("grouped_layer_us",
          lambda: [grouped_layer(layers[i % LAYERS], x, res) for i in range(CALLS)], row)
    # each GEMM alone, same routing for all layers
    ids, _ = fused_route(layers[0].gate(x), layers[0].gate.expert_bias, P)
    blocks = fm.expert_blocks(ids, E)
    up, down = choose_moe_launches(ids.numel())
    sh = [(lay.shared_experts.gate_up_proj.weight, lay.shared_experts.down_proj.weight)
          for lay in layers]
    h_served = fm.up_proj(x, layers[0].experts.w13, blocks, K, up, sh[0][0])
    timed("served_up_us", lambda: [fm.up_proj(x, layers[i % LAYERS].experts.w13, blocks, K, up,
                                              sh[i % LAYERS][0]) for i in range(CALLS)], row)
    timed("served_down_us", lambda: [fm.down_proj(h_served, layers[i % LAYERS].experts.w2,
                                                  blocks, down, sh[i % LAYERS][1], t)
                                     for i in range(CALLS)], row)
    order, src, offs = grouped_plan(ids, t)
    h_grouped = grouped_up(layers[0], x, src, offs)
    timed("grouped_up_us", lambda: [grouped_up(layers[i % LAYERS], x, src, offs)
                                    for i in range(CALLS)], row)
    timed("grouped_up_gemm_only_us",
          lambda: [torch._grouped_mm(x.index_select(0, src),
                                     layers[i % LAYERS].w13_all.transpose(1, 2), offs=offs)
                   for i in range(CALLS)], row)
    timed("grouped_down_us", lambda: [grouped_down(layers[i % LAYERS], h_grouped, offs)
                                      for i in range(CALLS)], row)
    timed("grouped_plan_us", lambda: [grouped_plan(ids, t) for _ in range(CALLS)], row)
    timed("served_sort_us", lambda: [fm.expert_blocks(ids, E) for _ in range(CALLS)], row)
    row["served_layer_us_again"] = graph_us(
        lambda: [layers[i % LAYERS](x, res) for i in range(CALLS)])
    print(json.dumps(row), flush=True)
    return row


def main(out_path):
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(gen) for _ in range(LAYERS)]
    with torch.inference_mode():
        results = [one_size(b, layers, gen) for b in (64, 32, 16, 4)]
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
