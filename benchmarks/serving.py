"""Serving load test against a running server's OpenAI API (`/v1/completions`, streaming).

    dllm-serve --model-path /path/to/LLaDA2.0-mini --max-running-requests 16 --dllm-fdfo &
    python -m benchmarks.serving --base-url http://127.0.0.1:30000 --dataset gsm8k \\
        --num-prompts 200 --request-rate inf --max-concurrency 16 --output results/serving.json

Requests arrive all at once (`--request-rate inf`) or as a Poisson process of the given rate, at
most `--max-concurrency` in flight. Prompts are GSM8K few-shot prompts (the accuracy protocol's,
ended by its stop strings) or `--dataset random`: GSM8K text cut to random token lengths, sent as
token ids with ignore_eos so each request generates exactly its output length. Reports request and
token throughput, TTFT, inter-block and per-token inter-token latency, TPOT and end-to-end latency
(mean / median / p99), failures, and the server's tokens per forward when it publishes its step
counters (see benchmarks/serving_metrics.py for the definitions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from tqdm import tqdm

from benchmarks import gsm8k_protocol as proto
from benchmarks import remote
from benchmarks.common import (
    DATA_DIR,
    git_commit,
    mode_name,
    now,
    positive_float,
    positive_int,
    read_jsonl,
    run_cli,
    write_json,
)
from benchmarks.serving_metrics import Encode, aggregate, request_metrics
from benchmarks.stream_client import StreamRecord, stream_completion


@dataclass
class Request:
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    extra: dict[str, Any]  # stop / ignore_eos


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="default: the first one /v1/models lists")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--dataset", choices=["gsm8k", "random"], default="gsm8k")
    p.add_argument("--num-prompts", type=positive_int, default=200)
    p.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--num-shots", type=int, default=proto.NUM_SHOTS, help="gsm8k dataset")
    p.add_argument("--gsm8k-output-len", type=int, default=proto.MAX_NEW_TOKENS,
                   help="gsm8k dataset: max_tokens (requests also end at the protocol's stops)")
    p.add_argument("--ignore-eos", action="store_true", help="gsm8k dataset: ignore EOS")
    p.add_argument("--random-input-len", type=positive_int, default=1024)
    p.add_argument("--random-output-len", type=positive_int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [max(1, L*ratio), L] (1.0 = exactly L)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for random prompts and "
                   "per-chunk token counts (default: the server's model path, if local)")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-path", default=None, help="GSM8K-format jsonl (default: shipped test)")
    p.add_argument("--output", default=None, help="write the JSON result here")
    p.add_argument("--output-details", action="store_true", help="add per-request records")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    root, key = remote.api_root(ns.base_url), remote.api_key(ns.api_key)
    model = ns.model or remote.model_id(root, key)
    encode = load_encoder(ns.tokenizer, remote.server_info(root, key))
    requests = make_requests(ns, encode)
    client = Client(f"{root}/v1/completions", remote.headers(key), model,
                    json.loads(ns.extra_request_body) if ns.extra_request_body else {})
    asyncio.run(warm_up(ns, client, requests[0]))
    before = remote.server_info(root, key)
    records, duration = asyncio.run(run(ns, client, requests))
    after = remote.server_info(root, key)
    results = aggregate(records, duration, encode)
    results.update(remote.block_stats(remote.stats_delta(before, after),
                                      results["total_output_tokens"] or 0))
    result = {"benchmark": "serving", "git_commit": git_commit(),
              "config": config(ns, model, after), "results": results}
    if ns.output_details:
        result["details"] = [details(r, encode) for r in records]
    print_table(result["config"], results)
    write_json(ns.output, result)
    return result


def load_encoder(path: str | None, info: dict[str, Any] | None) -> Encode | None:
    from dllm_serve.tokenizer import Tokenizer

    info = info or {}
    candidates = [path] if path else [info.get("tokenizer_path"), info.get("model_path")]
    for c in candidates:
        if c and (Path(c) / "tokenizer.json").is_file():
            return Tokenizer.load(c).encode
    if path:
        raise SystemExit(f"--tokenizer {path}: no tokenizer.json there")
    return None


def make_requests(ns: argparse.Namespace, encode: Encode | None) -> list[Request]:
    rows = read_jsonl(ns.data_path or DATA_DIR / "test.jsonl")
    rng = random.Random(ns.seed)
    if ns.dataset == "random":
        if encode is None:
            raise SystemExit("--dataset random needs a tokenizer: pass --tokenizer DIR")
        return random_requests(ns, rows, encode, rng)
    prompts = proto.build_prompts(rows, proto.load_shots("train", ns.num_shots, rows))
    extra: dict[str, Any] = {"stop": proto.STOP, **({"ignore_eos": True} if ns.ignore_eos else {})}
    picks = [prompts[i % len(prompts)] for i in range(ns.num_prompts)]
    return [Request(p, len(encode(p)) if encode else 0, ns.gsm8k_output_len, extra)
            for p in picks]


def random_requests(ns: argparse.Namespace, rows: list[dict[str, Any]], encode: Encode,
                    rng: random.Random) -> list[Request]:
    pool = encode("\n".join(r["question"] for r in rows))
    out = []
    for _ in range(ns.num_prompts):
        n_in = rng.randint(max(1, int(ns.random_input_len * ns.random_range_ratio)),
                           ns.random_input_len)
        n_out = rng.randint(max(1, int(ns.random_output_len * ns.random_range_ratio)),
                            ns.random_output_len)
        start = rng.randrange(len(pool))
        ids = (pool[start:] + pool * (1 + n_in // len(pool)))[:n_in]
        out.append(Request(ids, n_in, n_out, {"ignore_eos": True}))
    return out


@dataclass(frozen=True)
class Client:
    url: str
    headers: dict[str, str]
    model: str
    extra_body: dict[str, Any]

    def payload(self, r: Request) -> dict[str, Any]:
        return {"model": self.model, "prompt": r.prompt, "max_tokens": r.max_tokens,
                "temperature": 0.0, **r.extra, **self.extra_body}

    async def send(self, http: httpx.AsyncClient, r: Request) -> StreamRecord:
        return await stream_completion(http, self.url, self.headers, self.payload(r),
                                       StreamRecord(r.prompt_len, r.max_tokens))


def _http(ns: argparse.Namespace) -> httpx.AsyncClient:
    # idle connections dropped before the server's keep-alive (5 s) drops them (at httpx's
    # default, also 5 s, a request sent as the server closes its connection fails)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=2.0)
    return httpx.AsyncClient(timeout=ns.request_timeout, limits=limits)


async def warm_up(ns: argparse.Namespace, client: Client, request: Request) -> None:
    async with _http(ns) as http:
        for _ in range(ns.warmup_requests):
            rec = await client.send(http, request)
            if not rec.ok:
                raise SystemExit(f"the warm-up request failed: {rec.error}")


async def run(ns: argparse.Namespace, client: Client, requests: list[Request],
              ) -> tuple[list[StreamRecord], float]:
    """Send every request (Poisson arrivals or all at once, bounded concurrency); wall time."""
    sem = asyncio.Semaphore(ns.max_concurrency or len(requests))
    bar = tqdm(total=len(requests), desc="serving", unit="req")

    async def one(http: httpx.AsyncClient, r: Request) -> StreamRecord:
        async with sem:
            rec = await client.send(http, r)
        bar.update(1)
        return rec

    async with _http(ns) as http:
        rng, tasks, t0 = random.Random(ns.seed), [], now()
        for r in requests:
            tasks.append(asyncio.create_task(one(http, r)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
        records = await asyncio.gather(*tasks)
        duration = now() - t0
    bar.close()
    return list(records), duration


def config(ns: argparse.Namespace, model: str, info: dict[str, Any] | None) -> dict[str, Any]:
    info = info or {}
    return {**vars(ns), "api_key": "<set>" if ns.api_key else None, "model": model,
            "server_mode": mode_name(info) if info else "unknown",
            "server_max_running_requests": info.get("max_running_requests"),
            "server_dllm_algorithm": info.get("dllm_algorithm"), "server_info": info}


def details(rec: StreamRecord, encode: Encode | None) -> dict[str, Any]:
    base = {"ok": rec.ok, "error": rec.error, "max_tokens": rec.max_tokens,
            "chunk_times": rec.chunk_times, "finish_reason": rec.finish_reason}
    if not rec.ok:
        return base
    m = request_metrics(rec, encode)
    return {**base, **{k: m[k] for k in ("prompt_tokens", "output_tokens", "ttft", "e2e",
                                         "chunk_tokens", "chunk_tokens_source")}}


def print_table(cfg: dict[str, Any], r: dict[str, Any]) -> None:
    def med(key: str) -> str:
        v = (r.get(key) or {}).get("median")
        return f"{v:>9.1f}" if v is not None else f"{'n/a':>9}"

    out = r["output_throughput"]
    print(f"{'mode':<9} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT ms':>9} "
          f"{'ITL/blk':>9} {'ITL/tok':>9} {'E2E ms':>9} {'E2E p99':>9}")
    p99 = r["e2e_latency_ms"]["p99"]
    print(f"{cfg['server_mode']:<9} {r['completed']:>5} {r['failed']:>4} "
          f"{r['request_throughput']:>7.2f} "
          f"{(f'{out:.1f}' if out is not None else 'n/a'):>9} {med('ttft_ms')} "
          f"{med('itl_block_ms')} {med('itl_token_ms')} {med('e2e_latency_ms')} "
          f"{(f'{p99:.1f}' if p99 is not None else 'n/a'):>9}")


if __name__ == "__main__":
    run_cli(main)
