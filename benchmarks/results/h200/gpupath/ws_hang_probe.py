"""Probe (not part of the project): which warp-specialized Triton 3.6 kernels run on this GPU.

ws_down_probe.py's first warp-specialized launch never returned on an H100 (session 35), nor
did the same kernel served through fused_experts. Each case here runs in its own process with a
time limit, so a hang is recorded and the next case still runs:

    python3 benchmarks/results/h200/gpupath/ws_hang_probe.py OUT.json

1. dense: a plain 1024^3 bf16 GEMM, both operands through host tensor descriptors, the K loop
   `tl.range(..., warp_specialize=True)`, 128 x 128 x 64 tiles, 3 stages;
2. dense_if: the same with the loop under a data-dependent `if` (as the expert GEMMs skip
   unused blocks);
3. down_nows: ws_down_probe.py's kernel at T = 512 with WS=False (descriptors alone);
4. down_ws: the same with WS=True.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = ("dense", "dense_if", "down_nows", "down_ws")
LIMIT_S = 45


def run_case(name: str) -> None:
    import torch
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def gemm(ADesc, BDesc, C, Flag, n, GUARD: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        go = True
        if GUARD:
            go = tl.load(Flag + pm) > 0
        if go:
            acc = tl.zeros([BM, BN], tl.float32)
            for k in tl.range(0, n, BK, warp_specialize=True, num_stages=3):
                acc = tl.dot(ADesc.load([pm * BM, k]), tl.trans(BDesc.load([pn * BN, k])), acc)
            r = pm * BM + tl.arange(0, BM)
            c = pn * BN + tl.arange(0, BN)
            tl.store(C + r[:, None] * n + c[None, :], acc.to(tl.bfloat16))

    dev = "cuda"
    if name.startswith("dense"):
        n = 1024
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
        flag = torch.ones(n // 128, device=dev, dtype=torch.int32)
        gemm[(n // 128, n // 128)](TensorDescriptor.from_tensor(a, [128, 64]),
                                   TensorDescriptor.from_tensor(b, [128, 64]), c, flag, n,
                                   GUARD=name == "dense_if", BM=128, BN=128, BK=64,
                                   num_warps=4)
        torch.cuda.synchronize()
        err = ((c.float() - a.float() @ b.float().t()).norm() / (a.float() @ b.float().t())
               .norm()).item()
        print(json.dumps({"case": name, "rel_err": err}), flush=True)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ws_down_probe as p

    from dllm_serve.kernels.fused_moe import down_proj, up_proj
    from dllm_serve.kernels.moe_launch import choose_moe_launches
    from dllm_serve.kernels.moe_sort import sort_by_expert

    torch.manual_seed(0)
    t = 512
    w13 = torch.randn(p.E, 2 * p.INTER, p.HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(p.E + 1, p.HIDDEN, p.INTER, device=dev, dtype=torch.bfloat16) * 0.02
    s13 = torch.randn(2 * p.INTER, p.HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(t, p.HIDDEN, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(t, p.E, device=dev).topk(p.K, dim=1).indices.to(torch.int32)
    up, down = choose_moe_launches(t * p.K)
    b64 = sort_by_expert(ids, p.E, 64)
    h = up_proj(x, w13, b64, p.K, up, s13)
    y_ref = down_proj(h, w2[:p.E], b64, down, w2[p.E], t)
    blocks = sort_by_expert(ids, p.E, 128)
    all_blocks = blocks.max_blocks + triton.cdiv(t, 128)
    hs = p.slot_h(h, blocks, t, all_blocks, 128)
    y = torch.empty_like(y_ref)
    p.launch_ws(TensorDescriptor.from_tensor(hs, [128, 64]),
                TensorDescriptor.from_tensor(w2.view(-1, p.INTER), [128, 64]), y, blocks,
                all_blocks, t, 128, 128, 64, 3, name == "down_ws")
    torch.cuda.synchronize()
    print(json.dumps({"case": name, "max_diff": (y.float() - y_ref.float()).abs().max().item()}),
          flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        run_case(sys.argv[2])
        return
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "cases": []}
    for name in CASES:
        t0 = time.monotonic()
        try:
            done = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True,
                                  text=True, timeout=LIMIT_S)
            row = {"case": name, "rc": done.returncode, "s": time.monotonic() - t0,
                   "stdout": done.stdout[-400:], "stderr": done.stderr[-600:]}
        except subprocess.TimeoutExpired:
            row = {"case": name, "hung": True, "s": LIMIT_S}
        print(row, flush=True)
        out["cases"].append(row)
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
