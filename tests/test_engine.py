"""The offline Engine over the real scheduler and worker processes (tiny checkpoint, CPU)."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from http_helpers import whole

from dllm_serve import Engine
from dllm_serve.errors import EngineDeadError, RequestError


def make_engine(model_dir: Path, **kw) -> Engine:
    args = {"model_path": str(model_dir), "device": "cpu", "log_level": "warning",
            "max_running_requests": 8, **kw}
    return Engine(**args)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    with make_engine(tiny_model_dir) as e:
        yield e


def assert_pools_whole(engine: Engine) -> None:
    info = engine.get_server_info()
    assert whole(info), (info["kv_pool"], info["req_pool"], info["radix_cache"])


def test_generate_single_batch_and_ids(engine: Engine) -> None:
    one = engine.generate("Hello", {"max_new_tokens": 40, "ignore_eos": True})
    assert one["meta_info"]["completion_tokens"] == 40 == len(one["output_ids"])
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert one["meta_info"]["blocks"] == 2 and len(one["meta_info"]["block_forwards"]) == 2
    assert one["meta_info"]["block_edits"] == [0, 0]  # LowConfidence never edits
    many = engine.generate(["a", "bb"], [{"max_new_tokens": 3}, {"max_new_tokens": 5,
                                                                 "ignore_eos": True}])
    assert [m["meta_info"]["prompt_tokens"] for m in many] == [1, 2]
    assert many[1]["meta_info"]["completion_tokens"] == 5
    by_ids = engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2})
    assert by_ids[0]["meta_info"]["prompt_tokens"] == 3
    assert_pools_whole(engine)


def test_scheduler_and_worker_froze_their_startup_objects(engine: Engine) -> None:
    """Each child process moved what its startup made (modules, torch, the model) out of the
    cyclic collector's reach before it reported ready (`procs.freeze_startup_objects`), so no
    full collection while serving scans them."""
    startup = engine.get_server_info()["startup"]
    assert startup["worker_gc_frozen"] > 1000 and startup["scheduler_gc_frozen"] > 1000


def test_the_scheduler_process_never_imports_torch(engine: Engine) -> None:
    """The scheduler's modules and its frozen config (managers/scheduler_config.py,
    engine_config.py, dllm/modes.py, model/config.py) are torch-free: its process holds none of
    torch's memory, objects or import time."""
    assert engine.get_server_info()["startup"]["scheduler_torch_loaded"] is False


def test_a_batch_is_submitted_with_the_collector_paused(engine: Engine, monkeypatch) -> None:
    """generate / async_generate submit a batch with Python's cyclic collector off (a full
    collection of the caller's process mid-submission left the scheduler without requests),
    and turn it back on after, unless the caller had it off."""
    import asyncio
    import gc

    seen: list[bool] = []
    submit = engine.front.submit

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return submit(*args, **kwargs)

    monkeypatch.setattr(engine.front, "submit", spy)
    params = {"max_new_tokens": 2}
    assert gc.isenabled()
    engine.generate(["a", "b", "c"], params)
    asyncio.run(engine.async_generate(["d", "e"], params))
    assert seen == [False] * 5 and gc.isenabled()
    gc.disable()
    try:
        engine.generate(["f"], params)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_many_concurrent_requests_finish_with_exact_lengths(engine: Engine) -> None:
    prompts = [("word " * (1 + 7 * i % 60)).strip() for i in range(32)]
    lengths = [1 + (13 * i) % 90 for i in range(32)]
    params = [{"max_new_tokens": n, "ignore_eos": True} for n in lengths]
    outs = engine.generate(prompts, params)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == lengths
    assert all(len(o["output_ids"]) == n for o, n in zip(outs, lengths, strict=True))
    assert_pools_whole(engine)


