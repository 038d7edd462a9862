"""The fused LM head + greedy prediction (kernels/lm_head.py) equals the LM head's GEMM
followed by the argmax / softmax confidence, on every asked row; rows not asked come back as
(skip_id, 0)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dllm_serve.dllm.algorithms.joint_threshold import JointThreshold, JointThresholdConfig
from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.kernels.lm_head import (
    HeadLaunch,
    choose_head_launches,
    head_greedy,
    reference_head_greedy,
)
from dllm_serve.kernels.step import argmax_confidence
from dllm_serve.model.head import HeadInput

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = HeadLaunch(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)


def device_rounded(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits rounded to dtype as the kernel's cast does: to nearest even on the GPU;
    toward zero in Triton's CPU interpreter (its fp32 -> bf16 cast truncates)."""
    if dtype == torch.float32:
        return logits
    if DEVICE.type == "cuda":
        return logits.to(dtype).float()
    assert dtype == torch.bfloat16
    return (logits.view(torch.int32) & ~0xFFFF).view(torch.float32)


def oracle(hidden: torch.Tensor, weight: torch.Tensor, mask_id: int, rows: torch.Tensor | None,
           skip_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = device_rounded(hidden.float() @ weight.float().t(), hidden.dtype)
    logits[:, mask_id] = float("-inf")
    x = logits.argmax(-1)
    p = torch.exp(logits.gather(-1, x[:, None])[:, 0] - logits.logsumexp(-1))
    if rows is not None:
        x, p = torch.where(rows, x, skip_id), torch.where(rows, p, 0.0)
    return x, p


def planted(tokens: int, width: int, vocab: int, mask_id: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random hidden states and head; row 0 peaks at the mask token (excluded), row 1 has the
    same maximum at two ids in different vocabulary tiles (the first wins)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) / width ** 0.5
    weight[mask_id] = 4 * hidden[0] / hidden[0].norm() ** 2 * width ** 0.5
    weight[[vocab // 3, vocab - 2]] = 4 * hidden[1] / hidden[1].norm() ** 2 * width ** 0.5
    return hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width,vocab", [(10, 64, 300), (37, 72, 301)])
@pytest.mark.parametrize("asked", ["all", "some", "none"])
def test_head_greedy_equals_the_gemm_then_argmax(tokens: int, width: int, vocab: int,
                                                 dtype: torch.dtype, asked: str) -> None:
    """Row tiles and vocabulary tiles with ragged ends, a reduction with a tail (72 = 2 x 32 +
    8), all / some / no rows asked."""
    mask_id, skip_id = vocab - 5, 3
    hidden, weight = planted(tokens, width, vocab, mask_id, dtype, seed=tokens + width)
    gen = torch.Generator().manual_seed(1)
    rows = {"all": None, "some": torch.rand(tokens, generator=gen) < 0.5,
            "none": torch.zeros(tokens, dtype=torch.bool)}[asked]
    if asked == "some":
        rows[:2] = True  # the planted rows
    rows = None if rows is None else rows.to(DEVICE)
    x, p = head_greedy(hidden, weight, mask_id, rows, skip_id=skip_id, launch=SMALL)
    ref_x, ref_p = oracle(hidden, weight, mask_id, rows, skip_id)
    assert x.dtype == torch.int64 and p.dtype == torch.float32
    assert torch.equal(x, ref_x)
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-6)
    if asked != "none":
        assert x[0] != mask_id and x[1] == vocab // 3
    else:
        assert (x == skip_id).all() and (p == 0).all()


@pytest.mark.parametrize("asked", ["all", "some", "none"])
@pytest.mark.parametrize("per_sm", [1, 3])
def test_persistent_head_equals_one_program_a_tile(asked: str, per_sm: int) -> None:
    """A few programs looping over the asked rows' tiles (the CPU counts as a few SMs: fewer
    programs than tiles) give what one program a tile gives, bit for bit."""
    tokens, width, vocab, mask_id = 37, 72, 301, 296
    hidden, weight = planted(tokens, width, vocab, mask_id, torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(2)
    rows = {"all": None, "some": torch.rand(tokens, generator=gen) < 0.5,
            "none": torch.zeros(tokens, dtype=torch.bool)}[asked]
    rows = None if rows is None else rows.to(DEVICE)
    launch = dataclasses.replace(SMALL, persistent=per_sm)
    x, p = head_greedy(hidden, weight, mask_id, rows, skip_id=7, launch=launch)
    ref_x, ref_p = head_greedy(hidden, weight, mask_id, rows, skip_id=7, launch=SMALL)
    assert torch.equal(x, ref_x) and torch.equal(p, ref_p)
    ox, op = oracle(hidden, weight, mask_id, rows, 7)
    assert torch.equal(x, ox)
    torch.testing.assert_close(p, op, rtol=1e-5, atol=1e-6)


def test_reference_rounds_the_logits_once() -> None:
    """The module's oracle is the GEMM in fp32 rounded to the model's dtype (round to
    nearest), then the step's argmax / confidence."""
    hidden, weight = planted(6, 64, 300, 295, torch.float32, seed=0)
    hidden, weight = hidden.cpu().to(torch.bfloat16), weight.cpu().to(torch.bfloat16)
    rows = torch.tensor([True, False, True, True, False, True])
    x, p = reference_head_greedy(hidden, weight, 295, rows, skip_id=9)
    logits = (hidden.float() @ weight.float().t()).to(torch.bfloat16).float()
    logits[:, 295] = float("-inf")
    assert torch.equal(x[rows], logits.argmax(-1)[rows]) and (x[~rows] == 9).all()
    assert (p[~rows] == 0).all() and (p[rows] > 0).all()


def test_head_greedy_rejects_mismatched_operands() -> None:
    hidden = torch.zeros(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        head_greedy(hidden, torch.zeros(100, 32, device=DEVICE), 0)
    with pytest.raises(ValueError, match="do not match"):
        head_greedy(hidden, torch.zeros(100, 64, device=DEVICE, dtype=torch.bfloat16), 0)


def test_head_greedy_without_rows() -> None:
    x, p = head_greedy(torch.zeros(0, 64, device=DEVICE), torch.zeros(100, 64, device=DEVICE), 0)
    assert x.shape == (0,) and p.shape == (0,)


def test_launch_table() -> None:
    """Each row's launches best first; the last of each is one any CUDA device holds."""
    assert choose_head_launches(32)[0].block_m <= 64
    assert choose_head_launches(2048) == choose_head_launches(1 << 20)
    for rows in (32, 2048):
        last = choose_head_launches(rows)[-1]
        stage_bytes = (last.block_m + last.block_n) * last.block_k * 2  # bf16 operands
        assert last.persistent == 0 and last.num_stages * stage_bytes <= 48 * 1024


def test_a_head_launch_the_device_cannot_hold_falls_back(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A table launch whose compile fails for lack of shared memory is skipped for the next of
    its row (kernels/launch_fit.py), with the same result; other errors propagate."""
    from triton.runtime.errors import OutOfResources

    from dllm_serve.kernels import launch_fit, lm_head
    from dllm_serve.kernels.launch_fit import fell_back

    big = dataclasses.replace(SMALL, num_stages=9)
    monkeypatch.setattr(lm_head, "HEAD_LAUNCHES", ((1 << 30, (big, SMALL)),))
    real = lm_head._head_kernel
    seen: list[int] = []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["num_stages"])
                if kwargs["num_stages"] == big.num_stages:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(lm_head, "_head_kernel", Refusing())
    hidden, weight = planted(9, 40, 70, 3, torch.bfloat16, seed=1)
    key = ("head", torch.bfloat16)
    monkeypatch.setattr(launch_fit, "_TOO_BIG", set())  # this test's failures only
    x, p = head_greedy(hidden, weight, 3)
    assert fell_back(key, big) and seen == [big.num_stages, SMALL.num_stages]
    head_greedy(hidden, weight, 3)  # remembered: straight to the launch that fits
    assert seen[2:] == [SMALL.num_stages]
    ref_x, ref_p = head_greedy(hidden, weight, 3, launch=SMALL)
    assert torch.equal(x, ref_x) and torch.equal(p, ref_p)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 512])
def test_head_greedy_at_llada2_mini_head(tokens: int) -> None:
    """LLaDA2.0-mini's head (157,184 x 2,048, bf16) with the table's launches: the same
    predictions as the cuBLAS GEMM into bf16 logits + the step kernel (the two sum in other
    orders, so a row whose top two logits straddle a bf16 rounding may differ)."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    vocab, width, mask_id = 157184, 2048, 156895
    weight = (0.02 * torch.randn(vocab, width, device=DEVICE, generator=gen)).bfloat16()
    hidden = torch.randn(tokens, width, device=DEVICE, generator=gen).bfloat16()
    rows = torch.rand(tokens, device=DEVICE, generator=gen) < 0.5
    x, p = head_greedy(hidden, weight, mask_id, rows, skip_id=mask_id)
    bx, bp = argmax_confidence(hidden @ weight.t(), mask_id)
    agree = x[rows] == bx[rows]
    assert agree.float().mean() >= 0.98
    torch.testing.assert_close(p[rows][agree], bp[rows][agree], rtol=1e-4, atol=1e-6)
    assert (x[~rows] == mask_id).all() and (p[~rows] == 0).all()


def test_non_finite_hidden_states_give_non_finite_confidences() -> None:
    """A row whose hidden state is NaN gets a non-finite p (the step's `bad` flag fails its
    request), whatever the other rows."""
    hidden, weight = planted(8, 64, 300, 295, torch.float32, seed=3)
    hidden[5, 7] = float("nan")
    x, p = head_greedy(hidden, weight, 295, launch=SMALL)
    assert not torch.isfinite(p[5]) and torch.isfinite(p[torch.arange(8) != 5]).all()


def run_head_steps(algo: LowConfidence | JointThreshold, fused: bool, ids: torch.Tensor,
                   hidden: list[torch.Tensor], weight: torch.Tensor
                   ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Steps fed by HeadInputs: fused (the head kernel) or through their logits."""
    algo.fused_predict = fused
    batch = SimpleNamespace(block_ids=ids.clone(), params={}, sampled=False, size=ids.shape[0])
    state = algo.init_step_state(batch.block_ids)
    done, conf = [], []
    for h in hidden:
        masked = batch.block_ids == algo.mask_id
        out = algo.step(batch, HeadInput(h, weight, lambda h=h: h @ weight.t()), state)
        done.append(out.done)
        conf.append(torch.where(masked, out.confidence, 0.0))
    return batch.block_ids, done, conf


@pytest.mark.parametrize("algo", [LowConfidence(LowConfidenceConfig(0.3), 8, 60),
                                  JointThreshold(JointThresholdConfig(0.3, 0.2), 8, 60)],
                         ids=["LowConfidence", "JointThreshold"])
def test_steps_from_the_fused_head_match_steps_from_logits(
        algo: LowConfidence | JointThreshold) -> None:
    """An algorithm stepping on a HeadInput edits the blocks as it does from the logits, and
    reports the same confidences where it reads them (LowConfidence: masked positions only,
    so the head skips the others; JointThreshold: every position)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.full((3, 8), 60, device=DEVICE)
    ids[1, :3] = torch.tensor([5, 6, 7])
    ids[2, 4:] = torch.tensor([1, 2, 3, 4])
    weight = torch.randn(64, 32, generator=gen).to(DEVICE)
    hidden = [torch.randn(24, 32, generator=gen).to(DEVICE) for _ in range(4)]
    ref = run_head_steps(algo, False, ids, hidden, weight)
    out = run_head_steps(algo, True, ids, hidden, weight)
    assert torch.equal(out[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(out[1], ref[1], strict=True))
    for a, b in zip(out[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
