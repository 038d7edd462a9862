"""The benchmark scripts end to end on CPU with the tiny checkpoint, and their pure parts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gsm8k, offline_throughput, plot, prefix_cache, remote, serving
from benchmarks.common import DATA_DIR, MODES, read_jsonl
from benchmarks.gsm8k_protocol import (
    PROTOCOLS,
    STOP,
    build_prompts,
    load_shots,
    sglang_answer,
    signed_answer,
)
from benchmarks.serving_metrics import aggregate, chunk_tokens
from benchmarks.stream_client import StreamRecord

ROOT = Path(__file__).resolve().parents[1]
TEST_ROWS = read_jsonl(DATA_DIR / "test.jsonl")

# ---- the GSM8K protocol ---------------------------------------------------------------------


@pytest.mark.parametrize(("index", "expected"), [
    (0, 18),            # Janet's ducks
    (146, 2125),        # "#### 2,125"
    (611, 1450000),     # "#### 1,450,000"
    (489, -10),         # "#### -10"
    (1113, -3),         # "-6 + 3 = -3 degrees ... #### -3"
])
def test_labels_of_real_gsm8k_answers(index: int, expected: int) -> None:
    assert PROTOCOLS["clean"].label(TEST_ROWS[index]) == expected
    assert PROTOCOLS["sglang"].label(TEST_ROWS[index]) == abs(expected)  # SGLang reads no sign


@pytest.mark.parametrize(("completion", "expected"), [
    (TEST_ROWS[0]["answer"], 18),
    (" She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18\n\n", 18),
    (" The total is 1,450,000 dollars.", 1450000),
    (" It was -3 degrees Celsius in the morning.", -3),
    (" 50,000-36,000 = 14,000 bars", 14000),           # a minus between digits subtracts
    (" He pays $3.50", 50),                            # the last integer, as SGLang reads it
    (" I do not know the answer.", None),
    ("", None),
])
def test_clean_answer(completion: str, expected: int | None) -> None:
    assert signed_answer(completion) == expected


@pytest.mark.parametrize(("completion", "expected"), [
    (TEST_ROWS[0]["answer"], 18),
    (" The total is 1,450,000 dollars.", 1450000),
    (" It was -3 degrees Celsius.", 3),                # no sign, as SGLang reads it
    (" He pays $3.50", 50),
    (" The answer is 05.", None),                      # a leading zero: invalid in SGLang
    (" 0 apples", 0),
    (" I do not know the answer.", None),
])
def test_sglang_answer(completion: str, expected: int | None) -> None:
    assert sglang_answer(completion) == expected


def test_prompt_format_and_shot_sources() -> None:
    shots = load_shots("train", 5, TEST_ROWS)
    assert shots[0]["question"].startswith("Natalia sold clips")
    prompt = build_prompts(TEST_ROWS[:1], shots)[0]
    first = f"Question: {shots[0]['question']}\nAnswer: {shots[0]['answer']}\n\n"
    assert prompt.startswith(first) and prompt.count("Question: ") == 6
    assert prompt.endswith(f"Question: {TEST_ROWS[0]['question']}\nAnswer:")
    assert load_shots("test", 5, TEST_ROWS) == TEST_ROWS[:5]  # SGLang's quirk
    assert PROTOCOLS["sglang"].shots(5, TEST_ROWS) == TEST_ROWS[:5]
    assert PROTOCOLS["clean"].shots(5, TEST_ROWS) == shots
    assert STOP == ["Question", "Assistant:", "<|separator|>"]


# ---- metrics on synthetic streams -------------------------------------------------------------


def _record(times: list[float], texts: list[str], usage: list[int] | None = None,
            completion_tokens: int | None = None) -> StreamRecord:
    return StreamRecord(prompt_len=10, max_tokens=64, ok=True, latency=times[-1] + 0.01,
                        chunk_times=times, chunk_texts=texts, chunk_usage=usage or [],
                        prompt_tokens=10, completion_tokens=completion_tokens,
                        finish_reason="stop")


def test_inter_token_latency_divides_each_gap_by_its_tokens() -> None:
    rec = _record([0.1, 0.3, 0.4], ["a", "b", "c"], usage=[4, 8, 10], completion_tokens=10)
    assert chunk_tokens(rec, None) == ([4, 4, 2], "per-chunk usage")
    m = aggregate([rec], duration=1.0, encode=None)
    assert m["itl_block_ms"]["mean"] == pytest.approx(150.0)  # gaps 200 and 100 ms
    # 4 gaps of 50 ms, 2 of 50 ms: every token of the second and third blocks counts once
    assert m["itl_token_ms"]["mean"] == pytest.approx(50.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert m["total_output_tokens"] == 10 and m["output_throughput"] == pytest.approx(10.0)


def test_retokenised_counts_and_unavailable_without_tokenizer() -> None:
    rec = _record([0.1, 0.2], ["one two ", "three"], completion_tokens=3)
    assert chunk_tokens(rec, str.split) == ([2, 1], "re-tokenised text")
    rec.completion_tokens = 6  # re-encoding disagrees with usage: scaled to add up to it
    assert chunk_tokens(rec, str.split) == ([4, 2], "re-tokenised text")
    m = aggregate([rec, StreamRecord(5, 8, error="HTTP 500: boom")], 1.0, None)
    assert m["itl_token_ms"] is None and m["completed"] == 1 and m["failed"] == 1
    assert m["errors"] == ["HTTP 500: boom"]


def test_remote_helpers() -> None:
    assert remote.api_root("http://h:1/v1/") == remote.api_root("http://h:1") == "http://h:1"
    assert remote.block_stats(None, 10)["tokens_per_forward"] is None
    delta = {"request_steps": 30, "wasted_request_steps": 10, "committed_blocks": 4}
    stats = remote.block_stats(delta, 40)
    assert stats["tokens_per_forward"] == 2.0 and stats["forwards_per_block_mean"] == 5.0


# ---- end to end on the tiny checkpoint -----------------------------------------------------------

GSM8K_FIELDS = ("accuracy", "invalid_rate", "failures", "latency_s", "request_latency_s",
                "output_tokens", "output_throughput", "tokens_per_forward",
                "forwards_per_block_mean", "forwards_per_block", "prompt_tokens_cached",
                "prompt_tokens_computed", "prompt_recomputed_share")
SERVING_FIELDS = ("completed", "failed", "duration_s", "request_throughput", "input_throughput",
                  "output_throughput", "total_token_throughput", "ttft_ms", "itl_block_ms",
                  "itl_token_ms", "tpot_ms", "e2e_latency_ms", "tokens_per_forward")
LATENCY_FIELDS = ("mean", "median", "p99")


def _engine_args(model_dir: Path) -> list[str]:
    return ["--model-path", str(model_dir), "--device", "cpu"]


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench_results")


@pytest.fixture(scope="module")
def gsm8k_engine_json(tiny_model_dir: Path, out_dir: Path) -> Path:
    path = out_dir / "gsm8k_engine.json"
    gsm8k.main([*_engine_args(tiny_model_dir), "--num-questions", "3", "--max-new-tokens", "40",
                "--parallel", "3", "--max-running-requests", "2", "--output", str(path)])
    return path


@pytest.fixture(scope="module")
def offline_json(tiny_model_dir: Path, out_dir: Path) -> Path:
    path = out_dir / "offline.json"
    offline_throughput.main([*_engine_args(tiny_model_dir), "--num-prompts", "4",
                             "--max-new-tokens", "40", "--max-running-requests", "2",
                             "--output", str(path)])
    return path


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path) -> str:
    """The session's real `python -m dllm_serve` (tests/http_helpers.py), idle."""
    from http_helpers import pools_whole, shared_server

    server = shared_server(tiny_model_dir)
    pools_whole(server)
    return server.base


