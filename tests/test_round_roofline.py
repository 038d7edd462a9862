"""benchmarks/round_roofline.py and its floor (round_cost.py) for every architecture: the floor
at SDAR-8B's / SDAR-30B-A3B's shapes against the byte and FLOP counts written out by hand, the
serial floor's stages against the floor's totals, and a CPU smoke run of the benchmark itself
on the tiny presets (block 4 for SDAR), then of benchmarks/serial_floor.py on its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import round_roofline, serial_floor
from benchmarks.round_cost import RoundCost, meta_model, round_cost, serial_floor_s, stage_costs
from dllm_serve.tools.tiny_checkpoint import checkpoint_config

PREFIXES = [4096, 3000, 1024, 0]


def preset_model(arch: str, preset: str) -> tuple[torch.nn.Module, dict]:
    _, hf = checkpoint_config(arch, preset)
    return meta_model(hf), hf


@pytest.mark.parametrize(("arch", "preset"), [("sdar", "sdar-8b-shape"),
                                              ("sdar_moe", "sdar-30b-a3b-shape")])
def test_floor_at_sdar_shapes(arch: str, preset: str) -> None:
    model, hf = preset_model(arch, preset)
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


@pytest.mark.parametrize(("arch", "preset"), [("sdar", "sdar-8b-shape"),
                                              ("sdar_moe", "sdar-30b-a3b-shape"),
                                              ("llada2_moe", "llada2-mini-shape")])
def test_serial_floor_stages(arch: str, preset: str) -> None:
    """The stages partition the round: their bytes and FLOPs sum to round_cost's, one
    attention and one MLP stage per layer; the serial floor is never below the floor, equals
    it where every stage has the same bound, and exceeds it by the hidden side of each stage."""
    model, hf = preset_model(arch, preset)
    layers = hf["num_hidden_layers"]
    touched = {i: 20 for i in range(layers)} if hf.get("num_experts") else {}
    cost = round_cost(model, PREFIXES, 32, touched, itemsize=2)
    stages = stage_costs(model, PREFIXES, 32, touched, itemsize=2)
    expect = {"embed", "head"} | {f"{i}.{part}" for i in range(layers)
                                 for part in ("attention", "mlp")}
    assert set(stages) == expect
    for field in ("weight_bytes", "kv_bytes", "flops"):
        assert sum(getattr(c, field) for c in stages.values()) == getattr(cost, field)
    assert stages["embed"].flops == 0 and stages["head"].flops > 0
    for i in range(layers):  # the projections sit with their attention, the rest after
        assert stages[f"{i}.mlp"].kv_bytes == 0 and stages[f"{i}.mlp"].weight_bytes > 0
        assert stages[f"{i}.attention"].weight_bytes > 0
    for ceilings in [(3e12, 7e14), (1e9, 7e14)]:
        assert serial_floor_s(stages, *ceilings) >= cost.floor_s(*ceilings) * (1 - 1e-12)
    # a slow memory: every stage memory-bound, the serial floor the floor
    assert {c.bound(1e9, 7e14) for c in stages.values()} == {"memory"}
    assert serial_floor_s(stages, 1e9, 7e14) == pytest.approx(cost.bytes / 1e9)
    # slow compute: all but the embedding (no FLOPs) compute-bound, each side summed apart
    assert {n for n, c in stages.items() if c.bound(3e15, 1e9) == "memory"} == {"embed"}
    assert serial_floor_s(stages, 3e15, 1e9) == pytest.approx(
        cost.flops / 1e9 + stages["embed"].bytes / 3e15)
    asked = stage_costs(model, PREFIXES, 32, touched, itemsize=2, asked_rows=5)
    head_per_row = 2 * hf["vocab_size"] * hf["hidden_size"]
    assert asked["head"].flops == 5 * head_per_row
    assert stages["head"].flops == 32 * len(PREFIXES) * head_per_row
    assert {n: c for n, c in asked.items() if n != "head"} == {
        n: c for n, c in stages.items() if n != "head"}
    two = {"a": RoundCost(100, 0, 1), "b": RoundCost(1, 0, 100)}  # one of each bound
    assert serial_floor_s(two, 1.0, 1.0) == 200.0


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
    assert all(0 <= r["asked_rows"] <= r["block"] * r["batch"] for r in rows)
    assert all(r["serial_ratio"] == pytest.approx(r["round_ms"] / r["serial_floor_ms"])
               for r in rows)
    assert all(p % r["block"] == 0 for r in rows for p in r["prefixes"])
    assert (tmp_path / "roofline.md").read_text().startswith("| backend")


def test_serial_floor_rereads_a_saved_table(tmp_path: Path) -> None:
    """serial_floor.py recomputes a saved table's floors from its rows and ceilings alone:
    the same floor and serial floor the benchmark wrote, and the goal figures of each row."""
    table, out = tmp_path / "roofline.json", tmp_path / "floors.json"
    round_roofline.main(["--preset", "tiny", "--device", "cpu", "--batch-sizes", "1", "4",
                         "--prefixes", "40", "--backends", "torch", "--iters", "1",
                         "--warmup", "0", "--out", str(table)])
    serial_floor.main([str(table), "--preset", "tiny", "--backend", "torch", "--out", str(out)])
    saved = json.loads(table.read_text())["rows"]
    again = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in again] == [1, 4]
    for old, new in zip(saved, again, strict=True):
        assert new["floor_ms"] == pytest.approx(old["floor_ms"])
        assert new["serial_floor_ms"] == pytest.approx(old["serial_floor_ms"])
        assert sum(new["stage_ms"].values()) == pytest.approx(new["serial_floor_ms"])
        assert new["goal_ms"] == pytest.approx(1.3 * new["floor_ms"])
        assert new["needed"] == pytest.approx(new["serial_floor_ms"] / new["goal_ms"])