def test_stream_matches_non_stream(engine: Engine) -> None:
    params = {"max_new_tokens": 70, "ignore_eos": True}
    full = engine.generate("stream me", params)
    chunks = list(engine.generate("stream me", params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum(len(c["output_ids"]) for c in chunks) == 70
    assert len(chunks) == 3 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_async_generate_equals_generate(engine: Engine) -> None:
    """One event loop keeps many requests in flight; results, batches and streams are those of
    the blocking API (greedy decoding: identical outputs)."""
    prompts = [f"async {i}" for i in range(12)]
    params = [{"max_new_tokens": 5 + 7 * i, "ignore_eos": True} for i in range(12)]
    blocking = engine.generate(prompts, params)

    async def main() -> tuple[list, list, list, dict]:
        singles = await asyncio.gather(*(engine.async_generate(p, q)
                                         for p, q in zip(prompts, params, strict=True)))
        batch = await engine.async_generate(prompts[:3], params[:3])
        chunks = [c async for c in await engine.async_generate(prompts[5], params[5],
                                                                 stream=True)]
        by_ids = await engine.async_generate(input_ids=[5, 6, 7],
                                             sampling_params={"max_new_tokens": 2})
        return singles, batch, chunks, by_ids

    singles, batch, chunks, by_ids = asyncio.run(main())
    ids = [o["output_ids"] for o in blocking]
    assert [o["output_ids"] for o in singles] == ids
    assert [o["output_ids"] for o in batch] == ids[:3]
    assert [t for c in chunks for t in c["output_ids"]] == ids[5]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert by_ids["meta_info"]["prompt_tokens"] == 3
    assert_pools_whole(engine)


def watch_endings(engine: Engine, monkeypatch) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """rid -> the finish reason's type of each request submitted from now on, once it ends."""
    endings: dict[str, str] = {}
    submit = engine.front.submit

    def spy(ids, params, callback, rid=None):  # type: ignore[no-untyped-def]
        def seen(out) -> None:  # type: ignore[no-untyped-def]
            if out.finished:
                endings[out.rid] = out.finish_reason["type"]
            callback(out)

        return submit(ids, params, seen, rid)

    monkeypatch.setattr(engine.front, "submit", spy)
    return endings


def wait_idle(engine: Engine) -> None:
    deadline = time.monotonic() + 60
    while engine.front.num_pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.front.num_pending() == 0


def test_stream_left_early_aborts(engine: Engine, monkeypatch) -> None:
    """Closing generate's stream after its first block aborts the request (an abort, not its
    2000 tokens) and frees its slot and pages."""
    endings = watch_endings(engine, monkeypatch)
    stream = engine.generate("leave me", {"max_new_tokens": 2000, "ignore_eos": True},
                             stream=True)
    assert next(stream)["output_ids"]
    stream.close()
    wait_idle(engine)
    assert list(endings.values()) == ["abort"]
    assert_pools_whole(engine)


def test_async_generate_cancelled_or_left_early_aborts(engine: Engine, monkeypatch) -> None:
    """A cancelled await and a stream left after its first block abort their requests (each
    ends with an abort, not its 2000 tokens): the pools are whole again, and a bad request
    raises before anything runs."""
    long = {"max_new_tokens": 2000, "ignore_eos": True}
    endings = watch_endings(engine, monkeypatch)

    async def main() -> None:
        task = asyncio.ensure_future(engine.async_generate(["cancel me", "me too"], long))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = await engine.async_generate("leave me", long, stream=True)
        async for chunk in stream:
            assert chunk["output_ids"]
            break
        await stream.aclose()
        with pytest.raises(RequestError, match="empty"):
            await engine.async_generate("", {"max_new_tokens": 4})

    asyncio.run(main())
    wait_idle(engine)
    assert sorted(endings.values()) == ["abort"] * 3
    assert_pools_whole(engine)


def test_an_interrupted_generate_aborts_its_requests(engine: Engine, monkeypatch) -> None:
    """Regression: Ctrl-C (KeyboardInterrupt) while generate waited left its requests running
    to their full length, holding their slots and pages."""
    import dllm_serve.engine as engine_module

    endings = watch_endings(engine, monkeypatch)
    wait = engine_module._last

    def interrupted(q):  # type: ignore[no-untyped-def]
        q.get(timeout=60)  # the first block came: the requests run
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module, "_last", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(["stop us", "us too"], {"max_new_tokens": 2000, "ignore_eos": True})
    monkeypatch.setattr(engine_module, "_last", wait)
    wait_idle(engine)
    assert sorted(endings.values()) == ["abort", "abort"]
    assert_pools_whole(engine)


def test_abort_mid_generation_frees_everything(engine: Engine) -> None:
    got: queue.Queue = queue.Queue()
    ids = engine.front.tokenize("abort me")
    from dllm_serve.sampling_params import SamplingParams

    rid = engine.front.submit(ids, SamplingParams(max_new_tokens=2000, ignore_eos=True), got.put)
    first = got.get(timeout=60)
    assert not first.finished
    engine.abort(rid)
    while not (last := got.get(timeout=60)).finished:
        pass
    assert last.finish_reason["type"] == "abort"
    assert_pools_whole(engine)


def test_a_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(
        engine: Engine, monkeypatch) -> None:
    """`Tokenizer.min_tokens` (visible characters over 4 x the longest token's) bounds a text's
    tokens from below: past the context the front answers 400 at once, without the seconds a
    body's worth of text takes to encode; below it the text is encoded as before."""
    front = engine.front
    encoded: list[int] = []
    encode = front.tokenizer.encode
    monkeypatch.setattr(front.tokenizer, "encode",
                        lambda text, *a, **k: encoded.append(len(text)) or encode(text, *a, **k))
    longest = 4 * front.tokenizer.max_token_chars * front.context_length
    with pytest.raises(RequestError, match="at least .* tokens.* longer than the model's context"):
        engine.generate("x" * longest + " " * 1000, {"max_new_tokens": 4})
    with pytest.raises(RequestError, match="longer than the model's context"):
        engine.generate(["a", "y" * longest], {"max_new_tokens": 4})  # a batch: each checked
    assert encoded == []
    with pytest.raises(RequestError, match="longer than the model's context"):  # encoded: its
        engine.generate("x" * (longest - 1), {"max_new_tokens": 4})  # real count is past it
    assert encoded == [longest - 1]


def test_min_tokens_is_a_lower_bound_of_the_token_count(engine: Engine) -> None:
    """Texts of many kinds (prose, digits, whitespace runs, symbols, other scripts, special
    tokens written out) never encode to fewer tokens than `min_tokens` says, and `encode`
    (a batch of one, so that it lets go of the GIL) gives the ids the single encode gives."""
    tok = engine.front.tokenizer
    rng = np.random.default_rng(3)
    pieces = ["The answer is 42. ", "1234567890" * 3, " " * 40, "\n\n\t", "=" * 64, "日本語の文章",
              "émigré naïve ", "<|endoftext|>", "<|mask|>", "🙂" * 5, "a" * 300, "\u3000\u00a0"]
    for _ in range(300):
        text = "".join(rng.choice(pieces, int(rng.integers(1, 60))))
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.min_tokens(text) <= len(ids)
        assert ids == tok._tok.encode(text, add_special_tokens=False).ids


def test_bad_requests_raise_and_engine_stays_up(engine: Engine) -> None:
    with pytest.raises(RequestError, match="empty"):
        engine.generate("", {"max_new_tokens": 4})
    with pytest.raises(RequestError, match="out of vocabulary"):
        engine.generate(input_ids=[1, 10**7])
    with pytest.raises(RequestError, match="longer than the model's context"):
        engine.generate(input_ids=[5] * 5000)
    with pytest.raises(RequestError, match="unsupported sampling parameter"):
        engine.generate("x", {"max_tokens": 4})
    with pytest.raises(RequestError, match="dllm_edit_threshold is not a setting"):
        engine.generate("x", {"dllm_edit_threshold": 0.5})
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    ok = engine.generate("x", {"max_new_tokens": 4, "dllm_threshold": 0.5, "ignore_eos": True})
    assert ok["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize("kwargs,field", [
    ({"sampling_params": {"n": 0}}, "n must be"),
    ({"sampling_params": {"n": 129}}, "n must be"),
    ({"sampling_params": {"n": 1.5}}, "n must be"),
    ({"sampling_params": {"n": "2"}}, "n must be"),
    ({"rid": ""}, "rid"), ({"rid": 5}, "rid"),
    ({"input_ids": [5.7, 6], "prompt": None}, "input_ids must hold integers"),
    ({"input_ids": [True, 6], "prompt": None}, "input_ids must hold integers"),
    ({"input_ids": ["a"], "prompt": None}, "input_ids must hold integers"),
    ({"input_ids": [[5], ["a"]], "prompt": None}, "input_ids must hold integers"),
    ({"prompt": [123]}, "prompt must be a string"),
    ({"prompt": "a\ud800b"}, "lone surrogate"),
    ({"sampling_params": "x"}, "sampling_params must be a dict")])
def test_malformed_arguments_raise_a_request_error_naming_them(engine: Engine, kwargs: dict,
                                                                field: str) -> None:
    """What the HTTP routes' schemas refuse, the offline API refuses too, with a RequestError
    (n was checked only after the copies had n = 1: 0 ran once, 200 ran 200 requests)."""
    args = {"prompt": "x", "sampling_params": {"max_new_tokens": 2}, **kwargs}
    with pytest.raises(RequestError, match=field):
        engine.generate(**args)
    assert engine.front.num_pending() == 0


def test_ids_as_an_array_and_a_batch_with_a_rid_twice(engine: Engine) -> None:
    """input_ids as a numpy array are its list; a batch naming one rid twice runs nothing."""
    ids = np.array([5, 6, 7])
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2})
    assert out["output_ids"] == engine.generate(input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 2})["output_ids"]
    with pytest.raises(RequestError, match="same id twice"):
        engine.generate(["a", "b"], {"max_new_tokens": 300, "ignore_eos": True},
                        rid=["dup", "dup"])
    assert engine.get_server_info()["num_running_reqs"] == 0
    assert engine.front.num_pending() == 0


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    params = {"max_new_tokens": 20, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    a, b = engine.generate("s", params), engine.generate("s", params)
    c = engine.generate("s", {**params, "seed": 8})
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]


