"""The Triton expert sort (kernels/moe_sort.py) equals the torch oracle `align_by_expert`
exactly on both of its paths (one launch for few assignments, five for many): slots, block
experts, slots in use; random and skewed routings, one token and many, chunks past the first,
empty experts, runs that need no padding and runs that are all padding, the one-launch bound's
edges. Small shapes in the interpreter; `gpu`: LLaDA2.0-mini."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.kernels import moe_sort
from dllm_serve.kernels.moe_align import align_by_expert, choose_block_m
from dllm_serve.kernels.moe_sort import one_program, sort_by_expert

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FIVE_KERNELS = ("_count_kernel", "_prefix_kernel", "_starts_kernel", "_scatter_kernel",
                "_blocks_kernel")


class NotLaunched:
    """Stands in for a kernel the path under test must not launch."""

    def __getitem__(self, grid: object) -> None:
        raise AssertionError("this sort path launched a kernel of the other path")


def force_path(monkeypatch: pytest.MonkeyPatch, one: bool) -> None:
    """Make sort_by_expert take one path whatever the size; the other's kernels fail."""
    monkeypatch.setattr(moe_sort, "ONE_PROGRAM_PAIRS", 1 << 60 if one else -1)
    for name in FIVE_KERNELS if one else ("_one_program_kernel",):
        monkeypatch.setattr(moe_sort, name, NotLaunched())


def check(ids: torch.Tensor, experts: int) -> None:
    block_m = choose_block_m(ids.numel(), experts)
    ref = align_by_expert(ids, experts, block_m)
    out = sort_by_expert(ids, experts, block_m)
    assert out.block_m == ref.block_m
    torch.testing.assert_close(out.num_slots, ref.num_slots, rtol=0, atol=0)
    torch.testing.assert_close(out.block_expert, ref.block_expert, rtol=0, atol=0)
    torch.testing.assert_close(out.sorted_rows, ref.sorted_rows, rtol=0, atol=0)


def top_k(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices.to(DEVICE)


def each_expert(experts: int, times: int) -> torch.Tensor:
    """(experts * times, 1): every expert `times` times, shuffled."""
    gen = torch.Generator().manual_seed(experts + times)
    ids = torch.arange(experts).repeat(times)
    return ids[torch.randperm(ids.numel(), generator=gen)].view(-1, 1).to(DEVICE)


CASES = {  # name: (topk_ids (T, K), experts)
    "one token": lambda: (top_k(1, 32, 2, seed=1), 32),
    "37 tokens": lambda: (top_k(37, 8, 4, seed=37), 8),
    "chunks past the first": lambda: (top_k(300, 64, 2, seed=300), 64),
    "B=1 LLaDA2.0-mini": lambda: (top_k(32, 256, 8, seed=32), 256),
    "skewed, empty experts": lambda: (torch.randint(0, 3, (90, 2), generator=torch.Generator()
                                                    .manual_seed(1)).to(DEVICE) * 7, 32),
    "one expert takes all": lambda: (torch.full((70, 1), 5, device=DEVICE), 16),
    "every run one slot and padding": lambda: (each_expert(64, 1), 64),  # every block used
    "no run needs padding": lambda: (each_expert(8, 16), 8),  # 16 = block_m: whole blocks
    "no assignments": lambda: (torch.zeros(0, 8, dtype=torch.int64, device=DEVICE), 8),
}


@pytest.mark.parametrize("one", [True, False], ids=["one launch", "five launches"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_path_equals_torch_align(case: str, one: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    force_path(monkeypatch, one)
    check(*CASES[case]())


@pytest.mark.parametrize("tokens,k,experts,one", [
    (128, 8, 256, True), (205, 5, 256, False),  # A = 1024 and 1025 with 256 experts
    (1024, 2, 8, True), (683, 3, 8, False),  # A = 2048 and 2049 with 8 (< CHUNK) experts
])
def test_the_one_launch_bound_at_its_edges(tokens: int, k: int, experts: int, one: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A * max(E, CHUNK) <= ONE_PROGRAM_PAIRS takes one launch, one more assignment five;
    both equal the oracle there (block_m 16 and 64)."""
    assert one_program(tokens * k, experts) == one
    for name in FIVE_KERNELS if one else ("_one_program_kernel",):
        monkeypatch.setattr(moe_sort, name, NotLaunched())
    check(top_k(tokens, experts, k, seed=tokens), experts)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 128, 129, 512, 2048, 4096])
def test_llada2_mini_shapes(tokens: int) -> None:
    check(top_k(tokens, 256, 8, seed=tokens), 256)
