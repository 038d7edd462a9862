"""The Triton expert sort (kernels/moe_sort.py) equals the torch oracle `align_by_expert`
exactly: slots, block experts, slots in use; random and skewed routings, one token and many,
chunks past the first, empty experts. Small shapes in the interpreter; `gpu`: LLaDA2.0-mini."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.kernels.moe_align import align_by_expert, choose_block_m
from dllm_serve.kernels.moe_sort import sort_by_expert

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check(ids: torch.Tensor, experts: int) -> None:
    block_m = choose_block_m(ids.numel(), experts)
    ref = align_by_expert(ids, experts, block_m)
    out = sort_by_expert(ids, experts, block_m)
    assert out.block_m == ref.block_m
    torch.testing.assert_close(out.num_slots, ref.num_slots, rtol=0, atol=0)
    torch.testing.assert_close(out.block_expert, ref.block_expert, rtol=0, atol=0)
    torch.testing.assert_close(out.sorted_rows, ref.sorted_rows, rtol=0, atol=0)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 32, 2), (37, 8, 4), (300, 64, 2)])
def test_equals_torch_align(tokens: int, experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    scores = torch.rand(tokens, experts, generator=gen)
    check(scores.topk(top_k, dim=1).indices.to(DEVICE), experts)


@pytest.mark.parametrize("chunks", ["one", "bound", "past the bound", "many"])
def test_fused_count_and_separate_launches(chunks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways to the counts' prefix (one launch up to FUSED_CHUNKS chunks, two past it) at
    chunk counts on either side of the bound (top-8: CHUNK / 8 tokens a chunk)."""
    from dllm_serve.kernels import moe_sort

    per_chunk = moe_sort.CHUNK // 8
    tokens = {"one": 1, "bound": moe_sort.FUSED_CHUNKS * per_chunk,
              "past the bound": moe_sort.FUSED_CHUNKS * per_chunk + 1,
              "many": 4 * moe_sort.FUSED_CHUNKS * per_chunk + 3}[chunks]
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, 64, generator=gen).topk(8, dim=1).indices.to(DEVICE)
    check(ids, 64)
    monkeypatch.setattr(moe_sort, "FUSED_CHUNKS", 0)  # always the two launches
    check(ids, 64)


def test_skewed_routing_with_empty_experts() -> None:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 3, (90, 2), generator=gen) * 7  # experts 0, 7, 14 of 32 only
    check(ids.to(DEVICE), 32)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 512, 2048, 4096])
def test_llada2_mini_shapes(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    scores = torch.rand(tokens, 256, generator=gen)
    check(scores.topk(8, dim=1).indices.to(DEVICE), 256)
