"""Compile the project's Triton kernels for sm_90 on a machine without a GPU and summarise what
the compiler made of their loops: shared memory, the async-copy waits (how many copy groups
stay in flight), wgmma / mma dots, and the scf.for / scf.if count. A probe, not part of the
project: it shows whether a loop is pipelined (and, for `tl.range(flatten=True)`, flattened)
before a device call measures it. Needs only triton (the GPU machine's version, 3.6, for the
same passes: `pip install triton==3.6.0` in a separate environment) and torch for the imports.

    python benchmarks/results/h200/gpupath/sm90_compile.py [--dump DIR]

The LM head both ways, one program a tile and persistent (HeadLaunch.persistent, served past 64
rows since 2026-12-06): its flattened loop shows as one pipelined scf.for (plus an unpipelined
copy the flattening keeps for an empty inner loop). The expert GEMMs' persistent variants were
tried_flat_persistent_632e3e4.patch (this script at 17e0903 compiles them with it applied).
"""

import argparse
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from dllm_serve.kernels import fused_moe, lm_head  # noqa: E402


def build(fn, signature: dict, constexprs: dict, warps: int, stages: int,
          div16: tuple = ()) -> object:
    """triton.compile for sm_90; pointers and the `div16` ints get the divisibility hint the
    JIT gives 16-aligned arguments."""
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, ty in signature.items()
             if ty.startswith("*") or n in div16}
    src = ASTSource(fn=fn, signature={n: signature.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def summary(kernel) -> str:
    ir = kernel.asm["ttgir"]
    waits = re.findall(r"async_wait[^\n]*num = (\d+)", ir)
    return (f"smem {kernel.metadata.shared} waits {waits} "
            f"copies {ir.count('async_copy_global_to_local')} "
            f"wgmma {ir.count('warp_group_dot ')} mma {ir.count('tt.dot ')} "
            f"scf.for {ir.count('scf.for')} scf.if {ir.count('scf.if')}")


GEMM = {"SortedRows": "*i32", "BlockExpert": "*i32", "NumSlots": "*i32", "stride_we": "i32",
        "max_blocks": "i32", "all_blocks": "i32", "num_rows": "i32", "hidden": "i32",
        "inter": "i32"}
DOWN = {"H": "*bf16", "W2": "*bf16", "WShared": "*bf16", "Y": "*bf16", "num_shared": "i32",
        **GEMM}
UP = {"X": "*bf16", "W13": "*bf16", "WShared": "*bf16", "H": "*bf16", "num_tokens": "i32",
      **GEMM}
HEAD = {"H": "*bf16", "W": "*bf16", "Order": "*i32", "Count": "*i32", "PartMax": "*fp32",
        "PartIdx": "*i32", "PartSum": "*fp32", "rows": "i32", "vocab": "i32", "width": "i32",
        "mask_id": "i32", "tiles": "i32"}
MOE_CONST = {"BLOCK_MAJOR": True, "DIRECT_K": 0, "DIRECT_KP": 1, "DOT_F32": False}
CASES = [  # (name, kernel, signature, constexprs, warps, stages, div16)
    *[(f"down bm{bm} bn{bn} bk{bk} w{w} s{s}", fused_moe._down_kernel, DOWN,
       dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **MOE_CONST), w, s,
       ("stride_we", "hidden", "inter"))
      for bm, bn, bk, w, s in ((32, 64, 128, 4, 3), (64, 128, 64, 8, 3))],
    ("up bm64 bn64 bk64 w4 s3", fused_moe._up_kernel, UP,
     dict(TOP_K=8, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, **MOE_CONST), 4, 3,
     ("stride_we", "hidden", "inter")),
    *[(f"head bm128 bn256 bk64 w8 s{s} persistent={p}", lm_head._head_kernel, HEAD,
       dict(ROUND=True, IEEE=False, EVEN_K=True, PERSISTENT=p, BLOCK_M=128, BLOCK_N=256,
            BLOCK_K=64, DOT_F32=False), 8, s, ("width", "vocab"))
      for p, s in ((False, 3), (True, 4))],
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", type=Path, default=None, help="write each case's TTGIR here")
    ns = p.parse_args()
    for name, fn, sig, consts, warps, stages, div16 in CASES:
        kernel = build(fn, sig, consts, warps, stages, div16)
        print(f"{name}: {summary(kernel)}", flush=True)
        if ns.dump:
            ns.dump.mkdir(parents=True, exist_ok=True)
            (ns.dump / (re.sub(r"\W+", "_", name) + ".ttgir")).write_text(kernel.asm["ttgir"])


if __name__ == "__main__":
    main()
