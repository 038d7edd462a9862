"""GSM8K accuracy and throughput: SGLang's few-shot protocol (5-shot raw text, greedy, 512 tokens).

Against a running server (OpenAI completions API):

    python -m benchmarks.gsm8k --base-url http://127.0.0.1:30000 --parallel 128 \\
        --output results/gsm8k.json

In process, through dllm_serve.Engine (the engine's own flags apply):

    python -m benchmarks.gsm8k --model-path /path/to/LLaDA2.0-mini --dllm-algorithm LowConfidence \\
        --dllm-fdfo --max-running-requests 16 --output results/gsm8k_fdfo16.json

Reports accuracy, invalid rate (no number in the completion), wall time, per-request latency,
output throughput (completion tokens / wall time), tokens per forward (TPF: completion tokens /
forwards the committed blocks took) and forwards per block; in process also tokens per
request-forward (completion tokens / denoise forwards the requests sat in, waiting included);
and prompt tokens taken from the radix prefix cache vs computed (`--disable-radix-cache` in
process turns the cache off; benchmarks/prefix_cache.py runs both in one go).
`--protocol sglang` (the default) is exactly SGLang's `few_shot_gsm8k` (shots = the first test
questions, its answer reading); `--protocol clean` takes the shots from the train split and reads
signed integers (see gsm8k_protocol.py). The JSON's `config.protocol` says which ran.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gsm8k_protocol as proto
from benchmarks import remote
from benchmarks.backends import Completion, GenParams, engine_call, openai_call, run_parallel
from benchmarks.common import (
    DATA_DIR,
    add_engine_args,
    engine_kwargs,
    git_commit,
    now,
    per_request_forward,
    positive_int,
    read_jsonl,
    run_cli,
    summary,
    write_json,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None,
                   help="a running server, e.g. http://127.0.0.1:30000 (else: in-process Engine)")
    p.add_argument("--model", default=None, help="model id for --base-url (default: the first "
                   "one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="for --base-url (default: $OPENAI_API_KEY)")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    add_engine_args(p)
    p.add_argument("--dllm-fdfo", action=argparse.BooleanOptionalAction, default=True,
                   help="engine mode: FDFO scheduling (--no-dllm-fdfo: sync)")
    p.add_argument("--dllm-wavefront-size", type=int, default=1,
                   help="engine mode: blocks per request in flight (1: one at a time, as SGLang)")
    p.add_argument("--max-running-requests", type=int, default=16, help="engine mode")
    p.add_argument("--num-questions", type=positive_int, default=proto.NUM_QUESTIONS)
    p.add_argument("--num-shots", type=int, default=proto.NUM_SHOTS)
    p.add_argument("--protocol", choices=sorted(proto.PROTOCOLS), default="sglang",
                   help="sglang: SGLang's few_shot_gsm8k exactly (test shots, its answer "
                   "reading); clean: train shots, signed integers")
    p.add_argument("--max-new-tokens", type=int, default=proto.MAX_NEW_TOKENS)
    p.add_argument("--parallel", type=int, default=128, help="requests in flight")
    p.add_argument("--data-path", default=None,
                   help="GSM8K-format jsonl to score (default: the shipped test split)")
    p.add_argument("--output", default=None, help="write the JSON result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    test_rows = read_jsonl(ns.data_path or DATA_DIR / "test.jsonl")
    if ns.num_questions > len(test_rows):
        raise SystemExit(f"--num-questions {ns.num_questions}: the data has {len(test_rows)}")
    rows = test_rows[: ns.num_questions]
    protocol = proto.PROTOCOLS[ns.protocol]
    prompts = proto.build_prompts(rows, protocol.shots(ns.num_shots, test_rows))
    params = GenParams(max_tokens=ns.max_new_tokens, stop=proto.STOP)
    run = run_server if ns.base_url else run_engine
    answers, wall, info, blocks = run(ns, prompts, params)
    result = {"benchmark": "gsm8k", "git_commit": git_commit(), "config": config(ns, info),
              "results": {**score(protocol, rows, answers, wall), **blocks},
              "questions": details(protocol, rows, answers)}
    print_table(result["results"])
    write_json(ns.output, result)
    errors = [a.error for a in answers if a.error is not None]
    if errors:  # said, not only counted: a run whose every request failed measured nothing
        print(f"gsm8k: {len(errors)} of {len(answers)} requests failed; the first: "
              f"{errors[0]}", file=sys.stderr)
        if len(errors) == len(answers):
            raise SystemExit(1)
    return result


def run_engine(ns: argparse.Namespace, prompts: list[str], params: GenParams,
               ) -> tuple[list[Completion], float, dict[str, Any], dict[str, Any]]:
    from dllm_serve import Engine

    with Engine(**engine_kwargs(ns), dllm_fdfo=ns.dllm_fdfo, log_level="warning",
                dllm_wavefront_size=ns.dllm_wavefront_size,
                max_running_requests=ns.max_running_requests) as engine:
        before = engine.get_server_info()
        t0 = now()
        answers = run_parallel(engine_call(engine, params), prompts, ns.parallel, "gsm8k")
        wall = now() - t0
        after = engine.get_server_info()
    blocks = engine_block_stats(answers, remote.stats_delta(before, after))
    return answers, wall, after, {**blocks, **remote.prompt_cache_stats(before, after)}


def run_server(ns: argparse.Namespace, prompts: list[str], params: GenParams,
               ) -> tuple[list[Completion], float, dict[str, Any], dict[str, Any]]:
    import openai

    root, key = remote.api_root(ns.base_url), remote.api_key(ns.api_key)
    model = ns.model or remote.model_id(root, key)
    client = openai.OpenAI(base_url=f"{root}/v1", api_key=key or "EMPTY", max_retries=0,
                           timeout=ns.request_timeout)
    before = remote.server_info(root, key)
    t0 = now()
    answers = run_parallel(openai_call(client, model, params), prompts, ns.parallel, "gsm8k")
    wall = now() - t0
    after = remote.server_info(root, key)
    tokens = sum(a.completion_tokens for a in answers)
    blocks = remote.block_stats(remote.stats_delta(before, after), tokens)
    return answers, wall, {"model": model, **(after or {})}, {
        **blocks, "forwards_per_block": [], **remote.prompt_cache_stats(before, after)}


def engine_block_stats(answers: list[Completion], delta: dict[str, int] | None,
                       ) -> dict[str, Any]:
    per_block = [f for a in answers for f in a.block_forwards or []]
    tokens = sum(a.completion_tokens for a in answers)
    return {"tokens_per_forward": tokens / sum(per_block) if per_block else None,
            "tokens_per_request_forward": per_request_forward(
                tokens, [a.denoise_steps for a in answers]),
            "forwards_per_block_mean": sum(per_block) / len(per_block) if per_block else None,
            "forwards_per_block": per_block,
            "source": "engine meta_info block_forwards", "server_stats": delta}


def score(protocol: proto.Protocol, rows: list[dict[str, Any]], answers: list[Completion],
          wall: float) -> dict[str, Any]:
    preds = [protocol.extract(a.text) for a in answers]
    labels = [protocol.label(r) for r in rows]
    tokens = sum(a.completion_tokens for a in answers)
    n = len(rows)
    return {"num_questions": n,
            "accuracy": sum(p == y for p, y in zip(preds, labels, strict=True)) / n,
            # no number in a completion that came back (a failed request is a failure)
            "invalid_rate": sum(p is None and a.error is None
                                for p, a in zip(preds, answers, strict=True)) / n,
            "failures": sum(a.error is not None for a in answers),
            "latency_s": wall, "request_latency_s": summary([a.latency for a in answers]),
            "prompt_tokens": sum(a.prompt_tokens for a in answers),
            "output_tokens": tokens, "output_throughput": tokens / wall}


def details(protocol: proto.Protocol, rows: list[dict[str, Any]], answers: list[Completion],
            ) -> list[dict[str, Any]]:
    return [{"index": i, "label": protocol.label(r), "prediction": protocol.extract(a.text),
             "completion": a.text, "completion_tokens": a.completion_tokens,
             "latency_s": a.latency, "block_forwards": a.block_forwards, "error": a.error}
            for i, (r, a) in enumerate(zip(rows, answers, strict=True))]


def config(ns: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """The run's flags; against a server (--base-url) without the engine's, which describe
    nothing there (its own settings are in server_info)."""
    flags = vars(ns)
    if ns.base_url:
        engine = {*engine_kwargs(ns), "dllm_fdfo", "dllm_wavefront_size", "max_running_requests"}
        flags = {k: v for k, v in flags.items() if k not in engine}
    return {**flags, "api_key": "<set>" if ns.api_key else None,
            "backend": "server" if ns.base_url else "engine",
            "shots_from": proto.PROTOCOLS[ns.protocol].shots_from,
            "shots_path": (str(proto.TRAIN_PATH) if proto.PROTOCOLS[ns.protocol].shots_from
                           == "train" else None),
            "stop": proto.STOP, "temperature": 0.0, "server_info": info}


def print_table(r: dict[str, Any]) -> None:
    tpf, fpb = r["tokens_per_forward"], r["forwards_per_block_mean"]
    share = r.get("prompt_recomputed_share")
    print(f"{'n':>4} {'accuracy':>8} {'invalid':>7} {'fail':>4} {'latency s':>9} "
          f"{'tok/s':>8} {'TPF':>6} {'fwd/blk':>7} {'recomputed':>10}")
    print(f"{r['num_questions']:>4} {r['accuracy']:>8.3f} {r['invalid_rate']:>7.3f} "
          f"{r['failures']:>4} {r['latency_s']:>9.2f} {r['output_throughput']:>8.1f} "
          f"{_num(tpf, 6, 2)} {_num(fpb, 7, 2)} {_num(share, 10, 3)}")


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{x:>{width}.{digits}f}" if x is not None else f"{'n/a':>{width}}"


if __name__ == "__main__":
    run_cli(main)
