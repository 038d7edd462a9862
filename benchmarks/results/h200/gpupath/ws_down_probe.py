"""Probe (not part of the project): the down expert GEMM warp-specialized by Triton 3.6 on
Hopper, against the served down GEMM, at LLaDA2.0-mini's expert shapes (E = 256, top-8,
hidden 2048, inter 512, one shared expert), random top-8 routing.

Triton 3.6 splits a loop written `tl.range(..., warp_specialize=True)` into a producer warp
group issuing the bulk copies (TMA) and two consumer warp groups issuing wgmma, each on 64 of
the tile's 128 rows (sm90_compile.py-style checks: with 64-row tiles both consumers compute the
whole tile; with a plain pointer load in the loop the pass fails). Every operand in the loop must
come through a tensor descriptor, so the probe reads h in *slot order* (block b's rows are h
rows b * 128 ..), which an up GEMM would write there instead of at each assignment's row; the
probe builds that h by gathering the served h. y is stored at the assignments' rows as served,
so the choice sum is unchanged.

    python3 benchmarks/results/h200/gpupath/ws_down_probe.py OUT.json
    python benchmarks/results/h200/gpupath/ws_down_probe.py --sm90   # no GPU: triton 3.6

`--sm90` compiles the kernel for sm_90 without a GPU (as sm90_compile.py does) and prints, per
tile, whether the warp specialization applied and the consumers' accumulator shapes: with
128-row tiles two consumers of 64 rows each; with 64-row tiles both consumers hold the whole
tile (each computes it).

Prints, per token count, the served down GEMM (its launch table's launch, 64-row blocks) and
each warp-specialized launch (128-row blocks), in us a layer, the largest difference of y
against the served y, and the weights' bytes at the measured copy rate.
"""

import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from dllm_serve.kernels.fused_moe import down_proj, up_proj  # noqa: E402
from dllm_serve.kernels.moe_launch import choose_moe_launches  # noqa: E402
from dllm_serve.kernels.moe_sort import sort_by_expert  # noqa: E402

E, K, HIDDEN, INTER = 256, 8, 2048, 512


@triton.jit
def _down_ws_kernel(HDesc, WDesc, Y, SortedRows, BlockExpert, NumSlots, max_blocks, all_blocks,
                    num_rows, num_shared, num_experts, hidden,
                    inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_MAJOR: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    """y[rows] = h[block * BLOCK_M ..] @ w[expert]^T; WDesc over (E + 1) * hidden rows, the
    shared expert last."""
    if BLOCK_MAJOR:
        n_tiles = tl.cdiv(hidden, BLOCK_N)
        block = tl.program_id(0) // n_tiles
        n_tile = tl.program_id(0) % n_tiles
    else:
        block = tl.program_id(0) % all_blocks
        n_tile = tl.program_id(0) // all_blocks
    shared = block >= max_blocks
    m = tl.arange(0, BLOCK_M)
    routed = tl.minimum(block, max_blocks - 1)
    expert = tl.load(BlockExpert + routed)
    expert = tl.where(block * BLOCK_M < tl.load(NumSlots), expert, -1)
    routed_rows = tl.load(SortedRows + routed * BLOCK_M + m)
    expert = tl.where(shared, num_experts, expert)
    rows = tl.where(shared, num_rows + (block - max_blocks) * BLOCK_M + m, routed_rows)
    valid = tl.where(shared, rows < num_rows + num_shared, rows < num_rows)
    if expert >= 0:
        w_row = expert * hidden + n_tile * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, inter, BLOCK_K, warp_specialize=WS, num_stages=STAGES):
            a = HDesc.load([block * BLOCK_M, k0])
            w = WDesc.load([w_row, k0])
            acc = tl.dot(a, w.T, acc)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(Y + rows[:, None] * hidden + n[None, :], acc.to(Y.dtype.element_ty),
                 mask=valid[:, None] & (n < hidden)[None, :])


def launch_ws(hd, wd, y, blocks, all_blocks: int, t: int, bm: int, bn: int, bk: int,
              stages: int, ws: bool):
    return _down_ws_kernel[(all_blocks * triton.cdiv(HIDDEN, bn),)](
        hd, wd, y, blocks.sorted_rows, blocks.block_expert, blocks.num_slots, blocks.max_blocks,
        all_blocks, t * K, t, E, HIDDEN, INTER, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_MAJOR=True, WS=ws, STAGES=stages, num_warps=4, num_stages=stages)


def timed(fn, iters: int = 20) -> float:
    """Median us of fn over iters, CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_rate() -> float:
    """Device copy bytes (read + written) per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


