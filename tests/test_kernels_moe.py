"""Fused MoE kernels equal the PyTorch oracles: `route` (device routing), the expert sort,
and the grouped GEMMs against `moe_reference`; `set_moe_backend` switches a model's experts."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.kernels.fused_moe import down_proj, expert_blocks, fused_experts, triton_moe
from dllm_serve.kernels.moe_align import DIRECT_MAX_TOKENS, align_by_expert, choose_block_m
from dllm_serve.kernels.moe_launch import MOE_LAUNCHES, MoeLaunch, choose_moe_launches
from dllm_serve.kernels.moe_route import fused_route
from dllm_serve.kernels.moe_sum import sum_choices
from dllm_serve.kernels.norm import fused_rms_norm
from dllm_serve.layers.mlp import swiglu
from dllm_serve.layers.moe import (
    MOE_BACKENDS,
    Experts,
    SparseMoeBlock,
    add_in_order,
    moe_reference,
    set_moe_backend,
    torch_moe,
)
from dllm_serve.layers.moe_router import Router, RoutingParams, route, split_bf16, sum_logit_parts
from dllm_serve.layers.norm import RMSNorm, rms_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LLADA2 = RoutingParams(top_k=8, score_function="sigmoid", n_group=8, topk_group=4,
                       renormalize=True, scaling=2.5)
ROUTINGS = {
    "tiny": (8, RoutingParams(2, "sigmoid", 4, 2, True, 2.5)),
    "groups": (32, RoutingParams(4, "sigmoid", 4, 2, True, 2.5)),
    "softmax": (16, RoutingParams(3, "softmax", 0, 0, False, 1.0)),
    # Qwen3-MoE / SDAR-30B-A3B: softmax over 128 experts, top-8, renormalised
    "qwen3-moe": (128, RoutingParams(8, "softmax", 0, 0, True, 1.0)),
}


def rand(*shape: int, gen: torch.Generator, scale: float = 1.0,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def assert_same_routing(ids: torch.Tensor, weights: torch.Tensor, ref_ids: torch.Tensor,
                        ref_weights: torch.Tensor) -> None:
    """Same experts in the same order, same weights. On the GPU the kernel's sigmoid may round
    differently from torch's, which can flip a near-tie: up to 1 token in 200 may differ."""
    same = (ids == ref_ids).all(1)
    allowed = 0 if DEVICE.type == "cpu" else 1 + ids.shape[0] // 200
    assert int((~same).sum()) <= allowed, f"{int((~same).sum())} tokens routed differently"
    torch.testing.assert_close(weights[same], ref_weights[same], rtol=1e-5, atol=1e-6)


def tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-5 if DEVICE.type == "cpu" else 5e-3  # tf32 dots on the GPU
    return 2e-2


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_route_equals_reference(name: str, bias_dtype: torch.dtype) -> None:
    """The expert bias in the model's dtype (bf16 on the GPU) is read as it is and widened in
    the kernel, as the reference widens it."""
    experts, p = ROUTINGS[name]
    gen = torch.Generator().manual_seed(0)
    logits = rand(41, experts, gen=gen, scale=2.0)
    bias = (rand(experts, gen=gen, scale=0.1, dtype=bias_dtype)
            if p.score_function == "sigmoid" else None)
    assert_same_routing(*fused_route(logits, bias, p), *route(logits, bias, p))


def split_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """(T, 3, E) fp32: bf16 activations against the three bf16 parts of an fp32 router weight,
    as the Router's split GEMM makes them (largest part first)."""
    x = rand(tokens, 64, gen=gen).bfloat16().float()
    parts = split_bf16(torch.randn(experts, 64, generator=gen) * 0.3).float().to(DEVICE)
    return torch.stack([x @ part.t() for part in parts], dim=1)


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_route_sums_partial_logits_as_torch_does(name: str) -> None:
    """fused_route of the Router's three partial logits (T, 3, E) equals fused_route of their
    torch sum bit for bit (the kernel adds them in fp32 in part order, as torch's sum over
    the parts does), and the oracle `route` of that sum."""
    experts, p = ROUTINGS[name]
    gen = torch.Generator().manual_seed(1)
    parts = split_logits(45, experts, gen)
    bias = rand(experts, gen=gen, scale=0.1) if p.score_function == "sigmoid" else None
    ids, weights = fused_route(parts, bias, p)
    summed = sum_logit_parts(parts)
    assert torch.equal(summed, parts.sum(1))
    sum_ids, sum_weights = fused_route(summed, bias, p)
    assert torch.equal(ids, sum_ids) and torch.equal(weights, sum_weights)
    assert_same_routing(ids, weights, *route(summed, bias, p))