@pytest.fixture(scope="module")
def serving_json(server_url: str, out_dir: Path) -> Path:
    path = out_dir / "serving.json"
    serving.main(["--base-url", server_url, "--dataset", "random", "--num-prompts", "6",
                  "--random-input-len", "48", "--random-output-len", "40",
                  "--request-rate", "20", "--max-concurrency", "3", "--output", str(path),
                  "--output-details"])
    return path


def test_gsm8k_engine_mode(gsm8k_engine_json: Path) -> None:
    result = _read(gsm8k_engine_json)
    r = result["results"]
    assert all(k in r for k in GSM8K_FIELDS) and r["num_questions"] == 3
    assert result["git_commit"] and result["config"]["backend"] == "engine"
    assert result["config"]["num_shots"] == 5 and result["config"]["stop"] == STOP
    assert result["config"]["protocol"] == "sglang" and result["config"]["shots_from"] == "test"
    assert all(k in r["request_latency_s"] for k in LATENCY_FIELDS)
    assert r["forwards_per_block"] and r["tokens_per_forward"] > 0
    # the server-side formula (request-steps minus waste) agrees with the per-block counts
    from_stats = remote.block_stats(r["server_stats"], r["output_tokens"])
    assert from_stats["tokens_per_forward"] == pytest.approx(r["tokens_per_forward"])
    assert len(result["questions"]) == 3 and result["questions"][0]["label"] == 18
    assert r["prompt_tokens_cached"] + r["prompt_tokens_computed"] == r["prompt_tokens"]


