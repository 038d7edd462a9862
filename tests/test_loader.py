"""Strict checkpoint loading: name mapping, packing, dtypes, and loud failures."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm_serve.model.config import ModelConfig
from dllm_serve.model.loader import load_model
from dllm_serve.models import MODELS, get_model_class
from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

CPU = torch.device("cpu")
Tensors = dict[str, torch.Tensor]


def edited_copy(src: Path, dst: Path, edit: Callable[[Tensors], None]) -> Path:
    """Copy the checkpoint folder and apply `edit` to its tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(ModelConfig.load(path), dtype, CPU)


def test_every_tensor_lands_in_its_slot(tiny_model_dir) -> None:
    model = load(tiny_model_dir)
    w = {k: v.float() for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    params = dict(model.named_parameters())
    inter = 32
    for e in (0, 5, 7):
        hf = f"model.layers.2.mlp.experts.{e}"
        w13, w2 = params["model.layers.2.mlp.experts.w13"], params["model.layers.2.mlp.experts.w2"]
        assert torch.equal(w13[e, :inter], w[f"{hf}.gate_proj.weight"])
        assert torch.equal(w13[e, inter:], w[f"{hf}.up_proj.weight"])
        assert torch.equal(w2[e], w[f"{hf}.down_proj.weight"])
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up, torch.cat([w["model.layers.0.mlp.gate_proj.weight"],
                                           w["model.layers.0.mlp.up_proj.weight"]]))
    shared = params["model.layers.1.mlp.shared_experts.gate_up_proj.weight"]
    assert torch.equal(shared[inter:], w["model.layers.1.mlp.shared_experts.up_proj.weight"])
    for name in ("model.norm.weight", "model.layers.2.mlp.gate.expert_bias", "lm_head.weight"):
        assert torch.equal(params[name], w[name])
    renamed = {"model.embed_tokens.weight": "model.word_embeddings.weight",
               "model.layers.1.self_attn.qkv_proj.weight":
                   "model.layers.1.attention.query_key_value.weight",
               "model.layers.1.self_attn.q_norm.weight":
                   "model.layers.1.attention.query_layernorm.weight",
               "model.layers.1.self_attn.o_proj.weight": "model.layers.1.attention.dense.weight"}
    for ours, hf in renamed.items():
        assert torch.equal(params[ours], w[hf])
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


def test_bf16_keeps_router_in_fp32(tiny_model_dir) -> None:
    model = load(tiny_model_dir, torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {f"model.layers.{i}.mlp.gate.{k}" for i in (1, 2) for k in ("weight",
                                                                             "expert_bias")}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_router_in_model_dtype_when_not_fp32(tmp_path) -> None:
    path = build_tiny_checkpoint(tmp_path, router_dtype=None)
    model = load(path, torch.bfloat16)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.expert_bias.dtype == torch.float32


def _drop(name: str) -> Callable[[Tensors], None]:
    return lambda t: t.pop(name)


def _add_unexpected(t: Tensors) -> None:
    t["model.layers.0.mlp.gate.weight"] = torch.zeros(8, 64)


def _misshape(t: Tensors) -> None:
    t["model.layers.1.attention.dense.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)


@pytest.mark.parametrize(("edit", "pattern"), [
    (_drop("model.norm.weight"), r"missing 1 tensor.*'model\.norm\.weight'"),
    (_drop("model.layers.2.mlp.experts.3.up_proj.weight"),
     r"missing.*'model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight'"),
    (_drop("model.layers.1.mlp.gate.expert_bias"), r"missing.*gate\.expert_bias"),
    (_add_unexpected, r"unexpected tensor 'model\.layers\.0\.mlp\.gate\.weight'"),
    (_misshape, r"'model\.layers\.1\.attention\.dense\.weight' has shape \[64, 32\].*"
                r"expects \[64, 64\]"),
])
def test_strict_errors_name_the_tensor(tiny_model_dir, tmp_path, edit, pattern) -> None:
    path = edited_copy(tiny_model_dir, tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match=pattern):
        load(path)


def test_missing_expert_reports_every_slot(tiny_model_dir, tmp_path) -> None:
    def drop_expert(t: Tensors) -> None:
        for part in ("gate_proj", "up_proj", "down_proj"):
            t.pop(f"model.layers.1.mlp.experts.6.{part}.weight")

    path = edited_copy(tiny_model_dir, tmp_path / "ckpt", drop_expert)
    with pytest.raises(ValueError, match=r"missing 3 tensor.*experts\.6\.down_proj.*experts\.w2"):
        load(path)


def test_expert_index_out_of_range_is_unexpected(tiny_model_dir, tmp_path) -> None:
    def extra_expert(t: Tensors) -> None:
        t["model.layers.1.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)

    path = edited_copy(tiny_model_dir, tmp_path / "ckpt", extra_expert)
    with pytest.raises(ValueError, match=r"unexpected tensor .*experts\.8\.gate_proj"):
        load(path)


def test_sharded_checkpoint_and_duplicates(tiny_model_dir, tmp_path) -> None:
    path = shutil.copytree(tiny_model_dir, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    reference = load(tiny_model_dir).state_dict()
    for name, value in load(path).state_dict().items():
        assert torch.equal(value, reference[name]), name
    save_file({names[0]: tensors[names[0]]}, str(path / "model-extra.safetensors"))
    with pytest.raises(ValueError, match=f"{names[0]!r} appears twice"):
        load(path)


def test_ignores_rotary_inv_freq(tiny_model_dir, tmp_path) -> None:
    def add(t: Tensors) -> None:
        t["model.rotary_emb.inv_freq"] = torch.ones(4)
        t["model.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(4)

    load(edited_copy(tiny_model_dir, tmp_path / "ckpt", add))


def test_tied_lm_head(tmp_path) -> None:
    path = build_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    def add_same(t: Tensors) -> None:
        t["lm_head.weight"] = t["model.word_embeddings.weight"].clone()

    load(edited_copy(path, tmp_path / "same", add_same))

    def add_different(t: Tensors) -> None:
        t["lm_head.weight"] = torch.zeros_like(t["model.word_embeddings.weight"])

    with pytest.raises(ValueError, match="'lm_head.weight' is tied"):
        load(edited_copy(path, tmp_path / "different", add_different))


def test_config_variants_load(tmp_path) -> None:
    path = build_tiny_checkpoint(tmp_path, use_qkv_bias=True, use_bias=True, use_qk_norm=False,
                                 num_shared_experts=0, n_group=0, topk_group=0)
    names = set(load_file(str(path / "model.safetensors")))
    assert "model.layers.0.attention.query_key_value.bias" in names
    assert "model.layers.0.attention.dense.bias" in names
    assert not any("query_layernorm" in n or "key_layernorm" in n for n in names)
    assert not any("shared_experts" in n for n in names)
    model = load(path)
    assert model.model.layers[0].self_attn.o_proj.bias is not None


def test_unknown_architecture_lists_known(tiny_model_dir, tmp_path) -> None:
    path = shutil.copytree(tiny_model_dir, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LLaDA2MoeForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match="unknown model architecture 'LLaDA2MoeForCausalLM'; "
                                       "known: LLaDA2MoeModelLM"):
        load(path)
    with pytest.raises(KeyError, match="known: LLaDA2MoeModelLM"):
        get_model_class("Nope")
    assert "LLaDA2MoeModelLM" in MODELS


def test_no_weights_file(tiny_model_dir, tmp_path) -> None:
    path = shutil.copytree(tiny_model_dir, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load(path)
