"""The front's delivery of one request's output, block by block, as its receive thread does
it for every committed block (`TokenizerManager._deliver`: the ids kept, the text delta from
`IncrementalDetokenizer.update`, the update handed on), with GSM8K's stop strings held back;
and the scheduler's check of a stop_regex at every commit (`FinishChecker.commit`), which
searches the whole text; and the front's delivery again with many long stop strings
(--long-stops N CHARS: N pieces of GSM8K's questions, CHARS characters each), whose hold-back
(`utils.text.partial_stop_len`) runs at every block.

    python benchmarks/detokenize.py [--tokens 512 2048 8192] [--block 32] [--long-stops 100 1000]
        [--out R.json]

The output is GSM8K answers' text on the built-in model's tokenizer, cut to N tokens. Reported
per N (best of --repeats, this machine's CPU): ms for the whole request and us a block, for
each. The receive thread serves every running request and the scheduler every request, so a
cost per block that grows with the output slows everyone once outputs are long.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DATA_DIR, git_commit, read_jsonl, write_json  # noqa: E402
from dllm_serve.default_model import default_model_path  # noqa: E402
from dllm_serve.managers.detokenizer import IncrementalDetokenizer  # noqa: E402
from dllm_serve.managers.finish import FinishChecker  # noqa: E402
from dllm_serve.managers.messages import ReqOutput  # noqa: E402
from dllm_serve.managers.req import Req  # noqa: E402
from dllm_serve.managers.tokenizer_manager import ReqState, TokenizerManager  # noqa: E402
from dllm_serve.sampling_params import SamplingParams  # noqa: E402
from dllm_serve.tokenizer import Tokenizer  # noqa: E402

STOPS = ["Question", "Assistant:", "<|separator|>"]
STOP_REGEX = r"The answer is \d+\.\s*$"  # never in GSM8K's answers: searched to the end


def output_ids(tok: Tokenizer, tokens: int) -> list[int]:
    """`tokens` ids of GSM8K answers' text (no stop string in it)."""
    text = "\n".join(r["answer"] for r in read_jsonl(DATA_DIR / "test.jsonl"))
    ids = tok.encode(text.replace("Question", "question"), add_special_tokens=False)
    assert len(ids) >= tokens, f"GSM8K's answers hold only {len(ids)} tokens"
    return ids[:tokens]


def long_stops(count: int, chars: int) -> list[str]:
    """`count` stop strings of `chars` characters: consecutive pieces of GSM8K's questions."""
    text = " ".join(r["question"] for r in read_jsonl(DATA_DIR / "test.jsonl"))
    assert len(text) >= count * chars, "GSM8K's questions are too short for these stops"
    return [text[i * chars:(i + 1) * chars] for i in range(count)]


def detokenize(tok: Tokenizer, ids: list[int], block: int,
               stops: list[str] = STOPS) -> tuple[float, str]:
    """Seconds of the front's receive thread for `ids` committed `block` at a time
    (`TokenizerManager._deliver` of each block: the ids kept, the text delta, the update
    handed to the request's callback), and the text streamed."""
    front = object.__new__(TokenizerManager)  # the front's delivery alone: no processes
    front.states_lock = threading.Lock()
    updates: list[Any] = []
    detok = IncrementalDetokenizer(lambda part: tok.decode(part, skip_special_tokens=True), stops)
    front.states = {"r": ReqState(SamplingParams(max_new_tokens=len(ids)), updates.append, detok)}
    t0 = time.perf_counter()
    for at in range(0, len(ids), block):
        finished = at + block >= len(ids)
        front._deliver(ReqOutput("r", np.asarray(ids[at:at + block], dtype=np.int64), finished,
                                 {"type": "length"} if finished else None))
    seconds = time.perf_counter() - t0
    return seconds, "".join(u.delta for u in updates)


def stop_regex_checks(tok: Tokenizer, ids: list[int], block: int) -> float:
    """Seconds of the scheduler's finish checks of `ids` committed `block` at a time, for a
    request with a stop_regex that never matches."""
    checker = FinishChecker(set(), tok.decode)
    params = SamplingParams(max_new_tokens=len(ids), stop_regex=[STOP_REGEX], ignore_eos=True)
    req = Req("r", np.zeros(1, dtype=np.int64), params, 0.0, block, 0)
    t0 = time.perf_counter()
    for at in range(0, len(ids), block):
        checker.commit(req, np.asarray(ids[at:at + block], dtype=np.int64))
    seconds = time.perf_counter() - t0
    assert req.output_ids == ids and req.finish_reason["type"] == "length"
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long-stops", type=int, nargs=2, default=[100, 1000],
                    metavar=("N", "CHARS"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = Tokenizer.load(default_model_path())
    many = long_stops(*args.long_stops)
    rows: list[dict[str, Any]] = []
    for n in args.tokens:
        ids = output_ids(tok, n)
        runs = [detokenize(tok, ids, args.block) for _ in range(args.repeats)]
        assert all(text == tok.decode(ids) for _, text in runs), "the stream is not the text"
        best = min(seconds for seconds, _ in runs)
        regex_best = min(stop_regex_checks(tok, ids, args.block) for _ in range(args.repeats))
        many_runs = [detokenize(tok, ids, args.block, many) for _ in range(args.repeats)]
        assert all(text == tok.decode(ids) for _, text in many_runs), "the stream is not the text"
        many_best = min(seconds for seconds, _ in many_runs)
        blocks = -(-n // args.block)
        rows.append({"tokens": n, "request_ms": 1e3 * best, "us_per_block": 1e6 * best / blocks,
                     "stop_regex_request_ms": 1e3 * regex_best,
                     "stop_regex_us_per_block": 1e6 * regex_best / blocks,
                     "long_stops_us_per_block": 1e6 * many_best / blocks})
        print(f"{n:6d} tokens: front {1e3 * best:8.2f} ms a request, "
              f"{1e6 * best / blocks:7.1f} us a block; stop_regex check "
              f"{1e3 * regex_best:8.2f} ms a request, {1e6 * regex_best / blocks:7.1f} us a block;"
              f" front with {len(many)} long stops {1e6 * many_best / blocks:8.1f} us a block")
    write_json(args.out, {"benchmark": "detokenize", "commit": git_commit(),
                          "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
