"""Golden fixtures for SDAR (dense and MoE), computed once by independent code on our tiny
checkpoints; tests/test_golden.py checks our model against them.

    pip install --target /tmp/golden-env --no-deps transformers==4.57.6 tokenizers==0.22.1 \\
        huggingface_hub==0.36.0 einops
    PYTHONPATH=/tmp/golden-env python scripts/golden/make_sdar_golden.py \\
        --sdar-repo /work/.mirror/JetAstra+SDAR/repo

--sdar-repo: a git mirror of github.com/JetAstra/SDAR. transformers stays out of the project's
dependencies: install it in a separate folder as above.

Dense (SDARForCausalLM): the forward is JetAstra's own modeling_sdar.py
(training/model/SDAR-8B-Chat/, loaded from the mirror at run time), cross-checked here against
transformers' Qwen3ForCausalLM with the same block-causal mask. MoE (SDARMoeForCausalLM):
SDAR-30B-A3B's modeling file is not in any public repository we could reach, so its fixture
comes from transformers' Qwen3MoeForCausalLM (SDAR-MoE keeps Qwen3-MoE's weights and math; the
harness passes SDAR's block-causal mask). Generation: JetAstra's `block_diffusion_generate`
(evaluation/opencompass/opencompass/models/huggingface_bd3.py, its functions read from the
mirror) with remasking 'low_confidence', temperature 1 and top_k 1 (the argmax, with its
softmax probability as confidence), threshold 0.9, block 4, 4 denoising steps: SDAR's
low_confidence_dynamic, i.e. our LowConfidence at 0.9.

Harness adaptations (their code is run unmodified):
- flash_attn is not installable on a CPU machine: modeling_sdar.py imports its RMSNorm and
  attention functions, so stand-ins in plain PyTorch (fp32 RMSNorm; SDPA with GQA) are put in
  sys.modules while the file is imported.
- transformers 4.54 renamed `LossKwargs` (imported by modeling_sdar.py, used only as a typing
  base) to `TransformersKwargs`; the old name is aliased.
- Qwen3-MoE has no `store_kv` switch: an adapter drops what a store_kv=False call appended to
  the cache (SDAR's modeling only reads the cache then) and turns the 0/1 block mask into an
  additive 4-D one.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from golden_common import (
    block_causal_allowed,
    functions_from_source,
    git_file,
    git_head,
    logits_record,
    save_fixture,
    sha256,
    versions,
)

BLOCK, STEPS, THRESHOLD, MASK_ID, STOP_IDS = 4, 4, 0.9, 151669, [151643, 151645]
MODEL_DIR = "training/model/SDAR-8B-Chat"
MODEL_FILES = ("modeling_sdar.py", "configuration_sdar.py",
               "fused_linear_diffusion_cross_entropy.py")
GENERATE_FILE = "evaluation/opencompass/opencompass/models/huggingface_bd3.py"
GENERATE_FUNCTIONS = ("add_gumbel_noise", "top_k_logits", "top_p_logits",
                      "sample_with_temperature_topk_topp", "get_num_transfer_tokens",
                      "block_diffusion_generate")
FORWARD_LEN = 3 * BLOCK
PROMPT_LEN, GEN_LEN = 10, 14  # the first generated block holds the prompt's last 2 tokens


# ---------------------------------------------------------------- loading their code

def _rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, bias: Any = None, eps: float = 1e-6,
                 **_: Any) -> torch.Tensor:
    """Stand-in for flash_attn's rms_norm_fn: fp32 statistics, times the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     softmax_scale: float | None = None, **_: Any) -> torch.Tensor:
    """Stand-in for flash_attn_func: q (B, L, H, D), k/v (B, S, KVH, D) -> (B, L, H, D)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=causal,
                                         scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def load_sdar_modeling(repo: Path, work: Path) -> types.ModuleType:
    """JetAstra's modeling_sdar.py as package `sdar_remote` (files copied to `work`)."""
    import transformers.integrations.flash_attention  # noqa: F401 (probes flash_attn first)
    import transformers.utils as tu

    if not hasattr(tu, "LossKwargs"):
        tu.LossKwargs = tu.TransformersKwargs
    package = work / "sdar_remote"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in MODEL_FILES:
        (package / name).write_text(git_file(repo, f"{MODEL_DIR}/{name}"))
    stubs = {"flash_attn": {"flash_attn_func": _flash_attn_func, "flash_attn_varlen_func": None},
             "flash_attn.ops": {}, "flash_attn.ops.triton": {},
             "flash_attn.ops.triton.layer_norm": {"rms_norm_fn": _rms_norm_fn}}
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    sys.path.insert(0, str(work))
    try:
        import sdar_remote.modeling_sdar as modeling
    finally:
        for name in stubs:
            sys.modules.pop(name)
    return modeling


def load_generate(repo: Path) -> Any:
    from transformers.cache_utils import DynamicCache

    namespace = {"torch": torch, "F": F, "np": np, "DynamicCache": DynamicCache}
    functions_from_source(git_file(repo, GENERATE_FILE), GENERATE_FUNCTIONS, namespace)
    return namespace["block_diffusion_generate"]


