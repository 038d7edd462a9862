"""The radix prefix cache: one workload with the cache on and off (`--disable-radix-cache`) in
one run, through the in-process Engine (the engine's own flags apply to both arms).

    python -m benchmarks.prefix_cache gsm8k --num-questions 200 --max-running-requests 16 \\
        --output results/prefix_cache_gsm8k.json
    python -m benchmarks.prefix_cache chat --conversations 16 --turns 4 \\
        --output results/prefix_cache_chat.json

gsm8k: GSM8K 5-shot with SGLang's protocol (benchmarks/gsm8k.py's prompts, stops and scoring;
every prompt starts with the same five solved examples). chat: C conversations of T turns,
all on one system prompt; turn t+1's prompt is the chat template over the history (earlier
replies as text, as the OpenAI chat route renders them), so it repeats turn t's prompt and
reply. Per arm: wall time, output throughput, prompt tokens taken from the cache vs computed
(the scheduler's radix_cache counters), accuracy (gsm8k) or per-turn prompt tokens (chat);
then the on/off throughput ratio and the share of prompt tokens recomputed with the cache on.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gsm8k_protocol as proto
from benchmarks import remote
from benchmarks.backends import GenParams, engine_call, run_parallel
from benchmarks.common import (
    DATA_DIR,
    add_engine_args,
    engine_kwargs,
    git_commit,
    now,
    positive_int,
    read_jsonl,
    run_cli,
    write_json,
)
from benchmarks.gsm8k import score

# arm -> disable_radix_cache; cache_off_again (optional) is the noise floor of "identical outputs":
# on a GPU in bf16, batch shapes (which differ run to run) change the last bits of the logits
ARMS = {"cache_on": False, "cache_off": True, "cache_off_again": True}
SYSTEM = ("You are a patient maths tutor. Read each question carefully, work through it step by "
          "step with the numbers given, and end with the final answer as a number.")
FOLLOW_UPS = ["Check your answer once more and state it again.",
              "Now solve it with every number doubled.", "Explain the first step in words."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("workload", choices=["gsm8k", "chat"])
    add_engine_args(p)
    p.add_argument("--dllm-fdfo", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dllm-wavefront-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--parallel", type=int, default=128, help="requests in flight")
    p.add_argument("--arms", default="cache_on,cache_off", help="which arms, in order")
    p.add_argument("--num-questions", type=positive_int, default=proto.NUM_QUESTIONS, help="gsm8k")
    p.add_argument("--num-shots", type=int, default=proto.NUM_SHOTS, help="gsm8k")
    p.add_argument("--protocol", choices=sorted(proto.PROTOCOLS), default="sglang",
                   help="gsm8k: whose shots and answer reading (see gsm8k_protocol.py)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default: {proto.MAX_NEW_TOKENS} (gsm8k), 96 (chat)")
    p.add_argument("--conversations", type=int, default=16, help="chat")
    p.add_argument("--turns", type=int, default=4, help="chat")
    p.add_argument("--output", default=None, help="write the JSON result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    run = run_gsm8k if ns.workload == "gsm8k" else run_chat
    arms = {arm: timed_arm(run, ns, ARMS[arm]) for arm in ns.arms.split(",")}
    result = {"benchmark": f"prefix_cache_{ns.workload}", "git_commit": git_commit(),
              "config": vars(ns), "arms": arms, "comparison": compare(arms)}
    print_table(ns.workload, arms, result["comparison"])
    write_json(ns.output, result)
    return result


def timed_arm(run: Any, ns: argparse.Namespace, disabled: bool) -> dict[str, Any]:
    """One arm, with the machine's 1-minute load average before and after it (a shared
    machine's other work slows an arm; the prompt-token counts do not depend on it)."""
    load = os.getloadavg()[0]
    return {**run(ns, disabled), "load_average": [load, os.getloadavg()[0]]}


def engine(ns: argparse.Namespace, disabled: bool) -> Any:
    from dllm_serve import Engine

    return Engine(**{**engine_kwargs(ns), "disable_radix_cache": disabled},
                  dllm_fdfo=ns.dllm_fdfo, dllm_wavefront_size=ns.dllm_wavefront_size,
                  max_running_requests=ns.max_running_requests, log_level="warning")


# ---- gsm8k --------------------------------------------------------------------------------------


def run_gsm8k(ns: argparse.Namespace, disabled: bool) -> dict[str, Any]:
    test_rows = read_jsonl(DATA_DIR / "test.jsonl")
    rows = test_rows[: ns.num_questions]
    protocol = proto.PROTOCOLS[ns.protocol]
    prompts = proto.build_prompts(rows, protocol.shots(ns.num_shots, test_rows))
    params = GenParams(max_tokens=ns.max_new_tokens or proto.MAX_NEW_TOKENS, stop=proto.STOP)
    with engine(ns, disabled) as e:
        before = e.get_server_info()
        t0 = now()
        answers = run_parallel(engine_call(e, params), prompts, ns.parallel,
                               f"gsm8k {'off' if disabled else 'on'}")
        wall = now() - t0
        after = e.get_server_info()
    return {**score(protocol, rows, answers, wall), **remote.prompt_cache_stats(before, after),
            "radix_cache_after": after["radix_cache"], "texts": [a.text for a in answers]}


# ---- chat ---------------------------------------------------------------------------------------