@pytest.mark.parametrize("algorithm,gated", [("LowConfidence", False), ("JointThreshold", False),
                                              ("JointThreshold", True)])
def test_bs1_fdfo_and_sync_are_byte_identical(tiny_model_dir: Path, algorithm: str,
                                              gated: bool) -> None:
    """(W = 2, the default; gated: the device opens each next block, in both modes.)"""
    prompts = ["Natalia sold clips to 48 of her friends", "The capital of France is",
               "Q: What is 12 times 13? A:"]
    params = {"max_new_tokens": 100, "ignore_eos": True}
    outs = {}
    for fdfo in (True, False):
        with make_engine(tiny_model_dir, dllm_algorithm=algorithm, dllm_fdfo=fdfo,
                         max_running_requests=1, dllm_gated_spawn=gated) as e:
            results = e.generate(prompts, params)
            outs[fdfo] = [o["output_ids"] for o in results]
            edits = [x for o in results for x in o["meta_info"]["block_edits"]]
    assert all(len(o) == 100 for o in outs[True])
    assert outs[True] == outs[False]
    assert (sum(edits) > 0) == (algorithm == "JointThreshold")


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_child_crash_fails_requests_and_leaves_no_orphans(tiny_model_dir: Path,
                                                          victim: str) -> None:
    e = make_engine(tiny_model_dir)
    children = [psutil.Process(p) for p in e.get_all_child_pids()]
    assert len(children) == 2
    got: queue.Queue = queue.Queue()
    from dllm_serve.sampling_params import SamplingParams

    e.front.submit([5, 6], SamplingParams(max_new_tokens=3000, ignore_eos=True), got.put)
    got.get(timeout=60)
    os.kill(e.front.procs.procs[victim].pid, signal.SIGKILL)
    t0 = time.monotonic()
    while not (last := got.get(timeout=30)).finished:
        pass
    assert last.finish_reason["status_code"] == 500 and "died" in last.finish_reason["message"]
    assert time.monotonic() - t0 < 10
    with pytest.raises(EngineDeadError):
        e.generate("x")
    psutil.wait_procs(children, timeout=10)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    e.shutdown()


