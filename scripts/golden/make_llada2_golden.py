"""Golden fixture for LLaDA2 (`LLaDA2MoeModelLM`), computed once by inclusionAI's HF modeling
file on our tiny checkpoint; tests/test_golden.py checks our model against it.

    pip install --target /tmp/golden-env --no-deps transformers==4.57.6 tokenizers==0.22.1 \\
        huggingface_hub==0.36.0
    PYTHONPATH=/tmp/golden-env python scripts/golden/make_llada2_golden.py \\
        --llada2-repo /work/.mirror/lingjiechen2+dllm/repo

--llada2-repo: a git mirror of github.com/lingjiechen2/dllm, whose
dllm/pipelines/llada2/models/{modeling,configuration}_llada2_moe.py are the HF remote-code files
of inclusionAI/LLaDA2.0-mini (models.md §1.2: verbatim, plus a small 4-D bool-mask tweak).
The forward is `LLaDA2MoeModelLM.forward` with the block-causal mask its `generate` builds; the
greedy tokens are its own `generate` (temperature 0, block 32, 32 steps, threshold 0.95: our
LowConfidence at 0.95; it recomputes the whole window each step, no KV cache).

Harness adaptation (their code is run unmodified): `generate` casts its additive mask to
bfloat16, which SDPA refuses next to fp32 queries; the model's `forward` is wrapped to hand the
same mask (0 / -inf, exact in either dtype) over as fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from golden_common import (
    block_causal_allowed,
    git_file,
    git_head,
    logits_record,
    save_fixture,
    sha256,
    versions,
)

BLOCK, THRESHOLD = 32, 0.95
MODEL_DIR = "dllm/pipelines/llada2/models"
FORWARD_LEN = 2 * BLOCK
PROMPT_LEN, GEN_LEN = 40, 56  # prompt + generation = 3 blocks; the first holds 8 prompt tokens


def load_modeling(repo: Path, work: Path) -> Any:
    package = work / "llada2_remote"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("modeling_llada2_moe.py", "configuration_llada2_moe.py"):
        (package / name).write_text(git_file(repo, f"{MODEL_DIR}/{name}"))
    sys.path.insert(0, str(work))
    import llada2_remote.modeling_llada2_moe as modeling

    return modeling


def fp32_mask_forward(model: torch.nn.Module) -> None:
    """Route the model's forward through a cast of the attention mask to fp32."""
    forward = model.forward

    def wrapped(*args: Any, attention_mask: torch.Tensor | None = None, **kw: Any) -> Any:
        mask = attention_mask.float() if attention_mask is not None else None
        return forward(*args, attention_mask=mask, **kw)

    model.forward = wrapped  # type: ignore[method-assign]


def prompt_ids(seed: int, length: int, vocab: int, specials: set[int]) -> torch.Tensor:
    ids = torch.randint(0, vocab, (4 * length,), generator=torch.Generator().manual_seed(seed))
    return torch.tensor([i for i in ids.tolist() if i not in specials][:length])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llada2-repo", type=Path, required=True,
                        help="git mirror of github.com/lingjiechen2/dllm")
    args = parser.parse_args()
    from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = build_tiny_checkpoint(work / "llada2", arch="llada2_moe", seed=0)
        hf = json.loads((ckpt / "config.json").read_text())
        modeling = load_modeling(args.llada2_repo, work)
        config = modeling.LLaDA2MoeConfig(**hf)
        model = modeling.LLaDA2MoeModelLM.from_pretrained(ckpt, config=config,
                                                          dtype=torch.float32).eval()
        fp32_mask_forward(model)
        mask_id, eos_id, vocab = hf["mask_token_id"], hf["eos_token_id"], hf["vocab_size"]
        specials = set(range(mask_id - 3, vocab))  # the tokenizer's special ids and padding
        ids = prompt_ids(1, FORWARD_LEN, vocab, specials)
        allowed = block_causal_allowed(FORWARD_LEN, BLOCK)
        additive = torch.zeros_like(allowed).masked_fill(allowed == 0, float("-inf"))
        with torch.no_grad():
            logits = model(ids[None], attention_mask=additive[None, None],
                           position_ids=torch.arange(FORWARD_LEN)[None]).logits[0].float()
        prompt = prompt_ids(2, PROMPT_LEN, vocab, specials)
        out = model.generate(prompt[None], temperature=0.0, block_length=BLOCK, steps=BLOCK,
                             gen_length=GEN_LEN, threshold=THRESHOLD, eos_id=eos_id,
                             mask_id=mask_id)[0]
        if (out == mask_id).any():
            raise RuntimeError("the argmax hit the mask id: pick another prompt")
        tensors = {**logits_record(ids, logits, [mask_id, eos_id]), "prompt_ids": prompt,
                   "output_ids": out}
        save_fixture("llada2", tensors, {
            "forward": f"lingjiechen2/dllm@{git_head(args.llada2_repo)}:{MODEL_DIR}/"
                       "modeling_llada2_moe.py (inclusionAI's HF LLaDA2MoeModelLM)",
            "generate": "the same file: LLaDA2MoeModelLM.generate",
            "checkpoint": {"arch": "llada2_moe", "seed": 0,
                           "model.safetensors sha256": sha256(ckpt / "model.safetensors")},
            "settings": {"block_length": BLOCK, "steps": BLOCK, "threshold": THRESHOLD,
                         "temperature": 0.0, "gen_length": GEN_LEN, "mask_id": mask_id,
                         "eos_id": eos_id},
            "versions": versions()})


if __name__ == "__main__":
    main()
