"""LLaDA2 model correctness against the naive full-sequence forward in naive_llada2.py.

Our model runs through a real KVCache + TorchAttention, as one prefill segment, block by block,
and batched with another request; the oracle recomputes the whole sequence with a block-causal
mask and no cache. Also: the router and MoE reference, and config parsing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from batch_helpers import Segment, make_batch, make_cache
from naive_llada2 import naive_llada2_logits, naive_route

from dllm_serve.layers.attention import TorchAttention
from dllm_serve.layers.moe import moe_reference
from dllm_serve.layers.moe_router import RoutingParams, route
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.config import ModelConfig
from dllm_serve.model.loader import load_model
from dllm_serve.models.llada2_config import LLaDA2Config
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

BLOCK = 8
SEQ_LEN = 3 * BLOCK


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def model_fp32(tiny_model_dir: Path) -> torch.nn.Module:
    return load_model(ModelConfig.load(tiny_model_dir), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return torch.randint(0, 380, (SEQ_LEN,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tokens: list[int]) -> torch.Tensor:
    return naive_llada2_logits(tiny_model_dir, tokens, BLOCK)


def run(model: torch.nn.Module, segments: list[Segment], kv: KVCache,
        attn: TorchAttention) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(make_batch(segments, kv, attn, BLOCK)))


# ---------------------------------------------------------------- tests

def test_single_prefill_matches_naive_reference(model_fp32, tokens, reference) -> None:
    kv, attn = make_cache(model_fp32.kv_spec(), 1, SEQ_LEN, page_size=BLOCK)
    logits = run(model_fp32, [Segment(0, 0, tokens)], kv, attn)
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_block_by_block_matches_single_forward(model_fp32, tokens, reference) -> None:
    spec = model_fp32.kv_spec()
    kv_one, attn_one = make_cache(spec, 1, SEQ_LEN, page_size=BLOCK)
    full = run(model_fp32, [Segment(0, 0, tokens)], kv_one, attn_one)
    kv, attn = make_cache(spec, 1, SEQ_LEN, page_size=BLOCK)
    parts = [run(model_fp32, [Segment(0, s, tokens[s:s + BLOCK])], kv, attn)
             for s in range(0, SEQ_LEN, BLOCK)]
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(parts), reference, atol=1e-5, rtol=1e-5)
    for layer in range(spec[0]):
        torch.testing.assert_close(kv.k[layer], kv_one.k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv.v[layer], kv_one.v[layer], atol=1e-5, rtol=1e-5)


def test_batched_requests_and_in_place_block_rewrite(model_fp32, tiny_model_dir, tokens,
                                                     reference) -> None:
    """Two requests in one forward; a block first run with masks, then rewritten in place."""
    other = tokens[::-1][:2 * BLOCK]
    ref_other = naive_llada2_logits(tiny_model_dir, other, BLOCK)
    mask_id = json.loads((tiny_model_dir / "config.json").read_text())["mask_token_id"]
    kv, attn = make_cache(model_fp32.kv_spec(), 2, SEQ_LEN, page_size=2 * BLOCK)
    first = run(model_fp32, [Segment(0, 0, tokens[:2 * BLOCK]), Segment(1, 0, other[:BLOCK])],
                kv, attn)
    masks = [mask_id] * BLOCK
    run(model_fp32, [Segment(1, BLOCK, masks), Segment(0, 2 * BLOCK, masks)], kv, attn)
    second = run(model_fp32, [Segment(1, BLOCK, other[BLOCK:]),
                              Segment(0, 2 * BLOCK, tokens[2 * BLOCK:])], kv, attn)
    got = {0: torch.cat([first[:2 * BLOCK], second[BLOCK:]]),
           1: torch.cat([first[2 * BLOCK:], second[:BLOCK]])}
    torch.testing.assert_close(got[0], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref_other, atol=1e-5, rtol=1e-5)


def test_bf16_model_close_to_fp32(tiny_model_dir, model_fp32, tokens) -> None:
    model = load_model(ModelConfig.load(tiny_model_dir), torch.bfloat16, torch.device("cpu"))
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.expert_bias.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    kv, attn = make_cache(model.kv_spec(), 1, SEQ_LEN, BLOCK, dtype=torch.bfloat16)
    logits = run(model, [Segment(0, 0, tokens)], kv, attn)
    kv32, attn32 = make_cache(model_fp32.kv_spec(), 1, SEQ_LEN, BLOCK)
    ref = run(model_fp32, [Segment(0, 0, tokens)], kv32, attn32)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    torch.testing.assert_close(logits, ref, atol=0.1, rtol=0.05)


def test_interface(model_fp32) -> None:
    assert model_fp32.kv_spec() == (3, 4, 2, 16)
    assert model_fp32.attn_scale == 16 ** -0.5
    hidden = torch.randn(5, 64)
    assert model_fp32.compute_logits(hidden).shape == (5, 448)


def test_tied_embeddings_model(tmp_path) -> None:
    path = build_tiny_checkpoint(tmp_path, tie_word_embeddings=True, num_hidden_layers=2)
    model = load_model(ModelConfig.load(path), torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = list(range(2 * BLOCK))
    kv, attn = make_cache(model.kv_spec(), 1, len(ids), BLOCK)
    logits = run(model, [Segment(0, 0, ids)], kv, attn)
    torch.testing.assert_close(logits, naive_llada2_logits(path, ids, BLOCK), atol=1e-5, rtol=1e-5)


def test_config_variants_match_naive_reference(tmp_path) -> None:
    """Biases on, qk-norm off, no shared experts, no expert groups, all-MoE layers."""
    path = build_tiny_checkpoint(tmp_path, use_qkv_bias=True, use_bias=True, use_qk_norm=False,
                                 num_shared_experts=0, n_group=0, topk_group=0,
                                 first_k_dense_replace=0, num_experts_per_tok=3)
    model = load_model(ModelConfig.load(path), torch.float32, torch.device("cpu"))
    ids = list(range(100, 100 + 2 * BLOCK))
    kv, attn = make_cache(model.kv_spec(), 1, len(ids), BLOCK)
    logits = run(model, [Segment(0, 0, ids)], kv, attn)
    torch.testing.assert_close(logits, naive_llada2_logits(path, ids, BLOCK), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- router and MoE reference

def _routing_case(seed: int, experts: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, experts, generator=g), 0.3 * torch.randn(experts, generator=g)


def test_route_matches_naive_group_limited_topk() -> None:
    logits, bias = _routing_case(0)
    c = {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "routed_scaling_factor": 2.5}
    params = RoutingParams(top_k=3, score_function="sigmoid", n_group=4, topk_group=2,
                           renormalize=True, scaling=2.5)
    ids, weights = route(logits, bias, params)
    assert ids.shape == (12, 3) and weights.dtype == torch.float32
    for t in range(12):
        want = dict(naive_route(logits[t].tolist(), bias.tolist(), c))
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert got.keys() == want.keys()
        for e in want:
            assert got[e] == pytest.approx(want[e], rel=1e-5)


def test_route_without_groups_and_softmax() -> None:
    logits, _ = _routing_case(1)
    params = RoutingParams(top_k=2, score_function="softmax", n_group=0, topk_group=0,
                           renormalize=False, scaling=1.0)
    ids, weights = route(logits, None, params)
    probs = logits.softmax(-1)
    top = probs.topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(weights, top.values)
    with pytest.raises(ValueError, match="score_function"):
        RoutingParams(top_k=2, score_function="tanh", n_group=0, topk_group=0,
                      renormalize=True, scaling=1.0)


def test_moe_reference_matches_per_token_loop() -> None:
    g = torch.Generator().manual_seed(2)
    experts, hidden, inter, tokens, k = 6, 8, 5, 10, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(experts, hidden, inter, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[:, 0] = 0  # expert 0 gets every token; some experts get none
    weights = torch.rand(tokens, k, generator=g)
    out = moe_reference(x, w13, w2, ids, weights)
    for t in range(tokens):
        want = torch.zeros(hidden)
        for j in range(k):
            gate, up = (w13[ids[t, j]] @ x[t]).split(inter)
            want += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- config parsing

def _hf(tiny_model_dir: Path, **changes: object) -> dict:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    return cfg


def test_config_defaults(tiny_model_dir) -> None:
    cfg = LLaDA2Config.from_hf(_hf(tiny_model_dir))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.use_qk_norm, cfg.use_bias) == (16, 8, True, False)
    assert cfg.router_fp32 and cfg.expert_bias and cfg.routing.renormalize
    cfg = LLaDA2Config.from_hf(_hf(tiny_model_dir, head_dim=..., rotary_dim=..., use_bias=...,
                                   rms_norm_eps=..., norm_topk_prob=...))
    assert (cfg.head_dim, cfg.rotary_dim) == (16, 8)  # hidden / heads, * 0.5
    assert cfg.use_bias is True and cfg.rms_norm_eps == 1e-5 and cfg.routing.renormalize


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rotary_dim": 4}, "rotary_dim"),
    ({"score_function": "softmax"}, "expert bias"),
    ({"moe_router_enable_expert_bias": False}, "expert bias"),
    ({"score_function": "tanh", "moe_router_enable_expert_bias": False}, "score_function"),
    ({"n_group": 3}, "expert groups"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": ...}, "hidden_size"),
])
def test_config_rejects(tiny_model_dir, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLaDA2Config.from_hf(_hf(tiny_model_dir, **changes))


@pytest.mark.parametrize("value", [None, {"rope_type": "default"}, {"type": "default"}])
def test_default_rope_scaling_is_plain_rope(tiny_model_dir, value) -> None:
    """Regression: Hugging Face's {"rope_type": "default"} (the same as null) was refused."""
    assert LLaDA2Config.from_hf(_hf(tiny_model_dir, rope_scaling=value)).rope_theta > 0
