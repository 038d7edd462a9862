"""The tiny-checkpoint builder writes LLaDA2's exact HF layout, small and reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dllm_serve.model.config import ModelConfig
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

FILES = ("config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
         "tokenizer.json", "tokenizer_config.json")
# Every key of LLaDA2.1-mini's config.json (models.md §1.1), spelled out independently.
REAL_KEYS = """architectures model_type dtype transformers_version auto_map hidden_size
num_hidden_layers num_attention_heads num_key_value_heads head_dim intermediate_size
moe_intermediate_size num_experts num_experts_per_tok num_shared_experts first_k_dense_replace
n_group topk_group routed_scaling_factor score_function moe_router_enable_expert_bias
router_dtype norm_topk_prob norm_softmax rope_theta rope_scaling partial_rotary_factor rotary_dim
rms_norm_eps max_position_embeddings max_window_layers sliding_window attention_dropout
embedding_dropout output_dropout initializer_range hidden_act norm_head output_router_logits
pad_token_id tie_word_embeddings use_bias use_cache use_qkv_bias use_rmsnorm use_sliding_window
using_split_qkv_in_self_attention vocab_size""".split()
ROOT = Path(__file__).resolve().parents[1]


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _tensors(path: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: (list(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}


def test_files_and_size(tiny_model_dir) -> None:
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == sorted(FILES)
    assert sum(p.stat().st_size for p in tiny_model_dir.iterdir()) < 2_000_000


def test_config_keys_and_values(tiny_model_dir) -> None:
    cfg = _config(tiny_model_dir)
    assert set(REAL_KEYS) <= set(cfg)
    assert set(cfg) - set(REAL_KEYS) == {"mask_token_id", "eos_token_id"}
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"] and cfg["model_type"] == "llada2_moe"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_llada2_moe.LLaDA2MoeModelLM"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"], cfg["rotary_dim"]) == (
        64, 3, 16, 8)
    assert cfg["vocab_size"] % 64 == 0
    assert cfg["pad_token_id"] == cfg["eos_token_id"]
    model_cfg = ModelConfig.load(tiny_model_dir)
    assert model_cfg.architecture == "LLaDA2MoeModelLM"
    assert model_cfg.token_id("mask_token_id") == cfg["mask_token_id"]
    assert model_cfg.eos_token_ids() == [cfg["eos_token_id"]]


def test_tensor_names_shapes_dtypes(tiny_model_dir) -> None:
    tensors = _tensors(tiny_model_dir)
    per_layer_attn, dense_mlp, moe = 4, 3, 2 + 8 * 3 + 3  # qkv, q/k norms, dense
    assert len(tensors) == 3 + 3 * (2 + per_layer_attn) + dense_mlp + 2 * moe
    assert tensors["model.word_embeddings.weight"] == ([448, 64], torch.bfloat16)
    assert tensors["model.layers.0.attention.query_key_value.weight"][0] == [(4 + 2 * 2) * 16, 64]
    assert tensors["model.layers.0.attention.query_layernorm.weight"][0] == [16]
    assert tensors["model.layers.0.attention.dense.weight"][0] == [64, 64]
    assert tensors["model.layers.0.mlp.gate_proj.weight"][0] == [128, 64]
    assert tensors["model.layers.0.mlp.down_proj.weight"][0] == [64, 128]
    assert tensors["model.layers.1.mlp.gate.weight"][0] == [8, 64]
    assert tensors["model.layers.1.mlp.gate.expert_bias"] == ([8], torch.float32)
    assert tensors["model.layers.2.mlp.experts.7.up_proj.weight"][0] == [32, 64]
    assert tensors["model.layers.2.mlp.experts.7.down_proj.weight"][0] == [64, 32]
    assert tensors["model.layers.2.mlp.shared_experts.gate_proj.weight"][0] == [32, 64]
    assert tensors["lm_head.weight"][0] == [448, 64]
    assert "model.layers.0.mlp.gate.weight" not in tensors


def test_same_seed_same_bytes(tiny_model_dir, tmp_path) -> None:
    again = build_tiny_checkpoint(tmp_path / "again", seed=0)
    other = build_tiny_checkpoint(tmp_path / "other", seed=1)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_overrides(tmp_path) -> None:
    path = build_tiny_checkpoint(tmp_path / "a", num_hidden_layers=2, hidden_size=32,
                                 dtype="float32")
    cfg, tensors = _config(path), _tensors(path)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (2, 32)
    assert tensors["model.norm.weight"] == ([32], torch.float32)
    assert not any(k.startswith("model.layers.2.") for k in tensors)
    with pytest.raises(ValueError, match="unknown config key"):
        build_tiny_checkpoint(tmp_path / "b", num_layers=2)
    with pytest.raises(ValueError, match="unknown preset"):
        build_tiny_checkpoint(tmp_path / "c", preset="huge")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_checkpoint(tmp_path / "d", vocab_size=64)


def test_script(tmp_path) -> None:
    script = str(ROOT / "scripts" / "make_tiny_model.py")
    help_text = subprocess.run([sys.executable, script, "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--arch" in help_text and "--seed" in help_text
    out = tmp_path / "cli"
    subprocess.run([sys.executable, script, "--arch", "llada2_moe", "--out", str(out),
                    "--seed", "0", "--set", "num_hidden_layers=2"], check=True,
                   capture_output=True)
    assert _config(out)["num_hidden_layers"] == 2
