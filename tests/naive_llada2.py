"""An independent, naive, full-sequence LLaDA2 forward: the oracle for our model.

Written straight from the HF modeling math (models.md §1.3), sharing no code with dllm_serve: it
reads the HF tensors by their checkpoint names, masks attention with tril(ones(nb, nb))
repeat-interleaved by the block size (additive, via log), routes each token with plain Python
loops, and keeps no KV cache. fp32 throughout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    """x (L, N, D); NeoX pairs (i, i + rd/2) rotate by pos * theta^(-2i/rd), dims >= rd pass."""
    half = rd // 2
    out = x.clone()
    for i in range(half):
        angle = pos.double() * theta ** (-2.0 * i / rd)
        c, s = angle.cos().float()[:, None], angle.sin().float()[:, None]
        a, b = x[:, :, i], x[:, :, i + half]
        out[:, :, i], out[:, :, i + half] = a * c - b * s, b * c + a * s
    return out


def _swiglu(x: torch.Tensor, w: dict, p: str) -> torch.Tensor:
    gate, up = x @ w[f"{p}.gate_proj.weight"].T, x @ w[f"{p}.up_proj.weight"].T
    return (gate * torch.sigmoid(gate) * up) @ w[f"{p}.down_proj.weight"].T


def naive_route(logits: list[float], bias: list[float], c: dict) -> list[tuple[int, float]]:
    """One token: [(expert, combine weight)] by the HF group-limited rule, with plain loops."""
    scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    biased = [s + b for s, b in zip(scores, bias, strict=True)]
    groups = c["n_group"] or 1  # n_group 0: one group holding every expert
    size = len(scores) // groups
    group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2])
                   for g in range(groups)]
    kept = sorted(range(groups), key=lambda g: -group_score[g])[:c["topk_group"] or 1]
    candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    chosen = sorted(candidates, key=lambda e: -biased[e])[:c["num_experts_per_tok"]]
    total = sum(scores[e] for e in chosen)
    return [(e, scores[e] / total * c["routed_scaling_factor"]) for e in chosen]


def _naive_moe(x: torch.Tensor, w: dict, p: str, c: dict) -> torch.Tensor:
    out = torch.zeros_like(x)
    logits = (x @ w[f"{p}.gate.weight"].T).tolist()
    bias = w[f"{p}.gate.expert_bias"].tolist()
    for t in range(x.shape[0]):
        for e, weight in naive_route(logits[t], bias, c):
            out[t] += weight * _swiglu(x[t:t + 1], w, f"{p}.experts.{e}")[0]
    return out + _swiglu(x, w, f"{p}.shared_experts") if c["num_shared_experts"] else out


def _naive_attention(x: torch.Tensor, w: dict, p: str, c: dict, mask: torch.Tensor
                     ) -> torch.Tensor:
    seq, heads, d = x.shape[0], c["num_attention_heads"], c["head_dim"]
    kvh = c["num_key_value_heads"]
    eps, pos = c["rms_norm_eps"], torch.arange(seq)
    qkv = x @ w[f"{p}.query_key_value.weight"].T + w.get(f"{p}.query_key_value.bias", 0.0)
    qkv = qkv.view(seq, heads + 2 * kvh, d)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]
    if c.get("use_qk_norm", True):
        q = _rms(q, w[f"{p}.query_layernorm.weight"], eps)
        k = _rms(k, w[f"{p}.key_layernorm.weight"], eps)
    rd = int(d * c["partial_rotary_factor"])
    q, k = _rope(q, pos, rd, c["rope_theta"]), _rope(k, pos, rd, c["rope_theta"])
    out = torch.zeros(seq, heads, d)
    for h in range(heads):
        g = h // (heads // kvh)
        att = (q[:, h] @ k[:, g].T) / math.sqrt(d) + mask
        out[:, h] = att.softmax(-1) @ v[:, g]
    return out.reshape(seq, heads * d) @ w[f"{p}.dense.weight"].T + w.get(f"{p}.dense.bias", 0.0)


def naive_llada2_logits(model_dir: Path, ids: list[int], block: int) -> torch.Tensor:
    """Full-sequence HF-style forward in fp32 -> logits (L, vocab)."""
    c = json.loads((model_dir / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    seq, nb = len(ids), -(-len(ids) // block)
    allowed = torch.tril(torch.ones(nb, nb)).repeat_interleave(block, 0).repeat_interleave(block, 1)
    mask = allowed[:seq, :seq].log()  # 0 where allowed, -inf elsewhere
    x = w["model.word_embeddings.weight"][torch.tensor(ids)]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        x = x + _naive_attention(_rms(x, w[f"{p}.input_layernorm.weight"], c["rms_norm_eps"]),
                                 w, f"{p}.attention", c, mask)
        h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], c["rms_norm_eps"])
        dense = layer < c["first_k_dense_replace"]
        x = x + (_swiglu(h, w, f"{p}.mlp") if dense else _naive_moe(h, w, f"{p}.mlp", c))
    head = w["model.word_embeddings.weight" if c["tie_word_embeddings"] else "lm_head.weight"]
    return _rms(x, w["model.norm.weight"], c["rms_norm_eps"]) @ head.T
