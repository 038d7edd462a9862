"""SDAR (block size 4) through everything the engine has: the real processes (offline Engine and
the HTTP server with the openai client), FDFO and sync, LowConfidence and JointThreshold,
wavefront, pages a multiple of the block, streaming and the chat template. Tiny checkpoints,
CPU; kept small (each Engine start costs seconds)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from http_helpers import Server, pools_whole, start_server
from local_engine import LocalEngine, local_engine
from test_engine import assert_pools_whole, make_engine
from test_golden import read_fixture
from test_kv_exactness import reference_kv
from test_wavefront import serial_generate

from dllm_serve import Engine
from dllm_serve.engine_config import EngineConfig
from dllm_serve.model.runner import ModelRunner
from dllm_serve.server_args import ServerArgs
from dllm_serve.tokenizer import Tokenizer

LONG = {"ignore_eos": True}  # the random tiny model may emit EOS at any time


@pytest.fixture(scope="module")
def engine(tiny_sdar_dir: Path):
    """The defaults: FDFO, wavefront 2, LowConfidence (SDAR's threshold 0.9)."""
    with make_engine(tiny_sdar_dir) as e:
        yield e


def run_to_end(engine: LocalEngine, prompt: list[int], max_new: int) -> list[int]:
    engine.submit("r", prompt, max_new_tokens=max_new, ignore_eos=True)
    engine.run()
    return engine.tokens("r")


# ---------------------------------------------------------------- offline Engine (processes)

def test_many_requests_exact_lengths_blocks_of_4(engine: Engine) -> None:
    prompts = [("word " * (1 + 5 * i % 23)).strip() for i in range(12)]
    lengths = [1 + (7 * i) % 30 for i in range(12)]
    outs = engine.generate(prompts, [{"max_new_tokens": n, **LONG} for n in lengths])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == lengths
    assert all(len(o["output_ids"]) == n for o, n in zip(outs, lengths, strict=True))
    info = engine.get_server_info()
    assert info["kv_pool"]["page_size"] == 4
    assert_pools_whole(engine)


def test_stream_matches_non_stream(engine: Engine) -> None:
    params = {"max_new_tokens": 18, **LONG}
    prompt = "stream me"  # 3 prompt tokens: the first block holds 1 generated token
    full = engine.generate(prompt, params)
    chunks = list(engine.generate(prompt, params, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [len(c["output_ids"]) for c in chunks] == [1, 4, 4, 4, 4, 1]
    assert full["meta_info"]["blocks"] == 6
    assert_pools_whole(engine)


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
def test_bs1_fdfo_and_sync_are_byte_identical(tiny_sdar_dir: Path, algorithm: str) -> None:
    """Block by block (W=1): FDFO and sync give the same bytes, and LowConfidence reproduces
    JetAstra's generate (the golden fixture)."""
    golden, _ = read_fixture("sdar")
    prompts = [golden["prompt_ids"].tolist(), [151644, 872, 198, 9707, 0, 151645]]
    outs = {}
    for fdfo in (True, False):
        with make_engine(tiny_sdar_dir, dllm_algorithm=algorithm, dllm_fdfo=fdfo,
                         max_running_requests=1, dllm_wavefront_size=1) as e:
            results = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": 14})
            outs[fdfo] = [o["output_ids"] for o in results]
    assert outs[True] == outs[False]
    if algorithm == "LowConfidence":
        assert outs[True][0] == golden["output_ids"].tolist()


# ---------------------------------------------------------------- HTTP, chat, the MoE model

@pytest.fixture(scope="module")
def moe_server(tiny_sdar_moe_dir: Path):
    server = start_server(tiny_sdar_moe_dir, "--max-running-requests", "4",
                          "--served-model-name", "sdar")
    yield server
    server.stop()


def test_http_chat_uses_the_qwen_template_and_streams(moe_server: Server,
                                                      tiny_sdar_moe_dir: Path) -> None:
    client = openai.OpenAI(base_url=moe_server.url("/v1"), api_key="EMPTY", max_retries=0,
                           timeout=120)
    tok = Tokenizer.load(tiny_sdar_moe_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    args = dict(model="sdar", messages=messages, max_tokens=10, extra_body=LONG)
    reply = client.chat.completions.create(**args)
    assert reply.usage.prompt_tokens == len(tok.encode(prompt))
    assert reply.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    done = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert done == ["length"]
    completion = client.completions.create(model="sdar", prompt="2+2=", max_tokens=7,
                                           extra_body=LONG)
    assert completion.usage.completion_tokens == 7
    pools_whole(moe_server)


def test_turn_end_and_eos_both_stop(tiny_sdar_dir: Path) -> None:
    assert 151645 in Tokenizer.load(tiny_sdar_dir).extra_stop_token_ids  # <|im_end|>
    cfg = EngineConfig.resolve(ServerArgs(model_path=str(tiny_sdar_dir)))
    assert cfg.eos_ids == (151643, 151645)


# ---------------------------------------------------------------- in-process runtime

@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
def test_w1_equals_a_plain_serial_decoder(tiny_sdar_dir: Path, algorithm: str) -> None:
    engine = local_engine(tiny_sdar_dir, algorithm, True, wavefront=1)
    prompt = list(range(5, 5 + 14))
    worker = engine.worker
    assert run_to_end(engine, prompt, 22) == serial_generate(worker.runner, worker.algo, prompt,
                                                             22)


@pytest.mark.parametrize("page_size", [8, 12])
def test_pages_a_multiple_of_the_block_give_the_same_tokens(tiny_sdar_dir: Path,
                                                            page_size: int) -> None:
    prompt = list(range(100, 100 + 13))
    want = run_to_end(local_engine(tiny_sdar_dir, "JointThreshold", True, wavefront=2), prompt, 26)
    engine = local_engine(tiny_sdar_dir, "JointThreshold", True, wavefront=2,
                          page_size=page_size)
    assert engine.worker.runner.page_size == page_size
    assert run_to_end(engine, prompt, 26) == want
    engine.sched.check_integrity()
    with pytest.raises(ValueError, match="multiple of"):
        local_engine(tiny_sdar_dir, "LowConfidence", True, page_size=6)


@pytest.mark.parametrize("fdfo", [True, False])
def test_wavefront_retired_kv_equals_serial_recomputation(tiny_sdar_moe_dir: Path,
                                                          fdfo: bool) -> None:
    engine = local_engine(tiny_sdar_moe_dir, "JointThreshold", fdfo, wavefront=3,
                          token_threshold=0.0)
    sched, runner = engine.sched, engine.worker.runner
    assert isinstance(runner, ModelRunner)
    for rid, ids in {"a": list(range(3, 40)), "b": list(range(40, 49))}.items():
        engine.submit(rid, ids, max_new_tokens=60, ignore_eos=True)
    widths: set[int] = {0}
    while min((r.blocks for r in sched.running.values()), default=0) < 4:
        engine.step()
        widths |= {len(r.blocks) for r in engine.worker.batch.reqs.values()}
    assert max(widths) > 1, "no request ever had more than one active block"
    for req in sched.running.values():
        n = req.committed_len
        tokens = (list(req.input_ids) + req.output_ids)[:n]
        slots = runner.kv.slots(torch.full((n,), req.holding.slot), torch.arange(n))
        for layer, (k_ref, v_ref) in enumerate(reference_kv(runner, tokens)):
            torch.testing.assert_close(runner.kv.k[layer][slots], k_ref, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(runner.kv.v[layer][slots], v_ref, atol=2e-5, rtol=1e-4)
