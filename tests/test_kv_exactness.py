"""The KV the engine caches for committed blocks equals a plain full-sequence forward of the same
tokens under the block-causal mask (fp32, CPU), for both algorithms and both modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batch_helpers import Segment, make_batch, make_cache
from local_engine import local_engine

from dllm_serve.model.runner import ModelRunner


def reference_kv(runner: ModelRunner, tokens: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """K/V of every layer from one forward of all tokens as a single block-causal segment."""
    model = runner.model
    kv, attn = make_cache(model.kv_spec(), 1, len(tokens), runner.page_size)
    fb = make_batch([Segment(0, 0, tokens)], kv, attn, runner.block_size)
    with torch.inference_mode():
        model(fb)
    slots = kv.slots(torch.zeros(len(tokens), dtype=torch.int64), torch.arange(len(tokens)))
    return [(kv.k[i][slots], kv.v[i][slots]) for i in range(len(kv.k))]


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
@pytest.mark.parametrize("fdfo", [True, False])
def test_committed_kv_equals_full_recomputation(tiny_model_dir: Path, algorithm: str,
                                                fdfo: bool) -> None:
    engine = local_engine(tiny_model_dir, algorithm, fdfo)
    sched, runner = engine.sched, engine.worker.runner
    assert isinstance(runner, ModelRunner)
    prompts = {"a": list(range(3, 3 + 75)), "b": list(range(40, 40 + 9))}
    for rid, ids in prompts.items():
        engine.submit(rid, ids, max_new_tokens=200, ignore_eos=True)
    while min((r.blocks for r in sched.running.values()), default=0) < 3:
        engine.step()
    for req in sched.running.values():
        n = req.committed_len
        tokens = (list(req.input_ids) + req.output_ids)[:n]
        slots = runner.kv.slots(torch.full((n,), req.holding.slot), torch.arange(n))
        for layer, (k_ref, v_ref) in enumerate(reference_kv(runner, tokens)):
            torch.testing.assert_close(runner.kv.k[layer][slots], k_ref, atol=2e-5, rtol=1e-4,
                                       msg=f"K of layer {layer}, request {req.rid}")
            torch.testing.assert_close(runner.kv.v[layer][slots], v_ref, atol=2e-5, rtol=1e-4,
                                       msg=f"V of layer {layer}, request {req.rid}")
