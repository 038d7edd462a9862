"""Shared by the benchmark scripts: data, engine flags, result files."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data" / "gsm8k"


def run_cli(main: Callable[[], Any]) -> None:
    """A script's entry: a user's error (a data file or server it cannot reach, a refused
    value, a request the server answered with an error) ends in one line on stderr and exit
    code 2, not a traceback. httpx's errors are OSErrors' kin: caught by their base's name."""
    try:
        main()
    except Exception as e:  # noqa: BLE001 - filtered just below
        if not isinstance(e, OSError | ValueError) and type(e).__module__.split(".")[0] != "httpx":
            raise
        prog = Path(sys.argv[0]).stem
        sys.stderr.write(f"{prog}: error: {' '.join(str(e).split()) or type(e).__name__}\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a float > 0 (inf allowed)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k_questions(n: int, path: str | Path | None = None, seed: int = 0) -> list[str]:
    """n GSM8K test questions in the "Question: ...\\nAnswer:" form (cycled if n > 1319)."""
    rows = read_jsonl(path or DATA_DIR / "test.jsonl")
    rng = random.Random(seed)
    picks = [rows[i % len(rows)] for i in range(n)]
    rng.shuffle(picks)
    return [f"Question: {r['question']}\nAnswer:" for r in picks]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags a benchmark passes through to dllm_serve.Engine."""
    parser.add_argument("--model-path", default=None,
                        help="checkpoint folder (default: the built-in model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dllm-algorithm", default="LowConfidence")
    parser.add_argument("--dllm-algorithm-config", default=None)
    parser.add_argument("--attention-backend", default="auto",
                        help="auto (triton on CUDA, torch on the CPU), torch or triton")
    parser.add_argument("--moe-backend", default="auto",
                        help="auto (triton on CUDA, torch on the CPU), torch or triton")
    parser.add_argument("--load-format", default="auto",
                        help="auto, or dummy: random weights at the checkpoint's shapes")
    parser.add_argument("--mem-fraction-static", type=float, default=0.85, help="GPU only")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="turn the radix prefix cache off (every prompt prefilled in full)")


# Execution modes by name -> the Engine keywords that select them; every benchmark that takes
# --modes picks up a new entry. sync and fdfo decode one block at a time, as SGLang does.
MODES: dict[str, dict[str, Any]] = {
    "sync": {"dllm_fdfo": False, "dllm_wavefront_size": 1},
    "fdfo": {"dllm_fdfo": True, "dllm_wavefront_size": 1},
    "wavefront": {"dllm_fdfo": True, "dllm_wavefront_size": 2},
    # FlowBlock's baseline: the same windows, but every request opens and retires together.
    "lockstep": {"dllm_fdfo": False, "dllm_wavefront_size": 2, "dllm_wavefront_lockstep": True},
}


def mode_name(server_info: dict[str, Any]) -> str:
    """The MODES name matching a server's settings (from get_server_info), or "unknown".
    Keys the server does not report are not compared."""
    for name, kw in MODES.items():
        if all(server_info[k] == v for k, v in kw.items() if k in server_info):
            return name
    return "unknown"


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    keys = ("model_path", "device", "dtype", "dllm_algorithm", "dllm_algorithm_config",
            "attention_backend", "moe_backend", "load_format", "mem_fraction_static",
            "max_total_tokens", "context_length", "disable_radix_cache")
    return {k: getattr(ns, k) for k in keys}


def git_commit() -> str:
    """$DLLM_SERVE_GIT_COMMIT when set (a tree copied to a GPU machine, whose own git metadata
    may be stale or absent); else HEAD's hash, with "-dirty" when tracked files differ from it;
    "unknown" outside a git checkout."""
    if os.environ.get("DLLM_SERVE_GIT_COMMIT"):
        return os.environ["DLLM_SERVE_GIT_COMMIT"]
    head = _git("rev-parse", "HEAD")
    if not head:
        return "unknown"
    return head + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def per_request_forward(tokens: int, denoise_steps: list[int | None]) -> float | None:
    """Tokens per denoise forward the requests sat in (waiting in a sync batch included);
    None unless every request reported its count."""
    known = [s for s in denoise_steps if s is not None]
    if len(known) != len(denoise_steps) or not sum(known):
        return None
    return tokens / sum(known)


def summary(values: list[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p99, max of `values` (None when empty)."""
    if not values:
        return dict.fromkeys(("mean", "median", "std", "p90", "p99", "max"))
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "std": statistics.pstdev(values), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def now() -> float:
    return time.perf_counter()