def test_route_reads_strided_token_rows() -> None:
    """Partial logits that are a column slice of a wider GEMM output (token rows strided)
    route as their contiguous copy does."""
    experts, p = ROUTINGS["groups"]
    gen = torch.Generator().manual_seed(6)
    parts = split_logits(13, experts, gen)  # (T, 3, E)
    bias = rand(experts, gen=gen, scale=0.1)
    wide = rand(13, 3 * experts + 40, gen=gen)
    wide[:, :3 * experts] = parts.flatten(1)
    view = wide[:, :3 * experts].view(13, 3, experts)
    assert view.stride(0) == 3 * experts + 40
    ids, weights = fused_route(view, bias, p)
    ref_ids, ref_weights = fused_route(parts, bias, p)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_route_takes_one_part_in_any_dtype_and_refuses_bf16_parts() -> None:
    """One part (T, 1, E) is the logits themselves (bf16 ones are widened in the kernel, as
    `route` widens them); several parts must be fp32 (torch would round each bf16 sum)."""
    experts, p = ROUTINGS["groups"]
    gen = torch.Generator().manual_seed(2)
    logits = rand(9, experts, gen=gen, dtype=torch.bfloat16)
    ids, weights = fused_route(logits[:, None], None, p)
    assert torch.equal(sum_logit_parts(logits[:, None]), logits)
    assert_same_routing(ids, weights, *route(logits, None, p))
    with pytest.raises(ValueError, match="must be fp32"):
        fused_route(torch.stack([logits, logits], dim=1), None, p)


def test_backends_take_partial_logits() -> None:
    """triton_moe routes the partial logits in its kernel, torch_moe sums them first: the
    same experts and weights, so the same output within the experts' rounding."""
    experts, p = ROUTINGS["groups"]
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, _, _ = experts_case(21, experts, 48, 32, top_k=p.top_k)
    parts = split_logits(21, experts, gen)
    bias = rand(experts, gen=gen, scale=0.1)
    ref = torch_moe(x, parts, bias, p, w13, w2)
    assert torch.equal(ref, torch_moe(x, sum_logit_parts(parts), bias, p, w13, w2))
    assert rel_err(triton_moe(x, parts, bias, p, w13, w2), ref) < tolerance(torch.float32)


def test_router_hands_on_its_logits_as_parts() -> None:
    """Off the split GEMM (here: the CPU, or bf16 logits) the Router's logits are one part
    (T, 1, E); summed, they are the fp32 GEMM's logits."""
    gen = torch.Generator().manual_seed(4)
    router = Router(32, 16, expert_bias=False, fp32_logits=True).to(DEVICE)
    with torch.no_grad():
        router.weight.copy_(rand(16, 32, gen=gen))
    x = rand(7, 32, gen=gen)
    parts = router(x)
    assert parts.shape == (7, 1, 16) and parts.dtype == torch.float32
    assert torch.equal(sum_logit_parts(parts), torch.nn.functional.linear(x, router.weight))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 8, 2), (50, 4, 3)])
