"""The front's tokenization of a batch of prompts (`Engine.generate` with a list): one by one
(`Tokenizer.encode` per text, as before) against together (`Tokenizer.encode_batch`, the texts
spread over the tokenizer's threads). Every request of a batch waits for the whole batch's
tokens (the batch is validated before anything runs), so this is time before the first forward.

    python benchmarks/front_tokenize.py --prompts 4096

Prints ms per batch (the best of --repeats) for each way, on the built-in model's tokenizer and
GSM8K questions (or --data-path, e.g. the held-out problems of the runtime benchmark).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit, gsm8k_questions, write_json  # noqa: E402
from dllm_serve.default_model import default_model_path  # noqa: E402
from dllm_serve.tokenizer import Tokenizer  # noqa: E402


def best_ms(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(1e3 * (time.perf_counter() - t0))
    return min(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4096)
    p.add_argument("--data-path", default=None, help="JSONL of questions (default: GSM8K test)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON results")
    ns = p.parse_args(argv)
    tok = Tokenizer.load(default_model_path())
    texts = gsm8k_questions(ns.prompts, ns.data_path)
    one = best_ms(lambda: [tok.encode(t) for t in texts], ns.repeats)
    batch = best_ms(lambda: tok.encode_batch(texts), ns.repeats)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    print(f"{ns.prompts} prompts: one by one {one:.1f} ms, together {batch:.1f} ms "
          f"({one / batch:.2f}x)")
    write_json(ns.out, {"benchmark": "front_tokenize", "git_commit": git_commit(),
                        "config": vars(ns), "one_by_one_ms": one, "batch_ms": batch})
    return {"one_by_one_ms": one, "batch_ms": batch}


if __name__ == "__main__":
    main()
