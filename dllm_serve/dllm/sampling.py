"""Sampling for temperature > 0: the Gumbel-max rule, seeded per request, block and step."""

from __future__ import annotations

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
        scaled = nucleus(logits[i] / t, batch.top_ps[b])
        u = torch.rand(scaled.shape, generator=gen, device=logits.device).clamp_(1e-20, 1.0)
        x[i] = (scaled - torch.log(-torch.log(u))).argmax(-1)
    return x


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the smallest set whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p  # the most likely token is always kept
    sorted_logits[drop] = float("-inf")
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