def test_gsm8k_server_mode(server_url: str, out_dir: Path) -> None:
    path = out_dir / "gsm8k_server.json"
    gsm8k.main(["--base-url", server_url, "--num-questions", "2", "--max-new-tokens", "40",
                "--parallel", "2", "--output", str(path)])
    r = _read(path)["results"]
    assert all(k in r for k in GSM8K_FIELDS) and r["failures"] == 0
    assert r["output_tokens"] > 0 and r["tokens_per_forward"] > 0
    assert r["source"].startswith("server")


def test_gsm8k_against_a_server_says_when_every_request_failed(server_url: str,
                                                              out_dir: Path, capsys) -> None:
    """Regression: with every request refused (a model the server does not serve) gsm8k
    exited 0 and counted the failures as unreadable answers; and its JSON saved engine flags
    (wavefront size, FDFO) that said nothing of the server."""
    path = out_dir / "gsm8k_failed.json"
    with pytest.raises(SystemExit) as exit_info:
        gsm8k.main(["--base-url", server_url, "--model", "nope", "--num-questions", "2",
                    "--max-new-tokens", "8", "--output", str(path)])
    assert exit_info.value.code == 1
    assert "2 of 2 requests failed" in capsys.readouterr().err
    result = _read(path)
    assert result["results"]["failures"] == 2 and result["results"]["invalid_rate"] == 0
    assert "dllm_wavefront_size" not in result["config"]
    assert "dllm_wavefront_size" in result["config"]["server_info"]


@pytest.mark.parametrize("argv,words", [
    (["gsm8k", "--num-questions", "0"], "must be >= 1"),
    (["serving", "--request-rate", "0"], "must be > 0"),
    (["gsm8k", "--base-url", "http://127.0.0.1:9", "--num-questions", "1"], "gsm8k: error: "),
    (["serving", "--base-url", "http://127.0.0.1:9", "--data-path", "/nonexistent.jsonl"],
     "serving: error: "),
])
def test_a_users_error_is_one_line_not_a_traceback(argv: list[str], words: str) -> None:
    """Regression: an unreachable server, a missing data file or a zero count ended in a
    traceback (ConnectError, FileNotFoundError, ZeroDivisionError)."""
    script, *args = argv
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr


def test_prefix_cache_gsm8k_runs_both_arms(tiny_model_dir: Path, out_dir: Path) -> None:
    path = out_dir / "prefix_cache_gsm8k.json"
    prefix_cache.main(["gsm8k", *_engine_args(tiny_model_dir), "--num-questions", "4",
                       "--max-new-tokens", "32", "--max-running-requests", "2",
                       "--arms", "cache_on,cache_off,cache_off_again", "--output", str(path)])
    arms = _read(path)["arms"]
    on, off = arms["cache_on"], arms["cache_off"]
    assert arms["cache_off_again"]["prompt_tokens_cached"] == 0
    assert on["prompt_tokens"] == off["prompt_tokens"] > 0
    # the 5 shots are shared: later requests take them from the cache
    assert on["prompt_tokens_cached"] > 0 and off["prompt_tokens_cached"] == 0
    assert on["prompt_tokens_cached"] + on["prompt_tokens_computed"] == on["prompt_tokens"]
    cmp = _read(path)["comparison"]
    assert cmp["throughput_ratio"] > 0 and cmp["identical_outputs"] == cmp["outputs"] == 4
    assert cmp["identical_outputs_off_vs_off_again"] == 4  # fp32 on the CPU: no noise


def test_prefix_cache_chat_reuses_earlier_turns(tiny_model_dir: Path, out_dir: Path) -> None:
    path = out_dir / "prefix_cache_chat.json"
    prefix_cache.main(["chat", *_engine_args(tiny_model_dir), "--conversations", "2",
                       "--turns", "3", "--max-new-tokens", "40", "--output", str(path)])
    arms = _read(path)["arms"]
    on, off = arms["cache_on"]["turns"], arms["cache_off"]["turns"]
    assert len(on) == 3 and [t["prompt_tokens"] for t in on] == [t["prompt_tokens"] for t in off]
    assert all(t["prompt_tokens_cached"] == 0 for t in off)
    assert all(t["prompt_tokens_cached"] > 0 for t in on[1:])  # earlier turns' blocks
    cmp = _read(path)["comparison"]
    assert cmp["identical_outputs"] == cmp["outputs"] == 6


