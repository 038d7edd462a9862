"""Where the host launch of the first prefill after a compiling warm-up goes (session 31).

    P=benchmarks/results/h200/gpupath/first_prefill_probe.py
    TRITON_CACHE_DIR=/tmp/fresh_$RANDOM python3 $P   # an empty Triton cache: the warm-up compiles
    python3 $P                                        # again: the cache now warm

In a worker whose Triton cache started empty (tests/test_no_compile_after_ready.py, 4 runs of 4)
prefill #0 after ready took 2.0-2.8 ms of host launch against 0.2-0.6 ms for the later ones,
with no compile, no garbage collection and its graph already launched once at startup; with a
warm cache it did not. This runs the scheduler and the worker in one process
(tests/local_engine.py) with the tiny model on CUDA (their defaults: Triton kernels, CUDA
graphs), serves rounds of four ~1k-token prompts (each round's prefills merge into one forward
of the 4096-token bucket) and prints, per prefill, the host milliseconds of its launch
(`PrefillGraphs.run_prefill`) and of its pieces: the metadata (`MetaWriter.write`), its copy
(`copy_to_device`) and the graph's launch (`CUDAGraph.replay`).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))

from local_engine import local_engine  # noqa: E402

from dllm_serve.model import cuda_graph, graph_layout, prefill_graphs  # noqa: E402
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

ROUNDS, PROMPTS = 8, 4


def instrument() -> list[dict[str, float]]:
    """Patch the prefill launch and its pieces to time themselves; returns the rows, one per
    prefill, filled as prefills run."""
    rows: list[dict[str, float]] = []
    current: dict[str, float] | None = None

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if current is not None:
                current[name] = current.get(name, 0.0) + 1e3 * (time.perf_counter() - start)
            return out
        return wrapper

    run_prefill = prefill_graphs.PrefillGraphs.run_prefill

    def launch(self: Any, slots: list[int], seg_starts: list[int],
               token_ids: list[np.ndarray]) -> bool:
        nonlocal current
        current = {"tokens": float(sum(len(t) for t in token_ids))}
        start = time.perf_counter()
        out = run_prefill(self, slots, seg_starts, token_ids)
        current["launch_ms"] = 1e3 * (time.perf_counter() - start)
        rows.append(current)
        current = None
        return out

    prefill_graphs.PrefillGraphs.run_prefill = launch  # type: ignore[method-assign]
    graph_layout.MetaWriter.write = timed("meta_ms", graph_layout.MetaWriter.write)  # type: ignore[method-assign]
    cuda_graph.copy_to_device = timed("copy_ms", cuda_graph.copy_to_device)
    if torch.cuda.is_available():
        torch.cuda.CUDAGraph.replay = timed("replay_ms", torch.cuda.CUDAGraph.replay)  # type: ignore[method-assign]
    return rows


def main() -> None:
    model = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    engine = local_engine(model, "LowConfidence", fdfo=True, mrr=8, device=device,
                          chunked_prefill_size=4096)
    print(f"engine built (warm-up included) in {time.perf_counter() - start:.1f} s on {device}")
    rows = instrument()
    rng = np.random.default_rng(0)
    for r in range(ROUNDS):
        for p in range(PROMPTS):
            n = int(rng.integers(900, 1000))
            engine.submit(f"r{r}p{p}", rng.integers(3, 300, n).tolist(), max_new_tokens=32,
                          ignore_eos=True)
        engine.run()
    keys = ("launch_ms", "meta_ms", "copy_ms", "replay_ms")
    print("prefill | tokens | " + " | ".join(keys))
    for i, row in enumerate(rows):
        print(f"#{i} | {int(row['tokens'])} | "
              + " | ".join(f"{row.get(k, 0.0):.3f}" for k in keys))
    if not rows:
        print("no bucketed prefill ran (prefill graphs are built on CUDA only)")


if __name__ == "__main__":
    main()
