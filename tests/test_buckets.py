"""The bucket tables (model/buckets.py) hold every forward the scheduler can produce: every
whole-block prefill up to the chunked-prefill budget, the prefills a real scheduler cuts from
random prompt lengths, and every denoise batch up to the worker's row storage. Since the
warm-up compiles exactly these buckets, no shape is left to compile while serving."""

from __future__ import annotations

import numpy as np
import pytest
from local_engine import scripted_engine

from dllm_serve.managers.messages import Prefill
from dllm_serve.model.buckets import (
    denoise_buckets,
    pick_bucket,
    prefill_buckets,
    prefill_budget,
)


def test_prefill_bucket_table() -> None:
    """Powers of two up to 256 tokens, then steps of 256, in whole blocks."""
    assert [b * 32 for b in prefill_buckets(32, 4096)] == [
        32, 64, 128, 256, *range(512, 4096 + 1, 256)]
    assert [b * 4 for b in prefill_buckets(4, 1024)] == [4, 8, 16, 32, 64, 128, 256, 512, 768,
                                                         1024]
    assert prefill_buckets(32, 32) == [1] and prefill_buckets(32, 96) == [1, 2, 3]
    assert prefill_budget(4096, 32) == 4096 and prefill_budget(100, 32) == 96
    assert prefill_budget(1, 32) == 32  # at least one block


@pytest.mark.parametrize("k", [4, 32])
@pytest.mark.parametrize("chunk", [1, 33, 100, 256, 257, 1000, 4096, 8192])
def test_prefill_buckets_hold_every_token_count(k: int, chunk: int) -> None:
    budget = prefill_budget(chunk, k)
    buckets = prefill_buckets(k, budget)
    assert buckets == sorted(set(buckets)) and buckets[-1] * k == budget
    for tokens in range(k, budget + 1, k):
        bucket = pick_bucket(tokens // k, buckets)
        assert bucket is not None, f"{tokens} tokens have no bucket"
        padded = bucket * k
        assert tokens <= padded  # and the padding stays bounded:
        assert padded <= (max(2 * tokens, k) if tokens <= 256 else tokens + 256 + k)


@pytest.mark.parametrize("max_blocks", [1, 7, 32, 64, 100, 256, 257, 512])
def test_denoise_buckets_hold_every_batch(max_blocks: int) -> None:
    buckets = denoise_buckets(max_blocks)
    assert buckets[-1] == max_blocks
    for n in range(1, max_blocks + 1):
        bucket = pick_bucket(n, buckets)
        assert bucket is not None and n <= bucket <= max(2 * n, n + 64)


@pytest.mark.parametrize("chunk,wavefront", [(4, 1), (10, 2), (64, 2), (300, 1)])
def test_scheduler_forwards_fit_the_buckets(chunk: int, wavefront: int) -> None:
    """A real scheduler and worker (a scripted algorithm, no model) serving random prompt
    lengths: every prefill it sends and every denoise batch it runs has a bucket."""
    k, mrr = 4, 6
    e = scripted_engine(k=k, mrr=mrr, pages=4000, prefill=chunk, wavefront=wavefront)
    rng = np.random.default_rng(chunk)
    for i, n in enumerate(rng.integers(1, 600, 20).tolist()):
        # random ids: prompts that shared a prefix would be prefilled once (the prefix cache)
        e.submit(str(i), rng.integers(1, 1000, n).tolist(), max_new_tokens=int(rng.integers(1, 40)),
                 ignore_eos=True)
    e.run()
    prefills = [x for x in e.sent if isinstance(x, Prefill)]
    assert len(prefills) >= 20
    budget = prefill_budget(chunk, k)
    pre = prefill_buckets(k, budget)
    for p in prefills:
        tokens = sum(len(t) for t in p.token_ids)
        assert tokens % k == 0 and all(len(t) % k == 0 for t in p.token_ids)
        assert pick_bucket(tokens // k, pre) is not None, f"prefill of {tokens} tokens"
    rows = e.worker.storage.capacity
    den = denoise_buckets(rows)
    log = e.worker.runner.log  # type: ignore[attr-defined]
    batches = [sum(entry[3]) for entry in log if entry[0] == "forward"]
    assert batches and max(batches) <= rows
    assert all(pick_bucket(n, den) is not None for n in batches)