def test_offline_throughput(offline_json: Path) -> None:
    result = _read(offline_json)
    runs = {(r["mode"], r["max_running_requests"]): r for r in result["runs"]}
    assert set(runs) == {("sync", 2), ("fdfo", 2)}
    for run in runs.values():
        for key in ("output_throughput", "tokens_per_forward", "forwards_per_block_mean",
                    "wasted_request_steps", "e2e_latency_s"):
            assert key in run
    assert runs[("fdfo", 2)]["wasted_request_steps"] == 0
    assert set(result["fdfo_over_sync"]) == {"2"} and result["git_commit"]


def test_serving_random_poisson(serving_json: Path) -> None:
    result = _read(serving_json)
    r = result["results"]
    assert all(k in r for k in SERVING_FIELDS)
    assert r["completed"] == 6 and r["failed"] == 0
    for key in ("ttft_ms", "itl_block_ms", "itl_token_ms", "e2e_latency_ms"):
        assert all(r[key][k] is not None for k in LATENCY_FIELDS), key
    # ignore_eos: each request produced exactly its random output length, from usage
    details = result["details"]
    assert all(d["output_tokens"] == d["max_tokens"] for d in details)
    assert r["total_output_tokens"] == sum(d["max_tokens"] for d in details)
    assert result["config"]["server_mode"] in MODES and r["tokens_per_forward"] > 0
    assert r["chunk_tokens_source"] == ["re-tokenised text"]  # tokenizer found via server info


def test_serving_gsm8k_prompts_inf_rate(server_url: str, out_dir: Path) -> None:
    path = out_dir / "serving_gsm8k.json"
    serving.main(["--base-url", server_url, "--num-prompts", "2", "--gsm8k-output-len", "40",
                  "--num-shots", "1", "--output", str(path)])
    r = _read(path)["results"]
    assert r["completed"] == 2 and r["total_input_tokens"] > 0


