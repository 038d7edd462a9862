"""Sampling for temperature > 0: the Gumbel-max rule, seeded per request, block and step.

The logit filters are pure functions of a (..., V) logits tensor: `nucleus` (top_p), `top_k`,
`min_p`. (min_new_tokens masks nothing: an early EOS or stop token stays in the output as an
ordinary token, managers/finish.py.)
"""

from __future__ import annotations

from typing import Any

import torch

from dllm_serve.dllm.batch import DenoiseBatch


def sample_rows(batch: DenoiseBatch, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """logits (N, K, V), x (N, K) greedy picks -> x with sampled picks on rows whose request
    has temperature > 0. The noise depends only on (seed, block position, block step), so a
    request samples the same tokens whatever else shares its batch."""
    reqs, starts = batch.row_requests(), batch.block_starts()
    for i, b in enumerate(reqs):
        t = batch.temperatures[b]
        if t <= 0:
            continue
        gen = torch.Generator(device=logits.device)
        key = (batch.seeds[b], starts[i], int(batch.block_steps[i]))
        gen.manual_seed(hash(key) & (2**63 - 1))
        scaled = filter_logits(logits[i] / t, batch.top_ps[b], _at(batch.top_ks, b, -1),
                               _at(batch.min_ps, b, 0.0))
        u = torch.rand(scaled.shape, generator=gen, device=logits.device).clamp_(1e-20, 1.0)
        x[i] = (scaled - torch.log(-torch.log(u))).argmax(-1)
    return x


def _at(values: list[Any], b: int, off: Any) -> Any:
    """values[b], or `off` when the batch carries no values (the filter is off for all)."""
    return values[b] if values else off


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int, min_p: float,
                  ) -> torch.Tensor:
    """top_k, then min_p, then top_p (SGLang's order); each keeps the most likely token."""
    return nucleus(min_p_filter(top_k_filter(logits, top_k), min_p), top_p)


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the smallest set whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    drop[..., 0] = False  # the most likely token is always kept (a top_p under fp32's least
    sorted_logits[drop] = float("-inf")  # positive value compares as 0 and would drop it)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k largest logits of each row (ties at the k-th value kept too); -1 or a
    k of at least V keeps all."""
    if top_k < 0 or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    floor = probs.amax(-1, keepdim=True) * min_p
    return logits.masked_fill(probs < floor, float("-inf"))