def run_chat(ns: argparse.Namespace, disabled: bool) -> dict[str, Any]:
    rows = read_jsonl(DATA_DIR / "test.jsonl")[: ns.conversations]
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}]
             for r in rows]
    params = {"max_new_tokens": ns.max_new_tokens or 96, "temperature": 0.0}
    turns: list[dict[str, Any]] = []
    history: list[list[int]] = [[] for _ in chats]  # the last turn's prompt + output ids
    with engine(ns, disabled) as e:
        tok, page = e.front.tokenizer, e.get_server_info()["kv_pool"]["page_size"]
        t_all = now()  # the turns only: startup (compiles, captures) is not the cache's
        for t in range(ns.turns):
            if t:
                for chat in chats:
                    chat.append({"role": "user", "content": FOLLOW_UPS[(t - 1) % 3]})
            prompts = [tok.encode(tok.apply_chat_template(chat)) for chat in chats]
            turns.append({**chat_turn(e, prompts, params),
                          "reusable_tokens": reusable(history, prompts, page)})
            for i, (chat, out) in enumerate(zip(chats, turns[-1].pop("outs"), strict=True)):
                chat.append({"role": "assistant", "content": out["text"]})
                history[i] = prompts[i] + out["output_ids"]
        wall = now() - t_all
    output = sum(t["output_tokens"] for t in turns)
    return {"turns": turns, "latency_s": wall, "output_tokens": output,
            "output_throughput": output / wall, "texts": [o for t in turns for o in t["ids"]],
            **_sum_cache(turns, ("prompt_tokens_cached", "prompt_tokens_computed"))}


def chat_turn(e: Any, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
    """One turn of every conversation, all in flight together."""
    before = e.get_server_info()
    t0 = now()
    outs = e.generate(input_ids=prompts, sampling_params=params)
    wall = now() - t0
    after = e.get_server_info()
    return {"prompt_tokens": sum(len(p) for p in prompts),
            "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
            "latency_s": wall, **remote.prompt_cache_stats(before, after), "outs": outs,
            "ids": [o["output_ids"] for o in outs]}


def reusable(history: list[list[int]], prompts: list[list[int]], page: int) -> int:
    """Prompt tokens a prefix cache could take from the previous turn: per conversation, the
    whole pages of the prompt's common prefix with the previous prompt + reply (a reply that
    re-tokenizes to other ids shortens it)."""
    total = 0
    for old, new in zip(history, prompts, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
                 min(len(old), len(new)))
        total += n // page * page
    return total


def _sum_cache(turns: list[dict[str, Any]], keys: tuple[str, str]) -> dict[str, Any]:
    hit, miss = (sum(t[k] for t in turns) for k in keys)
    return {keys[0]: hit, keys[1]: miss,
            "prompt_recomputed_share": miss / (hit + miss) if hit + miss else None}


# ---- report -------------------------------------------------------------------------------------


def compare(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """cache on / off: output throughput ratio, wall time ratio, prompt tokens computed, and
    how many outputs are identical (temperature 0: all should be). Drops the outputs."""
    texts = {name: arm.pop("texts") for name, arm in arms.items()}
    for arm in arms.values():
        for turn in arm.get("turns", []):
            turn.pop("ids")
    if not {"cache_on", "cache_off"} <= set(arms):
        return {}
    on, off = arms["cache_on"], arms["cache_off"]
    again = {}
    if "cache_off_again" in texts:
        again = {"identical_outputs_off_vs_off_again": identical(texts["cache_off"],
                                                                 texts["cache_off_again"])}
    return {"identical_outputs": identical(texts["cache_on"], texts["cache_off"]), **again,
            "outputs": len(texts["cache_on"]),
            "throughput_ratio": on["output_throughput"] / off["output_throughput"],
            "latency_ratio": on["latency_s"] / off["latency_s"],
            "prompt_recomputed_share_on": on["prompt_recomputed_share"],
            "prompt_tokens_computed_on_vs_off": (on["prompt_tokens_computed"]
                                                 / max(1, off["prompt_tokens_computed"]))}


def identical(a: list[Any], b: list[Any]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def print_table(workload: str, arms: dict[str, dict[str, Any]], cmp: dict[str, Any]) -> None:
    print(f"{'arm':>15} {'wall s':>8} {'tok/s':>8} {'cached':>8} {'computed':>8} "
          f"{'recomputed':>10}" + (f" {'accuracy':>8}" if workload == "gsm8k" else ""))
    for name, r in arms.items():
        line = (f"{name:>15} {r['latency_s']:>8.1f} {r['output_throughput']:>8.1f} "
                f"{r['prompt_tokens_cached']:>8} {r['prompt_tokens_computed']:>8} "
                f"{r['prompt_recomputed_share']:>10.3f}")
        print(line + (f" {r['accuracy']:>8.3f}" if workload == "gsm8k" else ""))
        for i, t in enumerate(r.get("turns", [])):
            print(f"{'turn ' + str(i + 1):>15} {t['latency_s']:>8.1f} {'':>8} "
                  f"{t['prompt_tokens_cached']:>8} {t['prompt_tokens_computed']:>8} "
                  f"{'':>10} reusable {t['reusable_tokens']} of {t['prompt_tokens']}")
    if cmp:
        print(f"cache on / off: throughput x{cmp['throughput_ratio']:.2f}, prompt tokens "
              f"recomputed {100 * cmp['prompt_recomputed_share_on']:.1f}% with the cache, "
              f"identical outputs {cmp['identical_outputs']} of {cmp['outputs']}"
              + (f" (off vs off again: {cmp['identical_outputs_off_vs_off_again']})"
                 if "identical_outputs_off_vs_off_again" in cmp else ""))


if __name__ == "__main__":
    run_cli(main)
