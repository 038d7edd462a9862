"""benchmarks/round_roofline.py and its floor (round_cost.py) for every architecture: the floor
at SDAR-8B's / SDAR-30B-A3B's shapes against the byte and FLOP counts written out by hand, and
a CPU smoke run of the benchmark itself on the tiny presets (block 4 for SDAR)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import round_roofline
from benchmarks.round_cost import round_cost
from dllm_serve.models import get_model_class
from dllm_serve.tools.tiny_checkpoint import checkpoint_config

PREFIXES = [4096, 3000, 1024, 0]


def meta_model(arch: str, preset: str) -> tuple[torch.nn.Module, dict]:
    _, hf = checkpoint_config(arch, preset)
    with torch.device("meta"):
        model = get_model_class(hf["architectures"][0])(hf)
    return model.to(torch.bfloat16), hf


@pytest.mark.parametrize(("arch", "preset"), [("sdar", "sdar-8b-shape"),
                                              ("sdar_moe", "sdar-30b-a3b-shape")])
def test_floor_at_sdar_shapes(arch: str, preset: str) -> None:
    model, hf = meta_model(arch, preset)
    hidden, vocab, layers = hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"]
    block, tokens = 4, 4 * len(PREFIXES)
    params = sum(p.numel() for p in model.parameters())
    experts = hf.get("num_experts", 0)
    expert_params = layers * experts * 3 * hidden * hf.get("moe_intermediate_size", 0)
    touched = {i: 20 for i in range(layers)} if experts else {}
    cost = round_cost(model, PREFIXES, block, touched, itemsize=2)
    dense_params = params - vocab * hidden - expert_params  # embedding: only the rows read
    weight = dense_params + tokens * hidden + (expert_params * 20 // experts if experts else 0)
    assert cost.weight_bytes == 2 * weight
    per_token_kv = 2 * layers * hf["num_key_value_heads"] * 128 * 2
    assert cost.kv_bytes == per_token_kv * (sum(p + block for p in PREFIXES) + tokens)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    mlp = experts * hidden + hf["num_experts_per_tok"] * 3 * hidden * hf[
        "moe_intermediate_size"] if experts else 3 * hidden * hf["intermediate_size"]
    per_token = layers * ((2 * heads + 2 * kv_heads) * 128 * hidden + mlp) + vocab * hidden
    attention = 4 * heads * 128 * layers * sum(block * (p + block) for p in PREFIXES)
    assert cost.flops == 2 * tokens * per_token + attention


@pytest.mark.parametrize("arch", ["sdar", "sdar_moe", "llada2_moe"])
def test_benchmark_smoke_on_the_cpu(tmp_path: Path, arch: str) -> None:
    out = tmp_path / "roofline.json"
    round_roofline.main(["--preset", "tiny", "--arch", arch, "--device", "cpu",
                         "--batch-sizes", "1", "3", "--prefixes", "40", "--backends", "torch",
                         "--iters", "1", "--warmup", "0", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["block"] == (32 if arch == "llada2_moe" else 4) for r in rows)
    assert all(r["floor_ms"] > 0 and r["round_ms"] > 0 for r in rows)
    assert all(p % r["block"] == 0 for r in rows for p in r["prefixes"])
    assert (tmp_path / "roofline.md").read_text().startswith("| backend")