def test_a_request_beyond_the_kv_pool_raises_before_it_runs(tiny_model_dir: Path) -> None:
    """generate's promise (invalid requests raise before anything runs) holds for a request
    that fits the context but not the whole KV pool (it once came back as an empty result)."""
    with make_engine(tiny_model_dir, max_total_tokens=512) as e:
        with pytest.raises(RequestError, match="KV pool holds"):
            e.generate("a", {"max_new_tokens": 600})
        ok = e.generate("a", {"max_new_tokens": 32, "ignore_eos": True})
        assert ok["meta_info"]["completion_tokens"] == 32


def test_engine_refuses_what_the_cli_refuses_before_any_process(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    """Engine(...) runs the CLI's checks (`preflight`): an unknown algorithm setting or a
    mask id past the vocabulary is a ValueError naming it, raised before anything spawns."""
    import json
    import shutil

    before = {p.pid for p in psutil.Process().children()}
    yaml = tmp_path / "algo.yaml"
    yaml.write_text("threshold: 0.9\nbogus_key: 1\n")
    with pytest.raises(ValueError, match="bogus_key"):
        make_engine(tiny_model_dir, dllm_algorithm_config=str(yaml))
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "mask_token_id": 10**9}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_engine(model)
    # keywords of the wrong type (they come unparsed): once a TypeError naming nothing, or
    # taken as they came ("no" as True, 2.0 as a wavefront size)
    for kwargs, words in (({"max_running_requests": "4"}, "--max-running-requests must be an int"),
                          ({"dllm_fdfo": "no"}, "--dllm-fdfo must be a bool"),
                          ({"dllm_wavefront_size": 2.0}, "--dllm-wavefront-size must be an int"),
                          ({"random_seed": "x"}, "--random-seed must be an int")):
        with pytest.raises(ValueError, match=words):
            make_engine(tiny_model_dir, **kwargs)
    assert {p.pid for p in psutil.Process().children()} == before