def test_align_sorts_every_assignment_into_one_expert_block(tokens: int, experts: int,
                                                            top_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(DEVICE)
    block_m = choose_block_m(tokens * top_k, experts)
    blocks = align_by_expert(ids, experts, block_m)
    rows, used = blocks.sorted_rows.cpu(), int(blocks.num_slots.item())
    assert used % block_m == 0 and (rows[used:] == tokens * top_k).all()
    real = rows[rows < tokens * top_k]
    assert sorted(real.tolist()) == list(range(tokens * top_k))
    assert real.tolist() == ids.flatten().argsort(stable=True).cpu().tolist()
    flat = ids.flatten().cpu()
    for b, expert in enumerate(blocks.block_expert.cpu().tolist()):
        members = rows[b * block_m:(b + 1) * block_m]
        members = members[members < tokens * top_k]
        assert (expert >= 0) == (b * block_m < used)
        assert (flat[members.long()] == expert).all()


def experts_case(tokens: int, experts: int, hidden: int, inter: int, top_k: int
                 ) -> tuple[torch.Tensor, ...]:
    """x (T, hidden), w13 (E, 2I, hidden), w2 (E, hidden, I), topk ids and weights (T, K)."""
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    x = rand(tokens, hidden, gen=gen)
    w13 = rand(experts, 2 * inter, hidden, gen=gen, scale=hidden ** -0.5)
    w2 = rand(experts, hidden, inter, gen=gen, scale=inter ** -0.5)
    ids, weights = route(rand(tokens, experts, gen=gen), None,
                         RoutingParams(top_k, "softmax", 0, 0, True, 1.5))
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("tokens,experts,hidden,inter", [(1, 8, 64, 32), (37, 8, 64, 32),
                                                         (200, 4, 48, 80), (64, 32, 128, 64)])
def test_fused_experts_equal_reference(tokens: int, experts: int, hidden: int,
                                       inter: int) -> None:
    x, w13, w2, ids, weights = experts_case(tokens, experts, hidden, inter, top_k=2)
    out = fused_experts(x, w13, w2, ids, weights)
    assert out.shape == (tokens, hidden) and out.dtype == x.dtype
    assert rel_err(out, moe_reference(x, w13, w2, ids, weights)) < tolerance(torch.float32)


def shared_case(tokens: int, hidden: int, inter: int) -> tuple[tuple[torch.Tensor, ...],
                                                               torch.Tensor]:
    """A shared expert (gate_up (2I, hidden), down (hidden, I)) and a residual (T, hidden)."""
    gen = torch.Generator().manual_seed(tokens)
    shared = (rand(2 * inter, hidden, gen=gen, scale=hidden ** -0.5),
              rand(hidden, inter, gen=gen, scale=inter ** -0.5))
    return shared, rand(tokens, hidden, gen=gen)


# (tokens, experts, block_m, with the residual): one token; shared blocks past block_m tokens,
# the last one partial; exactly two full shared blocks; 6 experts (the torch sort's path)
@pytest.mark.parametrize("tokens,experts,block_m,residual", [
    (1, 8, None, True), (37, 8, 16, True), (90, 4, 32, True), (32, 8, 16, False),
    (29, 6, 16, True)])
def test_fused_shared_expert_equals_its_own_mlp(tokens: int, experts: int, block_m: int | None,
                                                residual: bool) -> None:
    """A shared expert of the routed width, computed as one more expert (its blocks after the
    routed ones): routed sum + shared (+ residual), as the reference adds them."""
    x, w13, w2, ids, weights = experts_case(tokens, experts, 64, 32, top_k=2)
    shared, res = shared_case(tokens, 64, 32)
    addends = (res,) if residual else ()
    out = fused_experts(x, w13, w2, ids, weights, addends=addends, block_m=block_m,
                        shared=shared)
    ref = add_in_order(moe_reference(x, w13, w2, ids, weights), (swiglu(x, *shared), *addends))
    assert out.shape == (tokens, 64)
    assert rel_err(out, ref) < tolerance(torch.float32)


def test_small_batches_skip_the_sort() -> None:
    """Up to DIRECT_MAX_TOKENS tokens (one 32-token block) the experts take the direct layout
    (no sort kernel runs); one token more, or a block_m asked for, sorts."""
    ids = torch.zeros(DIRECT_MAX_TOKENS + 1, 2, dtype=torch.int64, device=DEVICE)
    direct = expert_blocks(ids[:DIRECT_MAX_TOKENS], 8)
    assert direct.direct_top_k == 2 and direct.max_blocks == 8
    assert direct.block_m >= DIRECT_MAX_TOKENS
    assert expert_blocks(ids, 8).direct_top_k == 0
    assert expert_blocks(ids[:4], 8, block_m=16).direct_top_k == 0


# (tokens, experts, top_k): one token; top-3 (a padded choice axis); every expert of 16 chosen
# by some of 32 tokens at top-8 (LLaDA2.0-mini's block and top-k); 6 experts (the torch sort's
# experts count)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (17, 8, 3), (32, 16, 8),
                                                  (30, 6, 2)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_direct_layout_equals_the_sorted_blocks(tokens: int, experts: int, top_k: int,
                                                with_shared: bool) -> None:
    """The direct layout (each expert's rows found in topk_ids by the GEMM programs) gives the
    sorted blocks' output: the reference's within rounding, the shared expert and the addend
    added as the sorted path adds them; experts no token chose write nothing."""
    x, w13, w2, ids, weights = experts_case(tokens, experts, 64, 32, top_k=top_k)
    shared, res = shared_case(tokens, 64, 32)
    kw = dict(shared=shared, addends=(res,)) if with_shared else {}
    direct = fused_experts(x, w13, w2, ids, weights, **kw)
    by_sort = fused_experts(x, w13, w2, ids, weights, block_m=16, **kw)
    ref = moe_reference(x, w13, w2, ids, weights)
    if with_shared:
        ref = add_in_order(ref, (swiglu(x, *shared), res))
    assert rel_err(direct, ref) < tolerance(torch.float32)
    torch.testing.assert_close(direct, by_sort, rtol=1e-5, atol=1e-5)


def test_tokens_past_int32_offsets_run_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """More tokens than the kernels' int32 row offsets can address (here a lowered limit: 7
    tokens a call) run in parts: the same output as one call."""
    import dllm_serve.kernels.fused_moe as fm

    x, w13, w2, ids, weights = experts_case(37, 8, 64, 32, top_k=2)
    shared, res = shared_case(37, 64, 32)
    whole = fused_experts(x, w13, w2, ids, weights, addends=(res,), shared=shared)
    monkeypatch.setattr(fm, "MAX_ELEMENTS", 7 * 3 * 64)
    calls: list[int] = []
    up_proj = fm.up_proj

    def counted(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return up_proj(x, *args, **kwargs)

    monkeypatch.setattr(fm, "up_proj", counted)
    parts = fused_experts(x, w13, w2, ids, weights, addends=(res,), shared=shared)
    assert calls == [7] * 5 + [2]
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)
    norm_weight = torch.ones(64, device=DEVICE)
    out, normed = fused_experts(x, w13, w2, ids, weights, addends=(res,), shared=shared,
                                norm=(norm_weight, 1e-6))
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, rms_norm(out, norm_weight, 1e-6), rtol=1e-5, atol=1e-5)


