"""SDAR (dense and MoE) correctness against the naive full-sequence forward in naive_sdar.py,
strict loading of the Qwen3 tensor layout, config parsing, and the engine-side defaults.

Our model runs through a real KVCache + TorchAttention, as one prefill segment, block by block
(block size 4), and batched with another request; the oracle recomputes the whole sequence with
a block-causal mask and no cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from batch_helpers import Segment, make_batch, make_cache
from naive_sdar import naive_sdar_logits, naive_softmax_route
from safetensors.torch import load_file, save_file

from dllm_serve.dllm.algorithms import build_algorithm
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.layers.attention import TorchAttention
from dllm_serve.layers.moe_router import RoutingParams, route
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.config import ModelConfig
from dllm_serve.model.loader import load_model
from dllm_serve.models.sdar_config import SDARConfig
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

BLOCK = 4
SEQ_LEN = 5 * BLOCK
CPU = torch.device("cpu")
ARCHES = ("sdar", "sdar_moe")


@pytest.fixture(params=ARCHES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    name = "tiny_sdar_dir" if request.param == "sdar" else "tiny_sdar_moe_dir"
    return request.getfixturevalue(name)


def load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(ModelConfig.load(path), dtype, CPU)


def tokens(n: int = SEQ_LEN, seed: int = 1) -> list[int]:
    """Ids over the whole vocabulary, special tokens included."""
    ids = torch.randint(0, 151936, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [151644, 151669, *ids[2:]]


def run(model: torch.nn.Module, segments: list[Segment], kv: KVCache,
        attn: TorchAttention) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(make_batch(segments, kv, attn, BLOCK)))


# ---------------------------------------------------------------- forward vs the oracle

def test_prefill_and_block_by_block_match_naive_reference(model_dir: Path) -> None:
    model, ids = load(model_dir), tokens()
    reference = naive_sdar_logits(model_dir, ids, BLOCK)
    kv, attn = make_cache(model.kv_spec(), 1, SEQ_LEN, page_size=BLOCK)
    full = run(model, [Segment(0, 0, ids)], kv, attn)
    assert full.dtype == torch.float32 and full.shape == (SEQ_LEN, 151936)
    torch.testing.assert_close(full, reference, atol=1e-5, rtol=1e-5)
    kv2, attn2 = make_cache(model.kv_spec(), 1, SEQ_LEN, page_size=2 * BLOCK)
    parts = [run(model, [Segment(0, s, ids[s:s + BLOCK])], kv2, attn2)
             for s in range(0, SEQ_LEN, BLOCK)]
    torch.testing.assert_close(torch.cat(parts), reference, atol=1e-5, rtol=1e-5)


def test_batched_requests_and_in_place_block_rewrite(model_dir: Path) -> None:
    """Two requests in one forward; a block first run with masks, then rewritten in place."""
    model, ids = load(model_dir), tokens(3 * BLOCK)
    other = tokens(2 * BLOCK, seed=2)
    kv, attn = make_cache(model.kv_spec(), 2, 3 * BLOCK, page_size=BLOCK)
    first = run(model, [Segment(0, 0, ids[:2 * BLOCK]), Segment(1, 0, other[:BLOCK])], kv, attn)
    masks = [151669] * BLOCK
    run(model, [Segment(1, BLOCK, masks), Segment(0, 2 * BLOCK, masks)], kv, attn)
    second = run(model, [Segment(1, BLOCK, other[BLOCK:]), Segment(0, 2 * BLOCK, ids[2 * BLOCK:])],
                 kv, attn)
    torch.testing.assert_close(torch.cat([first[:2 * BLOCK], second[BLOCK:]]),
                               naive_sdar_logits(model_dir, ids, BLOCK), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([first[2 * BLOCK:], second[:BLOCK]]),
                               naive_sdar_logits(model_dir, other, BLOCK), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("arch", "changes"), [
    ("sdar", {"attention_bias": True, "tie_word_embeddings": True, "num_hidden_layers": 2}),
    ("sdar_moe", {"mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": False,
                  "num_experts_per_tok": 3, "num_hidden_layers": 2}),
    ("sdar_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 2, "rope_theta": 10000}),
])
def test_config_variants_match_naive_reference(tmp_path: Path, arch: str, changes: dict) -> None:
    path = build_tiny_checkpoint(tmp_path, arch=arch, **changes)
    model, ids = load(path), tokens(2 * BLOCK)
    if changes.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    kv, attn = make_cache(model.kv_spec(), 1, len(ids), BLOCK)
    logits = run(model, [Segment(0, 0, ids)], kv, attn)
    torch.testing.assert_close(logits, naive_sdar_logits(path, ids, BLOCK), atol=1e-5, rtol=1e-5)


def test_bf16_model_close_to_fp32(tiny_sdar_moe_dir: Path) -> None:
    ids = tokens()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load(tiny_sdar_moe_dir, dtype)
        kv, attn = make_cache(model.kv_spec(), 1, SEQ_LEN, BLOCK, dtype=dtype)
        out[dtype] = run(model, [Segment(0, 0, ids)], kv, attn)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16  # logits in model dtype
    assert torch.isfinite(out[torch.bfloat16]).all()
    torch.testing.assert_close(out[torch.bfloat16], out[torch.float32], atol=0.1, rtol=0.05)


def test_softmax_route_matches_naive_qwen3_moe_rule() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 8, generator=g)
    for renormalize in (True, False):
        ids, weights = route(logits, None, RoutingParams(2, "softmax", 0, 0, renormalize, 1.0))
        for t in range(10):
            want = dict(naive_softmax_route(logits[t].tolist(), 2, renormalize))
            got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
            assert got.keys() == want.keys()
            assert all(got[e] == pytest.approx(want[e], rel=1e-5) for e in want)


# ---------------------------------------------------------------- strict loading

def test_every_tensor_lands_in_its_slot(tiny_sdar_moe_dir: Path) -> None:
    model = load(tiny_sdar_moe_dir)
    w = {k: v.float() for k, v in load_file(str(tiny_sdar_moe_dir / "model.safetensors")).items()}
    params = dict(model.named_parameters())
    p = "model.layers.1"
    qkv = params[f"{p}.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 16, 64)
    assert torch.equal(qkv, torch.cat([w[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]))
    w13, w2 = params[f"{p}.mlp.experts.w13"], params[f"{p}.mlp.experts.w2"]
    assert torch.equal(w13[5, 32:], w[f"{p}.mlp.experts.5.up_proj.weight"])
    assert torch.equal(w2[7], w[f"{p}.mlp.experts.7.down_proj.weight"])
    for name in ("model.embed_tokens.weight", f"{p}.self_attn.q_norm.weight",
                 f"{p}.self_attn.o_proj.weight", f"{p}.mlp.gate.weight", "lm_head.weight"):
        assert torch.equal(params[name], w[name])


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(("edit", "pattern"), [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
     r"missing 1 tensor.*k_proj\.weight' \(-> model\.layers\.1\.self_attn\.qkv_proj\.weight\)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
     r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"),
    (lambda t: t.update({"model.layers.0.self_attn.v_proj.weight": torch.zeros(64, 64)}),
     r"'model\.layers\.0\.self_attn\.v_proj\.weight' has shape \[64, 64\].*expects \[32, 64\]"),
])
def test_strict_errors_name_the_tensor(tiny_sdar_dir: Path, tmp_path: Path, edit,
                                       pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        load(_edited(tiny_sdar_dir, tmp_path / "ckpt", edit))


# ---------------------------------------------------------------- config

def _hf(model_dir: Path, **changes: object) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    return cfg


def test_config_parsing_and_defaults(tiny_sdar_moe_dir: Path) -> None:
    cfg = SDARConfig.from_hf(_hf(tiny_sdar_moe_dir), moe=True)
    d = cfg.decoder
    assert (d.head_dim, d.rotary_dim, d.qk_norm, d.qkv_bias, d.rope_theta) == (
        16, 16, True, False, 1e6)
    assert cfg.routing == RoutingParams(2, "softmax", 0, 0, True, 1.0)
    assert all(cfg.is_moe_layer(i) for i in range(3))
    cfg = SDARConfig.from_hf(_hf(tiny_sdar_moe_dir, norm_topk_prob=..., rope_theta=...,
                                 mlp_only_layers=..., decoder_sparse_step=...), moe=True)
    assert not cfg.routing.renormalize and cfg.decoder.rope_theta == 10000.0  # HF defaults
    dense = SDARConfig.from_hf(_hf(tiny_sdar_moe_dir), moe=False)
    assert dense.num_experts == 0 and dense.routing is None and not dense.is_moe_layer(0)


@pytest.mark.parametrize(("changes", "moe", "message"), [
    ({"hidden_act": "gelu"}, False, "hidden_act"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, False, "rope_scaling"),
    ({"use_sliding_window": True}, False, "use_sliding_window"),
    ({"num_key_value_heads": 3}, False, "num_key_value_heads"),
    ({"intermediate_size": ...}, False, "intermediate_size"),
    ({"num_experts": ...}, True, "num_experts"),
    ({"num_experts_per_tok": 9}, True, "num_experts_per_tok"),
])
def test_config_rejects(tiny_sdar_moe_dir: Path, changes: dict, moe: bool,
                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SDARConfig.from_hf(_hf(tiny_sdar_moe_dir, **changes), moe=moe)


def test_engine_defaults_for_sdar(tiny_sdar_dir: Path, tmp_path: Path) -> None:
    """Block 4 and mask 151669 from the architecture, LowConfidence at SDAR's 0.9 unless the
    YAML says otherwise, and a checkpoint's own block_size wins over the family default."""
    model = ModelConfig.load(tiny_sdar_dir)
    dllm = DllmConfig.build(model, "LowConfidence", None, True)
    assert (dllm.block_size, dllm.mask_id) == (4, 151669)
    assert build_algorithm(dllm).config.threshold == 0.9
    assert build_algorithm(DllmConfig.build(model, "JointThreshold", None, True)).config.threshold \
        == 0.5
    yaml_file = tmp_path / "algo.yaml"
    yaml_file.write_text("threshold: 0.7\nblock_size: 8\n")
    dllm = DllmConfig.build(model, "LowConfidence", str(yaml_file), True)
    assert (dllm.block_size, build_algorithm(dllm).config.threshold) == (8, 0.7)
    b16 = build_tiny_checkpoint(tmp_path / "b16", arch="sdar", block_size=16,
                                num_hidden_layers=1)
    assert DllmConfig.build(ModelConfig.load(b16), "LowConfidence", None, True).block_size == 16
