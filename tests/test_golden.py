"""Our models against fixtures computed once by independent implementations on the same tiny
checkpoints (scripts/golden/: JetAstra/SDAR's modeling and generate code for SDAR, transformers'
Qwen3-MoE + JetAstra's generate for SDAR-MoE, inclusionAI's HF modeling_llada2_moe.py for
LLaDA2): fp32 logits of a block-causal forward within 1e-4, and the same greedy tokens from our
scheduler and worker (block by block, FDFO and sync) as from their generate loops."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from batch_helpers import Segment, make_batch, make_cache
from local_engine import local_engine
from safetensors import safe_open

from dllm_serve.model.config import ModelConfig
from dllm_serve.model.loader import load_model

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = {"sdar": "tiny_sdar_dir", "sdar_moe": "tiny_sdar_moe_dir",
               "llada2": "tiny_model_dir"}


def read_fixture(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(FIXTURES / f"golden_{name}.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["golden"])


@pytest.fixture(params=sorted(CHECKPOINTS))
def golden(request: pytest.FixtureRequest) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """(our tiny checkpoint, the fixture's tensors, its metadata); the checkpoint must be the
    one the fixture was computed on."""
    path: Path = request.getfixturevalue(CHECKPOINTS[request.param])
    tensors, meta = read_fixture(request.param)
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert digest == meta["checkpoint"]["model.safetensors sha256"], (
        "the tiny checkpoint changed since the fixture was made: rerun scripts/golden/")
    return path, tensors, meta


def test_logits_match_the_independent_forward(golden) -> None:
    path, t, meta = golden
    block = meta["settings"]["block_length"]
    model = load_model(ModelConfig.load(path), torch.float32, torch.device("cpu"))
    ids = t["input_ids"].tolist()
    kv, attn = make_cache(model.kv_spec(), 1, len(ids), page_size=block)
    with torch.no_grad():
        logits = model.compute_logits(model(make_batch([Segment(0, 0, ids)], kv, attn, block)))
    err = (logits[:, t["columns"]] - t["logits"]).abs().max().item()
    assert err < 1e-4, f"max |ours - theirs| = {err:.2e}"
    assert torch.equal(logits.argmax(-1), t["argmax"])
    assert (logits.logsumexp(-1) - t["logsumexp"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("fdfo", [True, False])
def test_greedy_tokens_match_the_independent_generate(golden, fdfo: bool) -> None:
    path, t, meta = golden
    engine = local_engine(path, "LowConfidence", fdfo, wavefront=1)
    worker = engine.worker
    assert worker.algo.config.threshold == meta["settings"]["threshold"]
    assert worker.algo.mask_id == meta["settings"]["mask_id"]
    assert worker.runner.block_size == meta["settings"]["block_length"]
    want = t["output_ids"].tolist()
    assert len(want) == meta["settings"]["gen_length"]  # no stop token: the whole length
    engine.submit("g", t["prompt_ids"].tolist(), max_new_tokens=len(want))
    engine.run()
    assert engine.tokens("g") == want