def slot_h(h: torch.Tensor, blocks, t: int, all_blocks: int, bm: int) -> torch.Tensor:
    """h (A + T, I) at assignment rows -> (all_blocks * bm, I) in slot order (padding: row 0)."""
    a = t * K
    routed = blocks.sorted_rows.long()
    routed = torch.where(routed < a, routed, torch.zeros_like(routed))
    shared = a + torch.arange((all_blocks - blocks.max_blocks) * bm, device=h.device)
    shared = torch.where(shared < a + t, shared, torch.zeros_like(shared))
    return h.index_select(0, torch.cat([routed, shared])).contiguous()


def sm90() -> None:
    """Compile for sm_90 (no GPU) and summarise the warp specialization of each tile."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _down_ws_kernel
    names = list(fn.arg_names)
    for bm, bn, bk, stages in ((128, 128, 64, 3), (128, 64, 64, 4), (64, 128, 64, 3)):
        sig = {"HDesc": f"tensordesc<bf16[{bm}, {bk}]>", "WDesc": f"tensordesc<bf16[{bn}, {bk}]>",
               "Y": "*bf16", "SortedRows": "*i32", "BlockExpert": "*i32", "NumSlots": "*i32"}
        sig.update({n: "i32" for n in names if n not in sig and n[0].islower()})
        for ws in (False, True):
            const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_MAJOR=True, WS=ws,
                         STAGES=stages)
            src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                            constexprs={(names.index(k),): v for k, v in const.items()},
                            attrs={(names.index(n),): [["tt.divisibility", 16]]
                                   for n in ("Y", "SortedRows", "BlockExpert", "NumSlots",
                                             "hidden", "inter")})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 4, "num_stages": stages})
            ir = k.asm["ttgir"]
            accs = sorted(set(re.findall(r"tensor<(\d+x\d+)xf32, #mma", ir)))
            print(f"{bm}x{bn}x{bk} stages {stages} ws={ws}: warp_specialize "
                  f"{'ttg.warp_specialize(' in ir}, partitions {ir.count('partition')}, "
                  f"wgmma {ir.count('warp_group_dot ')}, accumulators {accs}, "
                  f"smem {k.metadata.shared}")


def main() -> None:
    if sys.argv[1:] == ["--sm90"]:
        sm90()
        return
    out = sys.argv[1] if len(sys.argv) > 1 else "ws_down_probe.json"
    torch.manual_seed(0)
    dev = "cuda"
    w13 = torch.randn(E, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E + 1, HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.02
    s13 = torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    rate = copy_rate()
    floor_us = w2[:E].numel() * 2 / rate * 1e6  # weights read once at the copy rate
    result = {"device": torch.cuda.get_device_name(), "copy_rate": rate,
              "weights_floor_us": floor_us, "rows": []}
    print(f"{result['device']}: copy {rate / 1e12:.2f} TB/s, down weights {floor_us:.1f} us")
    for t in (512, 1024, 2048):
        x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16)
        ids = torch.rand(t, E, device=dev).topk(K, dim=1).indices.to(torch.int32)
        up, down = choose_moe_launches(t * K)
        b64 = sort_by_expert(ids, E, 64)
        h = up_proj(x, w13, b64, K, up, s13)
        y_ref = down_proj(h, w2[:E], b64, down, w2[E], t)
        served = timed(partial(down_proj, h, w2[:E], b64, down, w2[E], t))
        row = {"tokens": t, "served_down_us": served, "served_launch": str(down), "ws": []}
        print(f"T={t}: served down {served:.1f} us ({down})")
        for bm in (128,):
            blocks = sort_by_expert(ids, E, bm)
            all_blocks = blocks.max_blocks + triton.cdiv(t, bm)
            hs = slot_h(h, blocks, t, all_blocks, bm)
            w2v = w2.view(-1, INTER)
            launches = [(bn, bk, st, True) for bn in (64, 128) for bk in (64, 128)
                        for st in (2, 3, 4)] + [(128, 64, 3, False)]
            for bn, bk, stages, ws in launches:
                y = torch.empty_like(y_ref)
                go = partial(launch_ws, TensorDescriptor.from_tensor(hs, [bm, bk]),
                             TensorDescriptor.from_tensor(w2v, [bn, bk]), y, blocks,
                             all_blocks, t, bm, bn, bk, stages, ws)
                cfg = dict(block_m=bm, block_n=bn, block_k=bk, stages=stages, ws=ws)
                try:
                    us = timed(go)
                    cfg["ws_in_ir"] = "warp_specialize" in go().asm["ttgir"]
                    diff = (y.float() - y_ref.float()).abs().max().item()
                    cfg.update(us=us, max_diff=diff)
                    print(f"  {cfg}")
                except Exception as e:  # a launch that does not fit
                    cfg.update(error=str(e)[:200])
                    print(f"  {bn}/{bk}/{stages} ws={ws}: {cfg['error'][:80]}")
                row["ws"].append(cfg)
        ok = [c for c in row["ws"] if "us" in c]
        if ok:
            best = min(ok, key=lambda c: c["us"])
            print(f"  best {best}")
        result["rows"].append(row)
        torch.cuda.synchronize()
    result["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
