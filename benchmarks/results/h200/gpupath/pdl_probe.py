"""Does programmatic dependent launch (PDL) shorten a CUDA graph of small dependent kernels?

A probe, not part of the project (its result is in pdl_probe_67cbcde.json): a chain of 400
Triton kernels, each reading what the one before wrote (y = x + 1, two buffers in turn),
captured in one CUDA graph, timed per kernel with plain launches, with PDL (`launch_pdl=True`,
`gdc_wait()` first), and with PDL plus an early `gdc_launch_dependents()`; the chain's final
value (400) checks that the order held.

    python3 benchmarks/results/h200/gpupath/pdl_probe.py out.json
"""

import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

KERNELS = 400


@triton.jit
def _chain(X, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(Y + i, tl.load(X + i, mask=m) + 1.0, mask=m)


def time_chain(n: int, programs: int, pdl: bool, early: bool) -> tuple[float, float]:
    """(median us per kernel over 20 replays, the chain's final value)."""
    bufs = [torch.zeros(n, device="cuda") for _ in range(2)]
    block = triton.next_power_of_2(triton.cdiv(n, programs))

    def chain() -> None:
        for j in range(KERNELS):
            _chain[(triton.cdiv(n, block),)](bufs[j % 2], bufs[(j + 1) % 2], n, BLOCK=block,
                                             PDL=pdl, EARLY=early, launch_pdl=pdl)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for b in bufs:
        b.zero_()
    graph.replay()
    torch.cuda.synchronize()
    value = bufs[KERNELS % 2][0].item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] * 1000 / KERNELS, value


def main() -> None:
    print("triton", triton.__version__, "torch", torch.__version__, torch.version.cuda)
    results = {}
    for n, programs in [(4096, 1), (65536, 16), (1 << 20, 132), (1 << 22, 1024)]:
        for pdl, early in [(False, False), (True, False), (True, True), (False, False)]:
            us, value = time_chain(n, programs, pdl, early)
            key = f"n{n}_p{programs}_pdl{int(pdl)}_early{int(early)}"
            results[key] = us  # the plain launch runs twice: the second is kept
            print(f"{key}: {us:.3f} us/kernel (value {value}, expect {KERNELS})")
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
