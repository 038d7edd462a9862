"""Shared by the benchmark scripts: data, engine flags, result files."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data" / "gsm8k"


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
    parser.add_argument("--attention-backend", default="torch")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--context-length", type=int, default=None)


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    keys = ("model_path", "device", "dtype", "dllm_algorithm", "dllm_algorithm_config",
            "attention_backend", "max_total_tokens", "context_length")
    return {k: getattr(ns, k) for k in keys}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def now() -> float:
    return time.perf_counter()
