"""The logit filters of dllm/sampling.py against plain per-row references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.sampling import (
    filter_logits,
    min_p_filter,
    nucleus,
    sample_rows,
    top_k_filter,
)
from dllm_serve.managers.messages import Admit

NEG = float("-inf")


def logits(rows: int = 6, vocab: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def top_k_reference(row: list[float], k: int) -> list[float]:
    if k < 0 or k >= len(row):
        return row
    kth = sorted(row, reverse=True)[k - 1]
    return [x if x >= kth else NEG for x in row]


def min_p_reference(row: list[float], p: float) -> list[float]:
    if p <= 0:
        return row
    z = sum(math.exp(x) for x in row)
    probs = [math.exp(x) / z for x in row]
    return [x if q >= p * max(probs) else NEG for x, q in zip(row, probs, strict=True)]


@pytest.mark.parametrize("k", [-1, 1, 2, 5, 10, 11, 50])
def test_top_k_matches_reference(k: int) -> None:
    x = logits()
    got = top_k_filter(x, k)
    for row, out in zip(x.tolist(), got.tolist(), strict=True):
        assert out == pytest.approx(top_k_reference(row, k))
    assert (got > NEG).sum(-1).min() >= 1


def test_top_k_keeps_ties() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert top_k_filter(x, 1).tolist() == [[NEG, 3.0, 3.0, NEG]]


@pytest.mark.parametrize("p", [0.0, 1e-9, 0.05, 0.3, 0.9, 1.0])
def test_min_p_matches_reference(p: float) -> None:
    x = logits(seed=1)
    got = min_p_filter(x, p)
    for row, out in zip(x.tolist(), got.tolist(), strict=True):
        assert out == pytest.approx(min_p_reference(row, p), rel=1e-5)
    assert bool((got.argmax(-1) == x.argmax(-1)).all())  # the most likely token stays


def test_filters_keep_the_most_likely_token_and_commute_with_greedy() -> None:
    x = logits(rows=20, vocab=50, seed=2)
    out = filter_logits(x, top_p=1e-9, top_k=1, min_p=1.0)
    assert bool((out.argmax(-1) == x.argmax(-1)).all())
    assert bool(((out > NEG).sum(-1) >= 1).all())
    assert torch.equal(filter_logits(x, 1.0, -1, 0.0), x)  # all off: unchanged
    both = filter_logits(x, 0.8, 5, 0.1)
    assert torch.equal(both, nucleus(min_p_filter(top_k_filter(x, 5), 0.1), 0.8))


@pytest.mark.parametrize("p", [5e-324, 1e-46, 1e-40])
def test_a_top_p_below_fp32s_least_value_keeps_the_most_likely_token(p: float) -> None:
    """A top_p the API accepts (any p > 0) that float32 rounds to 0 still keeps the top token
    (it once dropped every token, and the argmax of an all -inf row sampled token 0)."""
    x = logits(rows=8, vocab=50, seed=4)
    out = nucleus(x, p)
    assert torch.equal(out.argmax(-1), x.argmax(-1))
    assert ((out > NEG).sum(-1) == 1).all()


def _batch(n: int, k: int, temperature: float, **per_request: list) -> DenoiseBatch:
    return DenoiseBatch(
        block_ids=torch.zeros(n, k, dtype=torch.int64), num_blocks=[1] * n,
        first_starts=[0] * n, temperatures=[temperature] * n,
        top_ps=[1.0] * n, seeds=list(range(n)), params={},
        block_steps=np.zeros(n, dtype=np.int64), **per_request)


def test_sample_rows_applies_each_requests_top_k_and_min_p() -> None:
    """The per-request lists reach the filters: top_k 1 or min_p 1 sample the greedy token."""
    x = logits(rows=4 * 8, vocab=50, seed=3).view(4, 8, 50)
    greedy = x.argmax(-1)
    hot = sample_rows(_batch(4, 8, 5.0), x, greedy.clone())
    assert not torch.equal(hot, greedy)  # at temperature 5 sampling differs somewhere
    picked = sample_rows(_batch(4, 8, 5.0, top_ks=[1, -1, -1, 1], min_ps=[0.0, 1.0, 0.0, 0.0]),
                         x, greedy.clone())
    assert torch.equal(picked[[0, 1, 3]], greedy[[0, 1, 3]])


def test_the_scheduler_sends_top_k_and_min_p_per_request() -> None:
    from local_engine import scripted_engine

    e = scripted_engine()
    e.submit("a", [1, 2], max_new_tokens=4, top_k=3, min_p=0.25, temperature=1.0)
    e.submit("b", [1, 2], max_new_tokens=4)
    e.run()
    settings = {x.uid: x.settings for x in e.sent if isinstance(x, Admit)}
    assert [(s.top_k, s.min_p) for _, s in sorted(settings.items())] == [(3, 0.25), (-1, 0.0)]