def test_a_cancelled_startup_stops_its_children_at_once(tiny_model_dir: Path) -> None:
    """The server's stop while the engine loads (Ctrl-C) sets the front's cancel event: the
    startup raises within a poll and its children are gone, instead of waiting out the load."""
    import threading

    from dllm_serve.cli import parse_config
    from dllm_serve.managers.tokenizer_manager import TokenizerManager

    def engine_children() -> set[int]:  # not multiprocessing's resource tracker
        return {p.pid for p in psutil.Process().children()
                if "spawn_main" in " ".join(p.cmdline())}

    config = parse_config(["--model-path", str(tiny_model_dir), "--device", "cpu",
                           "--log-level", "warning"])
    before = engine_children()
    cancel = threading.Event()
    cancel.set()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="cancelled"):
        TokenizerManager(config, cancel)
    assert time.monotonic() - t0 < 10
    assert engine_children() == before


NEVER_SHUT_DOWN = """
import sys
import threading
from dllm_serve import Engine

if __name__ == "__main__":
    e = Engine(model_path=sys.argv[1], device="cpu", log_level="warning")
    print(e.front.procs.addrs.to_scheduler, flush=True)
    e.generate("x", {"max_new_tokens": 2})
"""


def test_an_engine_never_shut_down_stops_cleanly_at_exit(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    """A script that leaves without shutdown(): no traceback (the stop once ran in __del__ at
    interpreter teardown, where messages no longer pickle), no sockets' folder left."""
    script = tmp_path / "never.py"
    script.write_text(NEVER_SHUT_DOWN)
    done = subprocess.run([sys.executable, str(script), str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    folder = Path(done.stdout.strip()[len("ipc://"):]).parent
    assert folder.name.startswith("dllm-serve-") and not folder.exists()


KILLED_MID_RUN = """
import sys
import time
from dllm_serve import Engine

if __name__ == "__main__":
    e = Engine(model_path=sys.argv[1], device="cpu", log_level="warning")
    print(e.front.procs.addrs.to_scheduler, *e.get_all_child_pids(), flush=True)
    e.generate("x", {"max_new_tokens": 3000, "ignore_eos": True})
"""


def test_a_killed_engine_process_leaves_no_children_and_no_sockets_folder(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Regression: the children of a script killed outright (SIGKILL) exited, but the
    sockets' folder stayed in /tmp."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_MID_RUN)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address, *pids = proc.stdout.readline().split()
    children = [psutil.Process(int(p)) for p in pids]
    time.sleep(1.0)  # generating
    proc.kill()
    proc.wait(30)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    folder = Path(address[len("ipc://"):]).parent
    assert folder.name.startswith("dllm-serve-") and not folder.exists()


def test_shutdown_ends_the_calls_still_waiting_and_later_ones(tiny_model_dir: Path) -> None:
    """Regression: a thread waiting in generate (or iterating a stream) when another shut the
    engine down waited forever; a call after shutdown raised a ZMQError."""
    e = make_engine(tiny_model_dir)
    long = {"max_new_tokens": 3000, "ignore_eos": True}
    errors: queue.Queue = queue.Queue()

    def wait_in(call) -> None:  # type: ignore[no-untyped-def]
        try:
            call()
        except EngineDeadError as exc:
            errors.put(str(exc))

    stream = e.generate("streamed", long, stream=True)
    assert next(stream)["output_ids"]
    threads = [threading.Thread(target=wait_in, args=(c,), daemon=True) for c in (
        lambda: e.generate("waiting", long), lambda: list(stream))]
    for t in threads:
        t.start()
    while e.front.num_pending() < 2:
        time.sleep(0.02)
    e.shutdown()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert errors.qsize() == 2 and "shut down" in errors.get()
    with pytest.raises(EngineDeadError, match="shut down"):
        e.generate("after", {"max_new_tokens": 2})
    with pytest.raises(EngineDeadError, match="shut down"):
        e.get_server_info()
    e.abort(abort_all=True)  # nothing runs: nothing to do
    e.shutdown()  # twice: nothing to do


def test_shutdown_leaves_no_children(tiny_model_dir: Path) -> None:
    with make_engine(tiny_model_dir) as e:
        children = [psutil.Process(p) for p in e.get_all_child_pids()]
        e.generate("x", {"max_new_tokens": 2})
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