def test_plot_writes_pngs(gsm8k_engine_json: Path, offline_json: Path, serving_json: Path,
                          tmp_path: Path) -> None:
    written = plot.main([str(gsm8k_engine_json.parent), "--out-dir", str(tmp_path)])
    names = {p.name for p in written}
    assert names == {"throughput_vs_concurrency.png", "latency_vs_concurrency.png",
                     "forwards_per_block.png", "accuracy_vs_tpf.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


@pytest.mark.parametrize("script", ["gsm8k", "serving", "offline_throughput", "plot",
                                    "moe_tune", "host_copy_bench", "abort_burst",
                                    "detokenize", "gc_pauses"])
def test_runs_as_a_script_with_help(script: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--help"],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_attention_tune_matches_the_default_launch() -> None:
    """The sweep runs the kernel (interpreted on the CPU) under each launch configuration and
    every configuration's output equals the default one's; the module constants come back."""
    from benchmarks import attention_tune
    from dllm_serve.kernels import block_attention as ba

    before = (ba.MAX_BLOCK_M, ba.TILE_TOKENS, ba.LAUNCHES)
    result = attention_tune.main(["--device", "cpu", "--batch-sizes", "2", "--prefixes", "64",
                                  "--block-m", "64", "128", "--block-n", "32", "--warps", "4",
                                  "--stages", "2", "--programs-per-sm", "1", "--iters", "1",
                                  "--launches", "1"])
    rows = result["rows"]
    assert len(rows) == 2 and all("error" not in r for r in rows)
    assert all(r["max_abs_err"] < 0.05 and r["us"] > 0 for r in rows)
    assert (ba.MAX_BLOCK_M, ba.TILE_TOKENS, ba.LAUNCHES) == before


def test_moe_tune_smoke_on_the_cpu(tmp_path: Path) -> None:
    """The MoE launch sweep (interpreted, tiny expert shapes): both kernels under each launch
    equal the default launch's output, the default is always measured, and the printed table
    names a launch per kernel for each size."""
    from benchmarks import moe_tune

    out = tmp_path / "moe_tune.json"
    result = moe_tune.main(["--device", "cpu", "--preset", "tiny", "--tokens", "4", "16",
                            "--block-n", "32", "--block-k", "32", "--warps", "4", "--stages",
                            "2", "--iters", "1", "--launches", "1", "--out", str(out)])
    rows = result["rows"]
    assert rows and all("error" not in r and r["max_abs_err"] < 1e-4 for r in rows)
    assert {(r["tokens"], r["kernel"]) for r in rows} == {(t, k) for t in (4, 16)
                                                          for k in ("up", "down")}
    for s in result["summary"]:
        assert s["up"]["default_us"] and s["down"]["default_us"] and s["fused_experts_us"]
    assert result["table"].count("MoeLaunch(") == 4
    assert json.loads(out.read_text())["table"] == result["table"]


def test_runtime_bench_sizes_interleaved_pools_from_the_models_context() -> None:
    """Interleaved engines of the built-in model get a KV pool of (C + 1) contexts, the
    context read from the model's own config (not a constant beside it)."""
    from benchmarks import runtime_bench
    from dllm_serve.default_model import default_model_path

    ns = runtime_bench.parse_args(["--interleave", "--concurrency", "16"])
    suite = runtime_bench.suites(ns)["default-model"]
    kw = runtime_bench.engine_kwargs(ns, suite, suite.settings[0], None, None)
    context = json.loads((default_model_path() / "config.json").read_text())
    assert kw["max_total_tokens"] == 17 * context["max_position_embeddings"]
    ns = runtime_bench.parse_args(["--concurrency", "16"])  # one at a time: the default pool
    assert "max_total_tokens" not in runtime_bench.engine_kwargs(ns, suite, suite.settings[0],
                                                                 None, None)


def test_runtime_bench_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/runtime_bench.py end to end (three engines of the built-in model, up at once
    with their runs taking turns; two prompts per client slot: the closed loop of coroutines):
    rows for each setting, each from its own engine's trace, and the FDFO / sync and W=2 / W=1
    ratios."""
    from benchmarks import runtime_bench

    out = tmp_path / "runtime.json"
    result = runtime_bench.main(["--suite", "default-heldout", "--device", "cpu",
                                 "--settings", "fdfo", "sync", "fdfo-w2",
                                 "--w2-concurrency", "2", "--max-new-tokens", "32",
                                 "--prompts-per-slot", "2", "--repeats", "2", "--interleave",
                                 "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == result["runs"]
    assert [r["setting"] for r in result["runs"]] == ["fdfo", "sync", "fdfo-w2"]
    for run in result["runs"]:
        assert run["concurrency"] == 2 and run["prompts"] == 4 and run["output_tokens"] > 0
        assert run["forwards"] > 0 and 0 < run["busy_fraction"] <= 1.0
        assert len(run["tok_s_repeats"]) == 2 and run["output_tokens_per_s"] == max(
            run["tok_s_repeats"])
    # each engine traced its own forwards: W=2 keeps more rows busy than W=1 does
    by = {r["setting"]: r for r in result["runs"]}
    assert by["fdfo-w2"]["rows_mean"] > by["fdfo"]["rows_mean"]
    assert set(result["fdfo_over_sync"]) == {"default-heldout C=2"}
    assert set(result["w2_over_w1"]) == {"default-heldout C=2"}
    turns = result["w2_over_w1_turns"]["default-heldout C=2"]  # interleaved: turn by turn
    assert turns == [a / b for a, b in zip(by["fdfo-w2"]["tok_s_repeats"],
                                           by["fdfo"]["tok_s_repeats"], strict=True)]
    assert min(turns) <= result["w2_over_w1_median"]["default-heldout C=2"] <= max(turns)


def test_runtime_bench_without_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-trace: the engine's worker runs without a trace (none is asked for in its
    environment, nothing is written), and a run reports tok/s without the trace's figures."""
    import dllm_serve
    from benchmarks import runtime_bench
    from dllm_serve.managers.round_trace import TRACE_ENV

    engine, seen = dllm_serve.Engine, []

    def spy(**kw: Any) -> Any:  # the environment the worker process starts with
        seen.append(os.environ.get(TRACE_ENV))
        return engine(**kw)

    monkeypatch.delenv(TRACE_ENV, raising=False)
    monkeypatch.setattr(dllm_serve, "Engine", spy)
    monkeypatch.setattr(runtime_bench, "read_trace", None)  # never called
    result = runtime_bench.main(["--suite", "default-heldout", "--device", "cpu",
                                 "--settings", "fdfo", "--w2-concurrency", "2",
                                 "--max-new-tokens", "32", "--repeats", "1", "--no-trace"])
    (run,) = result["runs"]
    assert seen == [None]
    assert run["output_tokens"] > 0 and run["output_tokens_per_s"] > 0
    assert "busy_fraction" not in run and "host_ms_per_forward" not in run


def test_worker_host_benchmark_times_the_workers_phases() -> None:
    """--phases: each phase of the worker and the scheduler timed per committed block, the
    nested ones within theirs (inclusive times), one collect and one report a forward, a
    refresh per row the readouts flagged."""
    from benchmarks import worker_host

    (row,) = worker_host.main(["--running", "8", "--modes", "fdfo", "--prompts-per-slot", "2",
                               "--max-new-tokens", "64", "--wavefront", "2", "--phases"])
    us, calls = row["phase_us_per_block"], row["phase_calls_per_forward"]
    assert set(us) == {name for name, _, _ in worker_host.PHASES} == set(calls)
    assert all(v > 0 for v in us.values())
    assert us["collect"] > us["readout flags"] + us["refresh"] + us["advance"]
    assert us["scheduler: report"] > us["scheduler: cache insert"] + us[
        "scheduler: finish check"]
    assert us["scheduler: admission"] > us["scheduler: admission pages"]
    assert calls["collect"] == calls["readout flags"] == calls["advance"] == 1.0
    assert calls["refresh"] > 0


def test_worker_host_benchmark_counts_layout_ops(tmp_path: Path) -> None:
    """benchmarks/worker_host.py: every request finishes; FDFO changes its layout about every
    forward (row writes: torch ops in layout()), sync only at batch boundaries; the worker's
    count (without the step) includes layout()'s."""
    from benchmarks import worker_host

    out = tmp_path / "wh.json"
    rows = worker_host.main(["--running", "8", "--prompts-per-slot", "2", "--max-new-tokens",
                             "64", "--count-ops", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows
    by_mode = {r["mode"]: r for r in rows}
    assert all(r["finished"] == r["requests"] == 16 and r["forwards"] > 0 for r in rows)
    # 64 new tokens a request, EOS ignored: two or three committed blocks each (the first
    # holds the prompt's tail), timed per block too
    assert all(2 * 16 <= r["blocks"] <= 3 * 16 and r["worker_host_us_per_block_without_step"] > 0
               and r["scheduler_us_per_block"] > 0 for r in rows)
    assert by_mode["fdfo"]["layout_ops_per_forward"] > 3 * by_mode["sync"]["layout_ops_per_forward"]
    assert by_mode["sync"]["layout_ops_per_forward"] > 0
    assert all(r["worker_ops_per_forward"] >= r["layout_ops_per_forward"] for r in rows)


def test_worker_host_wavefront_refreshes_only_changed_rows() -> None:
    """W = 2: every request finishes, and the worker looks at the readout rows whose flags
    changed (readiness, convergence), not at every row of every forward."""
    from benchmarks import worker_host

    (row,) = worker_host.main(["--running", "8", "--modes", "fdfo", "--wavefront", "2",
                               "--prompts-per-slot", "2", "--max-new-tokens", "64"])
    assert row["finished"] == row["requests"] == 16
    assert 0 < row["refreshes_per_forward"] < row["rows_per_forward"] / 2


def counted(fn: Any, calls: list[Any]) -> Any:
    """fn, recording each call's first argument in `calls`."""

    def wrapper(arg: Any, *rest: Any) -> Any:
        calls.append(arg)
        return fn(arg, *rest)

    return wrapper


def test_worker_host_pool_size_sets_what_the_radix_cache_evicts() -> None:
    """--pages-per-slot: with the radix cache on, the default pool fills and the cache evicts
    on admissions; a pool of 1000 pages a slot (a GPU's) never evicts. Every request finishes
    either way."""
    from benchmarks import worker_host

    evicted = {}
    for pages in (16, 1000):
        e = worker_host.loaded(4, True, 1, 8, 32, 0, 1, 3.0, True, False, pages)
        tree = e.sched.alloc.tree
        assert tree is not None
        calls: list[int] = []
        tree.evict = counted(tree.evict, calls)  # type: ignore[method-assign]
        while e.step():
            pass
        assert sum(1 for o in e.outputs.values() if o and o[-1].finished) == 4 * 8
        evicted[pages] = len(calls)
    assert evicted[16] > 0 and evicted[1000] == 0


def test_worker_host_takes_the_median_of_repeats() -> None:
    """With several runs, each timed figure is their median and the runs' values are kept;
    counts come from the first run."""
    from benchmarks import worker_host

    runs = [{"forwards": 10, **{k: float(v) for k in worker_host.TIMED}} for v in (3, 1, 2)]
    row = worker_host.median_of(runs)
    assert row["forwards"] == 10
    for k in worker_host.TIMED:
        assert row[k] == 2.0 and row["repeats"][k] == [3.0, 1.0, 2.0]
    assert worker_host.median_of(runs[:1]) == runs[0]


class CountingEngine:
    """Answers each prompt with itself, counting how many requests are in flight at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0

    def _enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def _leave(self) -> None:
        with self.lock:
            self.now -= 1

    def generate(self, prompt, params):  # type: ignore[no-untyped-def]
        if isinstance(prompt, list):
            return [{"text": p} for p in prompt]
        self._enter()
        time.sleep(0.002)
        self._leave()
        return {"text": prompt}

    async def async_generate(self, prompt, params):  # type: ignore[no-untyped-def]
        self._enter()
        await asyncio.sleep(0.002)
        self._leave()
        return {"text": prompt}


@pytest.mark.parametrize("clients", ["async", "threads"])
def test_runtime_bench_closed_loop_keeps_c_in_flight(clients: str) -> None:
    """runtime_bench's closed loop: every prompt answered, in prompt order, with exactly C
    requests in flight at the most (coroutines or threads alike)."""
    from benchmarks.runtime_bench import generate

    engine = CountingEngine()
    prompts = [f"p{i}" for i in range(40)]
    outs = generate(engine, prompts, {}, 4, clients)
    assert [o["text"] for o in outs] == prompts
    assert engine.most == 4 and engine.now == 0


def test_runtime_bench_engine_clients_submit_everything_in_one_call() -> None:
    """--clients engine: every prompt in one Engine.generate call (the scheduler, at
    max_running_requests = the concurrency, queues the rest), and only with one concurrency
    per setting (the engine's limit is fixed when it starts)."""
    from benchmarks import runtime_bench

    calls: list[list[str]] = []

    class Recorder:
        def generate(self, prompts: list[str], params: dict) -> list[dict]:
            calls.append(list(prompts))
            return [{} for _ in prompts]

    prompts = [f"p{i}" for i in range(12)]
    assert len(runtime_bench.generate(Recorder(), prompts, {}, 4, "engine")) == 12
    assert calls == [prompts]
    ns = runtime_bench.parse_args(["--clients", "engine", "--concurrency", "16",
                                   "--mini-concurrency", "16"])
    kw = runtime_bench.engine_kwargs(ns, runtime_bench.suites(ns)["default-heldout"],
                                     runtime_bench.suites(ns)["default-heldout"].settings[0],
                                     None, None)
    assert kw["max_running_requests"] == 16
    with pytest.raises(SystemExit):
        runtime_bench.parse_args(["--clients", "engine"])  # four concurrencies by default


def test_torch_attention_groups_benchmark(tmp_path: Path) -> None:
    """benchmarks/torch_attention_groups.py: a row per GROUP_COST, one group when splitting
    never pays and more when it always does; the module's own GROUP_COST is left as it was."""
    from benchmarks import torch_attention_groups as bench
    from dllm_serve.layers import attention

    before = attention.GROUP_COST
    out = tmp_path / "groups.json"
    rows = bench.main(["--repeats", "1", "--rows", "6", "--costs", str(10 ** 9), "0",
                       "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows
    assert [r["group_cost"] for r in rows] == [10 ** 9, 0]
    assert rows[0]["groups_per_forward"] == 1.0 < rows[1]["groups_per_forward"]
    assert all(r["ms_per_forward"] > 0 for r in rows)
    assert attention.GROUP_COST == before


def test_front_tokenize_benchmark(tmp_path: Path) -> None:
    """benchmarks/front_tokenize.py: both ways timed (it asserts they give the same ids) and
    saved."""
    from benchmarks import front_tokenize as bench

    out = tmp_path / "tok.json"
    got = bench.main(["--prompts", "32", "--repeats", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["one_by_one_ms"] == got["one_by_one_ms"] > 0
    assert saved["batch_ms"] == got["batch_ms"] > 0


def test_worker_host_messages_go_through_the_codec_and_change_nothing() -> None:
    """--messages: the scheduler's batches, the worker's reports and the outputs go through
    the wire codec (the worker runs on the decoded items, the scheduler on the decoded
    report), and the run is the same one: the same forwards, blocks and tokens."""
    from benchmarks import worker_host

    runs = {}
    for messages in (False, True):
        e = worker_host.loaded(4, True, 1, 4, 64, 0, 2, 3.0, True, True, 1000, messages)
        applied: list[Any] = []  # the item lists the worker applied
        e.worker.apply_all = counted(e.worker.apply_all, applied)  # type: ignore[method-assign]
        while e.step():
            pass
        sent = {id(x) for x in e.sent}  # the scheduler's own items
        admits = [x for items in applied for x in items if type(x).__name__ == "Admit"]
        assert len(admits) == 16 and all((id(x) in sent) != messages for x in admits)
        runs[messages] = ({rid: e.tokens(rid) for rid in e.outputs},
                          sum(r.forwards for r in e.reports), e.sched.stats["committed_blocks"])
        assert sum(1 for o in e.outputs.values() if o and o[-1].finished) == 4 * 4
    assert runs[True] == runs[False]


def script_rows(tmp_path: Path, script: str, *args: str) -> list[dict[str, Any]]:
    """Run benchmarks/<script>.py with args and --out, as a user would; the rows it saved."""
    out = tmp_path / f"{script}.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args,
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())["rows"]


def test_abort_burst_aborts_every_queued_request(tmp_path: Path) -> None:
    """The burst benchmark queues N requests, aborts each by its rid and reports the time."""
    from benchmarks.abort_burst import burst

    assert burst(50) > 0.0
    rows = script_rows(tmp_path, "abort_burst", "--queued", "20", "40", "--repeats", "1")
    assert [r["queued"] for r in rows] == [20, 40]
    assert all(r["us_per_abort"] == pytest.approx(1e6 * r["burst_s"] / r["queued"])
               for r in rows)


def test_detokenize_streams_the_whole_text(tmp_path: Path) -> None:
    """The detokenisation benchmark streams a request's output block by block (it asserts the
    deltas make the whole text) and checks a stop_regex at every commit (it asserts the whole
    output is kept), streams it again with long stop strings held back, and reports the time
    a request and a block of each."""
    rows = script_rows(tmp_path, "detokenize", "--tokens", "64", "200", "--repeats", "1",
                       "--long-stops", "5", "50")
    assert [r["tokens"] for r in rows] == [64, 200]
    for r in rows:
        assert r["long_stops_us_per_block"] > 0
        blocks = -(-r["tokens"] // 32)
        assert r["us_per_block"] == pytest.approx(1e3 * r["request_ms"] / blocks)
        assert r["stop_regex_us_per_block"] == pytest.approx(
            1e3 * r["stop_regex_request_ms"] / blocks)


def test_gc_pauses_sums_each_process_collections_inside_the_window(tmp_path: Path) -> None:
    """gc_pauses.py: the records of every process (this one and the Engine's children, through
    the sitecustomize hook) summed per process and generation, only inside the burst's window;
    a run through a real Engine writes its rows."""
    from benchmarks.gc_pauses import summarize

    recs = [{"t": 1.0, "proc": "dllm-serve-scheduler", "gen": 2, "ms": 80.0, "tracked": 9},
            {"t": 5.0, "proc": "dllm-serve-scheduler", "gen": 2, "ms": 20.0, "tracked": 7},
            {"t": 6.0, "proc": "dllm-serve-scheduler", "gen": 2, "ms": 5.0, "tracked": 8},
            {"t": 6.5, "proc": "dllm-serve-worker", "gen": 0, "ms": 0.5, "tracked": None},
            {"t": 9.0, "proc": "dllm-serve-worker", "gen": 0, "ms": 3.0, "tracked": None}]
    rows = summarize(recs, 2.0, 8.0)
    assert rows == [
        {"process": "dllm-serve-scheduler", "generation": 2, "collections": 2,
         "total_ms": 25.0, "longest_ms": 20.0, "tracked_max": 8},
        {"process": "dllm-serve-worker", "generation": 0, "collections": 1, "total_ms": 0.5,
         "longest_ms": 0.5, "tracked_max": None}]
    out = tmp_path / "gc.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gc_pauses.py"),
                           "--requests", "24", "--bursts", "2", "--max-new-tokens", "8",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert len(result["burst_s"]) == 2 and {r["process"] for r in result["rows"]} <= {
        "MainProcess", "dllm-serve-scheduler", "dllm-serve-worker"}
    assert all(r["collections"] >= 1 and r["total_ms"] >= r["longest_ms"] > 0
               for r in result["rows"])
