"""The grouped expert GEMMs' launch configurations (kernels/fused_moe.py): `MoeLaunch` and the
table `MOE_LAUNCHES` that picks one per GEMM by the number of assignments (benchmarks/moe_tune.py
measures the candidates and prints rows in the table's form)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeLaunch:
    """Output columns (block_n) and reduction step (block_k) per program, warps and pipeline
    stages of one grouped-GEMM launch, and the programs' order: `block_major` runs a block's
    N tiles at consecutive program ids (the block's input rows read once through L2), else
    one N tile's blocks (each N tile re-reads every block's input rows, which at thousands of
    rows no longer stay in L2). Any values are correct (loads and stores are masked); they
    only change speed."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_major: bool = False


DEFAULT_LAUNCH = MoeLaunch(block_n=64, block_k=64, num_warps=4, num_stages=3)

# The launch table, the one place to edit after benchmarks/moe_tune.py (which prints rows in
# this form): (most assignments T * top_k, up launch, down launch), the first row whose bound
# holds a batch's assignments. Assignments are fixed per CUDA-graph bucket, so each bucket has
# its launches. Measured at LLaDA2.0-mini's expert shapes on an H200 (benchmarks/results/h200/
# gpupath/moe_tune_*.json; T = 512 .. 2048 at choose_block_m's rows, moe_tune_block_m_*.json):
# 2-10% per GEMM over the default launch. Block-major past T = 512, i.e. the denoise buckets
# of 24 blocks and more and prefill chunks past 512 tokens (moe_tune_block_major_21c82dc.json:
# down 178 against 214 us a layer at T = 2048, 147-155 against 161-167 at 1024; in rounds
# B = 32 / 64 0.2-0.6 ms faster, B = 16 equal, B = 1 / 4 0.1-0.2 ms slower: roofline_ab_block_
# major_21c82dc.json; B = 24 not measured). A launch that does not fit the device's shared
# memory at a batch's BLOCK_M falls back to DEFAULT_LAUNCH (fused_moe.py's _run_fitting).
# T = 512 (the 16-block denoise bucket, 512-token prefill chunks): up 128 x 128 at 8 warps and
# a block-major down (moe_tune_blockk_7b07470.json: 263.5 / 146.0 against 278.3 / 151.0 us a
# layer), B = 16 rounds at ~1k 9.81-9.83 against 10.01-10.03 ms (runtime/run76_moe_t512_
# 7b07470, in turns); at T = 256 (B = 8) the same launches ran 0.1 ms slower, so it keeps its
# own row. Block-k 256 / 512 were slower at both sizes (the same sweep).
MOE_LAUNCHES: tuple[tuple[int, MoeLaunch, MoeLaunch], ...] = (
    (256,  # T = 32: up, down
     MoeLaunch(block_n=64, block_k=128, num_warps=4, num_stages=4),
     MoeLaunch(block_n=256, block_k=64, num_warps=4, num_stages=3)),
    (1024,  # T = 128
     MoeLaunch(block_n=128, block_k=128, num_warps=8, num_stages=3),
     MoeLaunch(block_n=128, block_k=128, num_warps=4, num_stages=4)),
    (2048,  # T = 256 (32 rows a block)
     MoeLaunch(block_n=64, block_k=128, num_warps=4, num_stages=3),
     MoeLaunch(block_n=64, block_k=128, num_warps=8, num_stages=3)),
    (4096,  # T = 512 (32 rows a block): moe_tune_blockk_7b07470.json, rounds in run 76
     MoeLaunch(block_n=128, block_k=128, num_warps=8, num_stages=3),
     MoeLaunch(block_n=64, block_k=128, num_warps=4, num_stages=3, block_major=True)),
    (8192,  # T = 1024 (64 rows)
     MoeLaunch(block_n=64, block_k=64, num_warps=4, num_stages=3, block_major=True),
     MoeLaunch(block_n=64, block_k=64, num_warps=4, num_stages=3, block_major=True)),
    (1 << 30,  # T = 2048 and more (64 rows)
     MoeLaunch(block_n=64, block_k=64, num_warps=4, num_stages=3, block_major=True),
     MoeLaunch(block_n=128, block_k=64, num_warps=8, num_stages=3, block_major=True)),
)


def choose_moe_launches(num_assignments: int) -> tuple[MoeLaunch, MoeLaunch]:
    """(up launch, down launch) from MOE_LAUNCHES for T * top_k assignments."""
    return next((up, down) for bound, up, down in MOE_LAUNCHES if num_assignments <= bound)