def test_fused_shared_expert_refuses_what_it_cannot_fuse() -> None:
    """Another width or dtype, two addends beside it (the choice sum takes two), and a down
    projection told nothing of its shared rows: clear errors, before any kernel runs."""
    x, w13, w2, ids, weights = experts_case(5, 8, 64, 32, top_k=2)
    shared, res = shared_case(5, 64, 32)
    with pytest.raises(ValueError, match="routed experts' shapes"):
        fused_experts(x, w13, w2, ids, weights, shared=(shared[0][:32], shared[1][:, :16]))
    with pytest.raises(ValueError, match="torch.float64"):
        fused_experts(x, w13, w2, ids, weights, shared=(shared[0], shared[1].double()))
    with pytest.raises(ValueError, match="at most one addend"):
        fused_experts(x, w13, w2, ids, weights, addends=(res, res), shared=shared)
    blocks = align_by_expert(ids, 8, 16)
    with pytest.raises(ValueError, match="token count"):
        down_proj(x.new_zeros(15, 32), w2, blocks, MOE_LAUNCHES[0][2], shared=shared[1])


@pytest.mark.parametrize("backend", ["torch", "dense", "triton"])
def test_every_backend_adds_the_shared_expert_first(backend: str) -> None:
    """MOE_BACKENDS' contract: routed sum, then the shared expert's output, then the addends."""
    x, w13, w2, _, _ = experts_case(9, 8, 64, 32, top_k=2)
    shared, res = shared_case(9, 64, 32)
    gen = torch.Generator().manual_seed(9)
    logits = rand(9, 8, gen=gen)
    p = RoutingParams(2, "softmax", 0, 0, True, 1.5)
    ids, weights = route(logits, None, p)
    out = MOE_BACKENDS.get(backend)(x, logits, None, p, w13, w2, (res,), shared)
    ref = add_in_order(moe_reference(x, w13, w2, ids, weights), (swiglu(x, *shared), res))
    assert rel_err(out, ref) < tolerance(torch.float32)