class StoreKvAdapter(torch.nn.Module):
    """Gives a plain HF causal LM the call signature JetAstra's generate uses with SDAR."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, past_key_values: Any, use_cache: bool,
                store_kv: bool) -> Any:
        seen = past_key_values.get_seq_length()
        additive = torch.zeros(attention_mask.shape, dtype=torch.float32)
        additive = additive.masked_fill(attention_mask == 0, float("-inf"))[:, None]
        out = self.model(input_ids=input_ids, attention_mask=additive, position_ids=position_ids,
                         past_key_values=past_key_values, use_cache=True)
        if not store_kv:
            past_key_values.crop(seen)
        return out


# ---------------------------------------------------------------- running it

def forward_logits(model: torch.nn.Module, ids: torch.Tensor, additive_4d: bool) -> torch.Tensor:
    """One block-causal forward over ids (L,) -> logits (L, V) fp32."""
    allowed = block_causal_allowed(len(ids), BLOCK)[None]
    mask = (torch.zeros_like(allowed).masked_fill(allowed == 0, float("-inf"))[:, None]
            if additive_4d else allowed)
    with torch.no_grad():
        return model(input_ids=ids[None], attention_mask=mask,
                     position_ids=torch.arange(len(ids))[None]).logits[0].float()


def greedy(generate: Any, model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    """Their generate at LowConfidence 0.9 -> the generated ids (up to the first stop id)."""
    x = generate(model, None, {"input_ids": prompt[None],
                               "attention_mask": torch.ones(1, len(prompt))},
                 mask_id=MASK_ID, gen_length=GEN_LEN, block_length=BLOCK,
                 denoising_steps=STEPS, temperature=1.0, top_k=1, top_p=1.0,
                 remasking="low_confidence", threshold=THRESHOLD, stopping_criteria_idx=STOP_IDS)
    out = x[0, len(prompt):len(prompt) + GEN_LEN]
    if (out == MASK_ID).any():
        raise RuntimeError("the argmax hit the mask id: pick another prompt")
    stops = [i for i, t in enumerate(out.tolist()) if t in STOP_IDS]
    return out[:stops[0] + 1] if stops else out


def inputs(seed: int, length: int) -> torch.Tensor:
    ids = torch.randint(0, 151643, (length,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.tensor([151644]), ids[1:]])  # <|im_start|> first


def hf_config(cls: Any, path: Path) -> Any:
    hf = json.loads((path / "config.json").read_text())
    return cls(**{k: v for k, v in hf.items() if k not in ("architectures", "auto_map",
                                                          "model_type")})


def dense_fixture(repo: Path, ckpt: Path, work: Path, generate: Any) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    modeling = load_sdar_modeling(repo, work)
    config = modeling.SDARConfig(**json.loads((ckpt / "config.json").read_text()))
    theirs = modeling.SDARForCausalLM.from_pretrained(ckpt, config=config,
                                                      dtype=torch.float32).eval()
    ids = inputs(1, FORWARD_LEN)
    logits = forward_logits(theirs, ids, additive_4d=False)
    qwen3 = Qwen3ForCausalLM.from_pretrained(ckpt, config=hf_config(Qwen3Config, ckpt),
                                             dtype=torch.float32,
                                             attn_implementation="eager").eval()
    cross = (forward_logits(qwen3, ids, additive_4d=True) - logits).abs().max().item()
    if cross > 1e-5:
        raise RuntimeError(f"SDAR's modeling and Qwen3 disagree by {cross}: harness broken?")
    prompt = inputs(2, PROMPT_LEN)
    meta = {"forward": f"JetAstra/SDAR@{git_head(repo)}:{MODEL_DIR}/modeling_sdar.py",
            "qwen3_crosscheck_max_abs": cross}
    write("sdar", ckpt, ids, logits, prompt, greedy(generate, theirs, prompt), repo, meta)


def moe_fixture(repo: Path, ckpt: Path, generate: Any) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, config=hf_config(Qwen3MoeConfig, ckpt),
                                                dtype=torch.float32,
                                                attn_implementation="eager").eval()
    ids = inputs(1, FORWARD_LEN)
    logits = forward_logits(model, ids, additive_4d=True)
    prompt = inputs(2, PROMPT_LEN)
    meta = {"forward": "transformers Qwen3MoeForCausalLM (no public SDAR-MoE modeling file)"}
    write("sdar_moe", ckpt, ids, logits, prompt, greedy(generate, StoreKvAdapter(model), prompt),
          repo, meta)


def write(name: str, ckpt: Path, ids: torch.Tensor, logits: torch.Tensor, prompt: torch.Tensor,
          output: torch.Tensor, repo: Path, meta: dict[str, Any]) -> None:
    tensors = {**logits_record(ids, logits, [MASK_ID, *STOP_IDS]), "prompt_ids": prompt,
               "output_ids": output}
    save_fixture(name, tensors, {
        **meta, "checkpoint": {"arch": name, "seed": 0,
                               "model.safetensors sha256": sha256(ckpt / "model.safetensors")},
        "generate": f"JetAstra/SDAR@{git_head(repo)}:{GENERATE_FILE}:block_diffusion_generate",
        "settings": {"block_length": BLOCK, "denoising_steps": STEPS, "threshold": THRESHOLD,
                     "remasking": "low_confidence", "temperature": 1.0, "top_k": 1,
                     "gen_length": GEN_LEN, "mask_id": MASK_ID, "stop_ids": STOP_IDS},
        "versions": versions()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdar-repo", type=Path, required=True,
                        help="git mirror of github.com/JetAstra/SDAR")
    args = parser.parse_args()
    from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

    torch.manual_seed(0)
    generate = load_generate(args.sdar_repo)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dense = build_tiny_checkpoint(work / "sdar", arch="sdar", seed=0)
        dense_fixture(args.sdar_repo, dense, work, generate)
        moe = build_tiny_checkpoint(work / "sdar_moe", arch="sdar_moe", seed=0)
        moe_fixture(args.sdar_repo, moe, generate)


if __name__ == "__main__":
    main()
