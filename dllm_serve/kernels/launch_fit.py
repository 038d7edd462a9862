"""Launch tables meet smaller GPUs: run the first launch of a list that the device can hold.

The kernels' launch tables (kernels/moe_launch.py, kernels/lm_head.py) are tuned on an H100 /
H200, whose programs may use up to 227 KB of shared memory. On a device with less, Triton's
compile of a launch that needs more fails with OutOfResources before anything runs; the next
launch of the list is then tried. Each failure is remembered per (kernel key, launch), so later
calls (and CUDA-graph captures) go straight to a launch that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from triton.runtime.errors import OutOfResources

L = TypeVar("L", bound=Hashable)

_TOO_BIG: set[tuple[Hashable, Hashable]] = set()  # (kernel key, launch): did not fit


def run_fitting(key: Hashable, launches: Sequence[L], go: Callable[[L], None]) -> None:
    """go(launch) for the first of `launches` (best first) that fits the device at `key` (the
    kernel and whatever else sets its shared memory, e.g. BLOCK_M). Only a lack of resources
    moves on to the next launch; any other error, or the last launch's, propagates."""
    *first, last = launches
    for launch in first:
        if (key, launch) in _TOO_BIG:
            continue
        try:
            go(launch)
            return
        except OutOfResources:
            _TOO_BIG.add((key, launch))
    go(last)


def fell_back(key: Hashable, launch: Hashable) -> bool:
    """True when `launch` did not fit the device at `key` and calls ran a later launch of their
    list instead (a benchmark must not time it as itself)."""
    return (key, launch) in _TOO_BIG