TABLE_LAUNCHES = sorted({launch for _, up, down in MOE_LAUNCHES for launch in (up, down)},
                        key=repr)
EDGE_LAUNCHES = [MoeLaunch(32, 32, 4, 2), MoeLaunch(256, 128, 8, 4), MoeLaunch(128, 32, 8, 3),
                 MoeLaunch(32, 32, 4, 2, block_major=True),
                 MoeLaunch(32, 64, 8, 3, block_major=True)]  # 2-3 N tiles a block


@pytest.mark.parametrize("launch", TABLE_LAUNCHES + EDGE_LAUNCHES, ids=repr)
@pytest.mark.parametrize("tokens,experts", [(5, 8), (40, 4), (90, 4)])  # BLOCK_M 16-64
def test_every_launch_equals_reference(launch: MoeLaunch, tokens: int, experts: int) -> None:
    """Each launch in MOE_LAUNCHES (and the tuner's extremes) as both the up and the down
    launch; hidden and inter not multiples of block_n or block_k (masked edges)."""
    x, w13, w2, ids, weights = experts_case(tokens, experts, hidden=80, inter=48, top_k=3)
    out = fused_experts(x, w13, w2, ids, weights, launches=(launch, launch))
    assert rel_err(out, moe_reference(x, w13, w2, ids, weights)) < tolerance(torch.float32)


@pytest.mark.parametrize("block_major", [False, True])
def test_program_order_with_the_shared_expert(block_major: bool) -> None:
    """Either order of the programs (a block's N tiles together, or an N tile's blocks) covers
    every routed and shared block: equal to the reference, and the two orders equal."""
    x, w13, w2, ids, weights = experts_case(90, 4, hidden=80, inter=48, top_k=3)
    shared, res = shared_case(90, 80, 48)
    launch = MoeLaunch(32, 32, 4, 2, block_major=block_major)
    out = fused_experts(x, w13, w2, ids, weights, launches=(launch, launch), addends=(res,),
                        shared=shared, block_m=16)
    ref = add_in_order(moe_reference(x, w13, w2, ids, weights), (swiglu(x, *shared), res))
    assert rel_err(out, ref) < tolerance(torch.float32)
    other = MoeLaunch(32, 32, 4, 2, block_major=not block_major)
    torch.testing.assert_close(out, fused_experts(x, w13, w2, ids, weights,
                                                  launches=(other, other), addends=(res,),
                                                  shared=shared, block_m=16), rtol=0, atol=0)


def test_launch_table_covers_every_size() -> None:
    bounds = [bound for bound, _, _ in MOE_LAUNCHES]
    assert bounds == sorted(bounds) and bounds[-1] >= 1 << 30
    for bound, up, down in MOE_LAUNCHES:
        assert choose_moe_launches(bound) == (up, down)
    assert choose_moe_launches(1) == MOE_LAUNCHES[0][1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 16), (7, 3, 80), (5, 8, 2100)])
def test_sum_choices_equals_torch(tokens: int, top_k: int, hidden: int,
                                  dtype: torch.dtype) -> None:
    """Weighted, summed in fp32 then one cast, as moe_reference combines expert rows of
    `dtype`; 2100 columns span three programs of SUM_BLOCK with a masked tail. Same result on
    a second call."""
    gen = torch.Generator().manual_seed(tokens)
    y = rand(tokens * top_k, hidden, gen=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    out = sum_choices(y, w, dtype)
    ref = (y.view(tokens, top_k, hidden).float() * w[:, :, None]).sum(1).to(dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-6 if dtype == torch.float32 else 8e-3,
                               atol=1e-6 if dtype == torch.float32 else 1e-5)
    assert torch.equal(sum_choices(y, w, dtype), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 2])
