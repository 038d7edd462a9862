"""An independent, naive, full-sequence SDAR forward (dense and MoE): an oracle for our model.

Written from the Qwen3 / Qwen3-MoE modeling math (models.md §3), sharing no code with
dllm_serve: it reads the HF tensors by their checkpoint names (separate q/k/v projections),
normalises each q and k head before RoPE over the whole head, masks attention with
tril(ones(nb, nb)) repeat-interleaved by the block size, routes each token with plain Python
(softmax over all experts, top-k, renormalised when norm_topk_prob) and keeps no KV cache.
fp32 throughout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from naive_llada2 import _rms, _rope, _swiglu
from safetensors.torch import load_file


def naive_softmax_route(logits: list[float], top_k: int, renormalize: bool
                        ) -> list[tuple[int, float]]:
    """One token: [(expert, combine weight)] by Qwen3-MoE's rule, with plain loops."""
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    probs = [e / sum(exps) for e in exps]
    chosen = sorted(range(len(probs)), key=lambda e: -probs[e])[:top_k]
    total = sum(probs[e] for e in chosen) if renormalize else 1.0
    return [(e, probs[e] / total) for e in chosen]


def _naive_moe(x: torch.Tensor, w: dict, p: str, c: dict) -> torch.Tensor:
    out = torch.zeros_like(x)
    logits = (x @ w[f"{p}.gate.weight"].T).tolist()
    for t in range(x.shape[0]):
        for e, weight in naive_softmax_route(logits[t], c["num_experts_per_tok"],
                                             c.get("norm_topk_prob", False)):
            out[t] += weight * _swiglu(x[t:t + 1], w, f"{p}.experts.{e}")[0]
    return out


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return x @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0.0)


def _naive_attention(x: torch.Tensor, w: dict, p: str, c: dict, mask: torch.Tensor
                     ) -> torch.Tensor:
    seq, heads, d = x.shape[0], c["num_attention_heads"], c["head_dim"]
    kvh, eps, pos = c["num_key_value_heads"], c["rms_norm_eps"], torch.arange(seq)
    q = _rms(_linear(x, w, f"{p}.q_proj").view(seq, heads, d), w[f"{p}.q_norm.weight"], eps)
    k = _rms(_linear(x, w, f"{p}.k_proj").view(seq, kvh, d), w[f"{p}.k_norm.weight"], eps)
    v = _linear(x, w, f"{p}.v_proj").view(seq, kvh, d)
    q, k = _rope(q, pos, d, c["rope_theta"]), _rope(k, pos, d, c["rope_theta"])
    out = torch.zeros(seq, heads, d)
    for h in range(heads):
        g = h // (heads // kvh)
        att = (q[:, h] @ k[:, g].T) / math.sqrt(d) + mask
        out[:, h] = att.softmax(-1) @ v[:, g]
    return _linear(out.reshape(seq, heads * d), w, f"{p}.o_proj")


def _is_sparse(c: dict, layer: int) -> bool:
    return (c.get("num_experts", 0) > 0 and layer not in c.get("mlp_only_layers", [])
            and (layer + 1) % c.get("decoder_sparse_step", 1) == 0)


def naive_sdar_logits(model_dir: Path, ids: list[int], block: int) -> torch.Tensor:
    """Full-sequence block-causal forward in fp32 -> logits (L, vocab)."""
    c = json.loads((model_dir / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    seq, nb = len(ids), -(-len(ids) // block)
    allowed = torch.tril(torch.ones(nb, nb)).repeat_interleave(block, 0).repeat_interleave(block, 1)
    mask = allowed[:seq, :seq].log()  # 0 where allowed, -inf elsewhere
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        x = x + _naive_attention(_rms(x, w[f"{p}.input_layernorm.weight"], c["rms_norm_eps"]),
                                 w, f"{p}.self_attn", c, mask)
        h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], c["rms_norm_eps"])
        x = x + (_naive_moe(h, w, f"{p}.mlp", c) if _is_sparse(c, layer)
                 else _swiglu(h, w, f"{p}.mlp"))
    head = w["model.embed_tokens.weight" if c["tie_word_embeddings"] else "lm_head.weight"]
    return _rms(x, w["model.norm.weight"], c["rms_norm_eps"]) @ head.T
