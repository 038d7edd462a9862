"""Session 33's probe: the up projection's gate and up tiles as one interleaved dot (one MMA of
2 x BLOCK_N columns per K step, `_up_one_dot` below) against the two dots of BLOCK_N columns
the served kernel runs (kernels/fused_moe.py `_up_kernel`, through `up_proj`).

At 64-row expert blocks each of the two dots re-reads the block's rows from shared memory for
only BLOCK_N output columns; the probe times both at LLaDA2.0-mini's expert shapes (random
weights, uniform top-8 routing as benchmarks/moe_tune.py draws it) for the table's up launch at
each size, then eight more launches past 256 tokens. (Session 33 ran it with the one-dot form
inside fused_moe.py and the two-dot form here; the kernels were these two.) Result: equal
within the spread (up_one_dot_probe_h100_2f304ff.json), so the served kernel kept two dots.

    python3 benchmarks/results/h200/gpupath/up_one_dot_probe.py out.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.moe_tune import Case, preset_shape  # noqa: E402
from benchmarks.round_roofline import time_ms  # noqa: E402
from dllm_serve.kernels import fused_moe as fm  # noqa: E402
from dllm_serve.kernels.fused_moe import _block_rows, _expert_weight  # noqa: E402, F401
from dllm_serve.kernels.moe_launch import MoeLaunch, choose_moe_launches  # noqa: E402
from dllm_serve.kernels.triton_utils import dot  # noqa: E402, F401


@triton.jit
def _up_one_dot(X, W13, WShared, H, SortedRows, BlockExpert, NumSlots, stride_we, max_blocks,
                all_blocks, num_rows, num_tokens, hidden, inter, TOP_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_MAJOR: tl.constexpr, DIRECT_K: tl.constexpr, DIRECT_KP: tl.constexpr,
                DOT_F32: tl.constexpr):
    """The tried form of fused_moe's `_up_kernel`: the weight tile holds gate row n, up row n,
    gate row n + 1, ... (2 BLOCK_N columns), one dot per K step, the accumulator split after."""
    expert, shared, rows, valid, n = _block_rows(SortedRows, BlockExpert, NumSlots,
                                                 max_blocks, all_blocks, num_rows, num_tokens,
                                                 inter, BLOCK_M, BLOCK_N, BLOCK_MAJOR,
                                                 DIRECT_K, DIRECT_KP)
    if expert >= 0:
        n_ok = n < inter
        tokens = tl.where(rows < num_rows, rows // TOP_K, rows - num_rows)
        w = _expert_weight(W13, WShared, expert, shared, stride_we)
        w_rows = tl.interleave(n, inter + n)  # (2 BLOCK_N,)
        w_ok = tl.interleave(n_ok, n_ok)
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < hidden
            a = tl.load(X + tokens[:, None] * hidden + kk[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w + w_rows[None, :] * hidden + kk[:, None],
                         mask=k_ok[:, None] & w_ok[None, :], other=0.0)
            acc += dot(a, wt, DOT_F32)
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        h = gate * tl.sigmoid(gate) * up
        tl.store(H + rows[:, None] * inter + n[None, :], h.to(H.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])


def up_one_dot(case: Case, launch: MoeLaunch) -> torch.Tensor:
    """`fm.up_proj` (no shared expert) with the tried kernel."""
    x, w13, blocks, k = case.x, case.w13, case.blocks, case.shape.top_k
    t, hidden, inter = x.shape[0], x.shape[1], w13.shape[1] // 2
    h = x.new_empty(t * k, inter)
    grid = (blocks.max_blocks * triton.cdiv(inter, launch.block_n),)
    _up_one_dot[grid](x, w13, w13, h, blocks.sorted_rows, blocks.block_expert,
                      blocks.num_slots, w13.stride(0), blocks.max_blocks, blocks.max_blocks,
                      t * k, t, hidden, inter, TOP_K=k, **fm.launch_args(blocks, launch))
    return h


def us(fn, iters: int = 20, launches: int = 5) -> float:
    def burst() -> None:
        for _ in range(launches):
            fn()
    return 1e3 * time_ms(burst, 2, iters, torch.device("cuda")) / launches


def main() -> None:
    shape = preset_shape("llada2-mini-shape")
    gen = torch.Generator(device="cpu").manual_seed(0)
    w13 = (0.02 * torch.randn(shape.experts, 2 * shape.inter, shape.hidden, generator=gen)
           ).to("cuda", torch.bfloat16)
    w2 = (0.02 * torch.randn(shape.experts, shape.hidden, shape.inter, generator=gen)
          ).to("cuda", torch.bfloat16)
    rows = []
    for tokens in (32, 128, 256, 512, 1024, 2048):
        case = Case(shape, tokens, w13, w2)
        table_up = choose_moe_launches(tokens * shape.top_k)[0]
        launches = [table_up]
        if tokens >= 512:
            launches += [replace(table_up, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                         for bn in (64, 128) for bk in (64,) for nw in (4, 8)
                         for ns in (3, 4)]
        for i, launch in enumerate(dict.fromkeys(launches)):
            def new(case: Case = case, launch: MoeLaunch = launch) -> torch.Tensor:
                return up_one_dot(case, launch)

            def old(case: Case = case, launch: MoeLaunch = launch) -> torch.Tensor:
                return fm.up_proj(case.x, case.w13, case.blocks, case.shape.top_k, launch)

            try:
                diff = (new().float() - old().float()).abs().max().item()
                t_new = [us(new) for _ in range(2)]
                t_old = [us(old) for _ in range(2)] if i == 0 or tokens >= 1024 else []
            except Exception as e:  # noqa: BLE001 (a launch the device refuses)
                rows.append({"tokens": tokens, "launch": asdict(launch), "error": repr(e)[:200]})
                continue
            row = {"tokens": tokens, "table": i == 0, "launch": asdict(launch),
                   "one_dot_us": min(t_new), "two_dots_us": min(t_old) if t_old else None,
                   "max_abs_diff": diff, "block_m": case.blocks.block_m}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(sys.argv[1]).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