def test_sum_choices_adds_the_addends_as_torch_does(count: int, dtype: torch.dtype) -> None:
    """The fused epilogue (a layer's shared experts, then its residual) equals the plain
    sum followed by one PyTorch add per addend, bit for bit: each sum rounded to dtype."""
    gen = torch.Generator().manual_seed(count)
    tokens, top_k, hidden = 6, 4, 2100
    y = rand(tokens * top_k, hidden, gen=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    addends = tuple(rand(tokens, hidden, gen=gen, scale=4.0 ** i).to(dtype)
                    for i in range(count))
    out = sum_choices(y, w, dtype, addends)
    ref = add_in_order(sum_choices(y, w, dtype), addends)
    if dtype == torch.float32 or DEVICE.type == "cuda":
        assert torch.equal(out, ref)
    else:  # Triton's CPU interpreter casts fp32 -> bf16 toward zero (PyTorch and the GPU: to
        # nearest even), one bf16 step per rounded sum at the largest magnitude
        step = 2.0 ** -7 * float(ref.abs().max())
        torch.testing.assert_close(out, ref, rtol=0, atol=count * step)
    with pytest.raises(ValueError, match="at most two"):
        sum_choices(y, w, dtype, addends * 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 2100])  # 2100: one program a row, a masked tail
def test_sum_choices_with_the_next_norm(hidden: int, dtype: torch.dtype) -> None:
    """With a norm the sum is the same bits as without, and the normed rows those of the
    RMSNorm kernel (kernels/norm.py) over it up to the fp32 reduction order of the mean of
    squares (another layout of the row: one rounding step of the output at most); within
    rounding of the oracle."""
    gen = torch.Generator().manual_seed(hidden)
    tokens, top_k = 5, 4
    y = rand(tokens * top_k, hidden, gen=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    addends = (rand(tokens, hidden, gen=gen).to(dtype), rand(tokens, hidden, gen=gen).to(dtype))
    norm_weight = (1 + rand(hidden, gen=gen, scale=0.1)).to(dtype)
    out, normed = sum_choices(y, w, dtype, addends, (norm_weight, 1e-6))
    assert torch.equal(out, sum_choices(y, w, dtype, addends))
    assert normed.dtype == dtype and normed.shape == out.shape
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(normed, fused_rms_norm(out, norm_weight, 1e-6), **tol)
    torch.testing.assert_close(normed.float(), rms_norm(out, norm_weight, 1e-6).float(),
                               rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(ValueError, match="must be"):
        sum_choices(y, w, dtype, addends, (norm_weight[:-1], 1e-6))


def test_no_tokens_with_a_norm() -> None:
    """Zero tokens: both outputs empty, the normed one in sum_choices' dtype (the promotion of
    x's and the norm weight's)."""
    x, w13, w2, ids, weights = experts_case(3, 8, 64, 32, top_k=2)
    x = x.bfloat16()
    out, normed = fused_experts(x[:0], w13.bfloat16(), w2.bfloat16(), ids[:0], weights[:0],
                                norm=(torch.ones(64, device=DEVICE), 1e-6))
    assert out.shape == normed.shape == (0, 64)
    assert out.dtype == torch.bfloat16 and normed.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_block_hands_on_the_next_norm(backend: str) -> None:
    """SparseMoeBlock(x, residual, norm) = (its output, norm(output)): in the Triton experts'
    final pass, or after them; a backend that does not fuse a norm is refused one."""
    gen = torch.Generator().manual_seed(6)
    experts, p = ROUTINGS["tiny"]
    block = SparseMoeBlock(64, experts, 32, p, expert_bias=False, router_fp32=True,
                           shared_intermediate=32).to(DEVICE)
    for param in block.parameters():
        param.data.copy_(rand(*param.shape, gen=gen, scale=0.2))
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    norm.weight.data.copy_(1 + rand(64, gen=gen, scale=0.1))
    x, h = rand(11, 64, gen=gen), rand(11, 64, gen=gen)
    set_moe_backend(block, backend)
    out, normed = block(x, residual=h, norm=norm)
    assert torch.equal(out, block(x, residual=h))
    torch.testing.assert_close(normed, norm(out), rtol=1e-5, atol=1e-5)
    if backend == "torch":
        with pytest.raises(ValueError, match="does not fuse a norm"):
            block.experts(x, block.gate(x), None, p, norm=(norm.weight, norm.eps))


@pytest.mark.parametrize("shared_width", [16, 32])  # 32: the routed width, fused as an expert
def test_moe_block_adds_shared_experts_and_residual_in_the_final_pass(shared_width: int
                                                                      ) -> None:
    """SparseMoeBlock with the Triton backend: experts + shared experts + residual equal the
    torch backend's three separate adds, within the experts' rounding."""
    gen = torch.Generator().manual_seed(5)
    experts, p = ROUTINGS["tiny"]
    block = SparseMoeBlock(64, experts, 32, p, expert_bias=False, router_fp32=True,
                           shared_intermediate=shared_width).to(DEVICE, torch.bfloat16)
    for param in block.parameters():
        param.data.copy_(rand(*param.shape, gen=gen, scale=0.2).to(param.dtype))
    x, h = rand(23, 64, gen=gen, dtype=torch.bfloat16), rand(23, 64, gen=gen, dtype=torch.bfloat16)
    set_moe_backend(block, "torch")
    ref = block(x, residual=h)
    routed = block.experts(x, block.gate(x), block.gate.expert_bias, p)
    assert block.shared_experts is not None
    assert torch.equal(ref, h + (routed + block.shared_experts(x)))  # the unfused formula
    set_moe_backend(block, "triton")
    assert (block._fused_shared() is not None) == (shared_width == 32)
    calls = []
    mlp_forward = block.shared_experts.forward

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return mlp_forward(*args)

    block.shared_experts.forward = counted  # type: ignore[method-assign]
    out = block(x, residual=h)
    assert calls == ([] if shared_width == 32 else [1])  # fused: the MLP never runs alone
    assert rel_err(out, ref) < tolerance(torch.bfloat16)


def test_bf16_storage() -> None:
    gen = torch.Generator().manual_seed(3)
    experts, p = ROUTINGS["tiny"]
    x = rand(29, 64, gen=gen, dtype=torch.bfloat16)
    w13 = rand(experts, 64, 64, gen=gen, scale=0.125, dtype=torch.bfloat16)
    w2 = rand(experts, 64, 32, gen=gen, scale=0.18, dtype=torch.bfloat16)
    logits, bias = rand(29, experts, gen=gen), rand(experts, gen=gen, scale=0.1)
    out = triton_moe(x, logits, bias, p, w13, w2)
    ids, weights = route(logits, bias, p)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, moe_reference(x, w13, w2, ids, weights)) < tolerance(torch.bfloat16)


def test_set_moe_backend_switches_experts() -> None:
    gen = torch.Generator().manual_seed(4)
    experts, p = ROUTINGS["groups"]
    module = Experts(experts, 32, 16).to(DEVICE)
    with torch.no_grad():
        module.w13.copy_(rand(experts, 32, 32, gen=gen, scale=0.2))
        module.w2.copy_(rand(experts, 32, 16, gen=gen, scale=0.25))
    x, logits = rand(9, 32, gen=gen), rand(9, experts, gen=gen)
    with torch.no_grad():
        ref = module(x, logits, None, p)
        set_moe_backend(module, "triton")
        assert module.backend == "triton"
        assert rel_err(module(x, logits, None, p), ref) < tolerance(torch.float32)
    with pytest.raises(KeyError, match="known: dense, torch, triton"):
        set_moe_backend(module, "cutlass")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 512, 2048])
