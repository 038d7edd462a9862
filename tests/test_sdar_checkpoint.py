"""The tiny-checkpoint builder writes SDAR's exact HF layout (dense and MoE), reproducibly, with
a Qwen-style tokenizer whose special tokens sit at SDAR's real ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dllm_serve.model.config import ModelConfig
from dllm_serve.models import get_model_class
from dllm_serve.models.sdar_config import SDARConfig
from dllm_serve.tokenizer import Tokenizer
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

FILES = ("added_tokens.json", "config.json", "generation_config.json", "model.safetensors",
         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
# Every key of SDAR-8B-Chat's config.json but block_size / mask_token_id (models.md §3),
# spelled out independently of the builder.
DENSE_KEYS = """architectures auto_map attention_bias attention_dropout attn_implementation
bos_token_id debug eos_token_id ep_size fuse_cross_entropy head_dim hidden_act hidden_size
initializer_range intermediate_size max_position_embeddings max_window_layers micro_forward
model_type num_attention_heads num_hidden_layers num_key_value_heads rms_norm_eps rope_scaling
rope_theta skip_checkpoint sliding_window tie_word_embeddings torch_dtype transformers_version
use_cache use_deepep use_sliding_window vocab_size""".split()
MOE_KEYS = """decoder_sparse_step mlp_only_layers moe_intermediate_size norm_topk_prob num_experts
num_experts_per_tok output_router_logits router_aux_loss_coef""".split()
SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
               "<tool_call>": 151657, "<think>": 151667, "</think>": 151668, "<|MASK|>": 151669}
ROOT = Path(__file__).resolve().parents[1]


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _tensors(path: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def test_dense_files_config_and_tensors(tiny_sdar_dir: Path) -> None:
    assert sorted(p.name for p in tiny_sdar_dir.iterdir()) == sorted(FILES)
    cfg = _config(tiny_sdar_dir)
    assert set(cfg) == set(DENSE_KEYS)
    assert cfg["architectures"] == ["SDARForCausalLM"] and cfg["model_type"] == "sdar"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_sdar.SDARForCausalLM"
    assert (cfg["vocab_size"], cfg["eos_token_id"], cfg["bos_token_id"]) == (151936, 151643,
                                                                             151643)
    tensors = _tensors(tiny_sdar_dir)
    assert len(tensors) == 3 + 3 * 11
    assert tensors["model.embed_tokens.weight"] == ([151936, 64], "BF16")
    assert tensors["model.layers.0.self_attn.q_proj.weight"][0] == [4 * 16, 64]
    assert tensors["model.layers.0.self_attn.k_proj.weight"][0] == [2 * 16, 64]
    assert tensors["model.layers.2.self_attn.o_proj.weight"][0] == [64, 64]
    assert tensors["model.layers.2.self_attn.q_norm.weight"][0] == [16]
    assert tensors["model.layers.1.mlp.down_proj.weight"][0] == [64, 128]
    assert tensors["lm_head.weight"][0] == [151936, 64]
    model_cfg = ModelConfig.load(tiny_sdar_dir)
    assert model_cfg.architecture == "SDARForCausalLM"
    assert model_cfg.token_id("mask_token_id") is None  # the real config has none
    assert model_cfg.eos_token_ids() == [151643]


def test_moe_config_and_tensors(tiny_sdar_moe_dir: Path) -> None:
    cfg = _config(tiny_sdar_moe_dir)
    assert set(cfg) == set(DENSE_KEYS) | set(MOE_KEYS)
    assert cfg["architectures"] == ["SDARMoeForCausalLM"] and cfg["model_type"] == "sdar_moe"
    tensors = _tensors(tiny_sdar_moe_dir)
    assert len(tensors) == 3 + 3 * (8 + 1 + 8 * 3)
    assert tensors["model.layers.0.mlp.gate.weight"] == ([8, 64], "BF16")
    assert tensors["model.layers.2.mlp.experts.7.up_proj.weight"][0] == [32, 64]
    assert tensors["model.layers.2.mlp.experts.7.down_proj.weight"][0] == [64, 32]
    assert not any("shared_expert" in n or "expert_bias" in n for n in tensors)


def test_tokenizer_files_and_special_ids(tiny_sdar_dir: Path) -> None:
    tok = Tokenizer.load(tiny_sdar_dir)
    assert {t: tok.token_to_id(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    assert tok.vocab_size == 151670
    assert (tok.eos_token_id, tok.mask_token_id, tok.bos_token_id) == (151643, 151669, None)
    assert tok.extra_stop_token_ids == [151645, 151643]
    added = json.loads((tiny_sdar_dir / "added_tokens.json").read_text())
    assert added["<|MASK|>"] == 151669 and len(added) == 27
    tcfg = json.loads((tiny_sdar_dir / "tokenizer_config.json").read_text())
    assert tcfg["added_tokens_decoder"]["151669"]["content"] == "<|MASK|>"
    assert tcfg["added_tokens_decoder"]["151667"]["special"] is False  # <think>, as in Qwen3
    gen = json.loads((tiny_sdar_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]
    ids = tok.encode("12 eggs<|im_end|>")
    assert ids[:2] != [] and ids[-1] == 151645 and tok.decode(ids) == "12 eggs"
    assert len(tok.encode("12")) == 2  # Qwen splits digits one by one
    assert all(tok.decode([i]) for i in (400, 90000, 151642))  # filler ids decode to words


def test_chat_template_is_qwen3_format(tiny_sdar_dir: Path) -> None:
    tok = Tokenizer.load(tiny_sdar_dir)
    text = tok.apply_chat_template([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
        {"role": "user", "content": "2+2?"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}],
                                   add_generation_prompt=False) == (
        "<|im_start|>user\nx<|im_end|>\n")


def test_same_seed_same_bytes(tiny_sdar_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_checkpoint(tmp_path / "again", arch="sdar", seed=0)
    other = build_tiny_checkpoint(tmp_path / "other", arch="sdar", seed=1)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_sdar_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


@pytest.mark.parametrize(("arch", "preset", "shape"), [
    ("sdar", "sdar-8b-shape", (4096, 36, 32, 8, 12288, 0)),
    ("sdar_moe", "sdar-30b-a3b-shape", (2048, 48, 32, 4, 6144, 128)),
])
def test_real_shape_presets_without_weights(tmp_path: Path, arch: str, preset: str,
                                            shape: tuple) -> None:
    path = build_tiny_checkpoint(tmp_path, arch=arch, preset=preset, weights=False)
    assert not (path / "model.safetensors").exists()
    cfg = _config(path)
    assert tuple(cfg.get(k, 0) for k in ("hidden_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads",
                                         "intermediate_size", "num_experts")) == shape
    parsed = SDARConfig.from_hf(cfg, moe=arch == "sdar_moe")
    assert parsed.decoder.head_dim == 128 and parsed.vocab_size == 151936
    with torch.device("meta"):
        model = get_model_class(cfg["architectures"][0])(cfg)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert billions == pytest.approx(8.2 if arch == "sdar" else 30.5, abs=0.3)


def test_preset_and_override_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'llada2-mini-shape' for sdar"):
        build_tiny_checkpoint(tmp_path / "a", arch="sdar", preset="llada2-mini-shape")
    with pytest.raises(ValueError, match="unknown config key"):
        build_tiny_checkpoint(tmp_path / "b", arch="sdar", dtype="float32")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_checkpoint(tmp_path / "c", arch="sdar", vocab_size=151000)
    with pytest.raises(ValueError, match="unknown tiny-checkpoint arch"):
        build_tiny_checkpoint(tmp_path / "d", arch="qwen3")


def test_script_writes_sdar(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), "--arch",
                    "sdar_moe", "--out", str(out), "--set", "num_hidden_layers=1",
                    "--set", "torch_dtype=float32"], check=True, capture_output=True)
    cfg = _config(out)
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["SDARMoeForCausalLM"]
    assert _tensors(out)["model.norm.weight"] == ([64], "F32")