def test_llada2_mini_moe_layer(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = rand(tokens, 2048, gen=gen, dtype=torch.bfloat16)
    w13 = rand(256, 1024, 2048, gen=gen, scale=0.02, dtype=torch.bfloat16)
    w2 = rand(256, 2048, 512, gen=gen, scale=0.02, dtype=torch.bfloat16)
    logits, bias = rand(tokens, 256, gen=gen), rand(256, gen=gen, scale=0.1)
    ids, weights = route(logits, bias, LLADA2)
    assert_same_routing(*fused_route(logits, bias, LLADA2), ids, weights)
    out = fused_experts(x, w13, w2, ids, weights)
    assert rel_err(out, moe_reference(x, w13, w2, ids, weights)) < 2e-2


def test_a_launch_too_big_for_the_device_falls_back_to_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """_run_fitting: a compile failure for lack of shared memory (raised before anything runs)
    reruns with DEFAULT_LAUNCH and is remembered; any other launch error propagates."""
    from triton.runtime.errors import OutOfResources

    from dllm_serve.kernels import launch_fit
    from dllm_serve.kernels.fused_moe import _run_fitting, fell_back
    from dllm_serve.kernels.moe_launch import DEFAULT_LAUNCH, MoeLaunch

    big = MoeLaunch(block_n=256, block_k=256, num_warps=8, num_stages=5)
    ran: list[MoeLaunch] = []

    def go(launch: MoeLaunch) -> None:
        if launch == big:
            raise OutOfResources(300_000, 232_448, "shared memory")
        ran.append(launch)

    monkeypatch.setattr(launch_fit, "_TOO_BIG", set())  # this test's failures only
    assert not fell_back("up", 64, big)
    _run_fitting("up", 64, big, go)
    _run_fitting("up", 64, big, go)  # remembered: straight to the default
    assert ran == [DEFAULT_LAUNCH, DEFAULT_LAUNCH] and fell_back("up", 64, big)
    assert not fell_back("down", 64, big) and not fell_back("up", 32, big)

    def broken(launch: MoeLaunch) -> None:
        raise ValueError("not a resource problem")

    with pytest.raises(ValueError):
        _run_fitting("down", 16, big, broken)


def test_bf16_split_of_an_fp32_weight_sums_back_to_it() -> None:
    """split_bf16: three bf16 parts whose fp32 sum is the weight to its last bit, so bf16
    GEMMs with fp32 output against them give the fp32 router logits (up to summation order)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 1, 96)
    parts = split_bf16(w)
    assert parts.shape == (3, 64, 96) and parts.dtype == torch.bfloat16
    back = parts[0].float() + parts[1].float() + parts[2].float()
    assert torch.allclose(back, w, rtol=2 ** -22, atol=0)
    x = torch.randn(17, 96, generator=gen).bfloat16()
    logits = sum(x.double() @ p.double().t() for p in parts)  # what the bf16 GEMMs sum to
    assert torch.allclose(logits.float(), x.float() @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 512, 2048])
def test_llada2_mini_moe_block_fuses_its_shared_expert(tokens: int) -> None:
    """LLaDA2.0-mini's MoE layer (256 experts, one shared expert of the routed width) with the
    Triton backend computes the shared expert among the routed ones: within bf16 rounding of
    the torch backend's routed sum + shared MLP + residual."""
    gen = torch.Generator().manual_seed(tokens)
    block = SparseMoeBlock(2048, 256, 512, LLADA2, expert_bias=True, router_fp32=True,
                           shared_intermediate=512).to(DEVICE)
    for param in block.parameters():
        param.data.copy_(rand(*param.shape, gen=gen, scale=0.02))
    block.experts.to(torch.bfloat16)
    block.shared_experts.to(torch.bfloat16)
    x = rand(tokens, 2048, gen=gen, dtype=torch.bfloat16)
    h = rand(tokens, 2048, gen=gen, dtype=torch.bfloat16)
    ref = block(x, residual=h)
    set_moe_backend(block, "triton")
    assert rel_err(block(x, residual=h), ref) < tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_router_split_gemm_equals_fp32_logits_and_routing() -> None:
    """On CUDA the fp32 router of bf16 activations runs the split GEMM: three partial logits
    whose sum is the fp32 GEMM's logits within fp32 rounding, the same experts chosen
    (LLaDA2.0-mini's router shape); fused_route sums the parts in its kernel bit for bit as
    torch's CUDA sum does."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    router = Router(2048, 256, expert_bias=True, fp32_logits=True).cuda()
    with torch.no_grad():
        router.weight.copy_(torch.randn(256, 2048, device="cuda", generator=gen) * 0.02)
    x = torch.randn(512, 2048, device="cuda", generator=gen).bfloat16()
    parts = router(x)
    assert router.split_gemm, "this torch lacks torch.mm(..., out_dtype=torch.float32)"
    assert parts.shape == (512, 3, 256)
    got = sum_logit_parts(parts)
    want = torch.nn.functional.linear(x.float(), router.weight.float())
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    p = RoutingParams(8, "sigmoid", 8, 4, True, 2.5)
    ids, _ = route(got, router.expert_bias, p)
    ref_ids, _ = route(want, router.expert_bias, p)
    assert (ids.sort(1).values == ref_ids.sort(1).values).float().mean() > 0.999
    fused_ids, fused_weights = fused_route(parts, router.expert_bias, p)
    sum_ids, sum_weights = fused_route(got, router.expert_bias, p)
    assert torch.equal(fused_ids, sum_ids) and torch.equal(fused_weights, sum_weights)
