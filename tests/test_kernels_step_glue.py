"""The step's one-launch kernels equal their torch oracles exactly: the readout pack
(kernels/readout.py against `pack_readout_torch`, waiting rows and the gates' flags too), the
wavefront's flags and gates (kernels/wavefront_flags.py against `wavefront_flags_torch` and
`open_gates`) and the algorithms' commits
(kernels/commit.py against `LowConfidence.commit` and `JointThreshold.commit`), on rows with
and without masks, ties, rows where no position clears the threshold (the top-1 fallback),
non-finite confidences, per-request thresholds, and JointThreshold's edits, post-edit budget
and finished blocks. Small shapes run in the interpreter on the CPU, the same shapes on CUDA
where there is one."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.dllm.algorithms.joint_threshold import JointThreshold, JointThresholdConfig
from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.dllm.wavefront import open_gates, wavefront_flags_torch
from dllm_serve.kernels.commit import Threshold, commit_confident, commit_joint
from dllm_serve.kernels.readout import pack_readout, pack_readout_torch
from dllm_serve.kernels.wavefront_flags import open_gates_fused, wavefront_flags

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MASK = 99


def low_confidence() -> LowConfidence:
    return LowConfidence(LowConfidenceConfig(), block_size=8, mask_id=MASK)


def flags(n: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(n, generator=gen) > 0.5).to(DEVICE)


@pytest.mark.parametrize("n,k", [(1, 8), (5, 32), (33, 8)])
@pytest.mark.parametrize("with_ready,with_edits,with_gated", [(False, False, False),
                                                              (True, True, True)])
def test_readout_pack_equals_torch(n: int, k: int, with_ready: bool, with_edits: bool,
                                   with_gated: bool) -> None:
    gen = torch.Generator().manual_seed(n * k)
    ids = torch.randint(0, 100, (n, k), generator=gen).to(DEVICE)
    conf = torch.rand(n, k, generator=gen)
    conf[0, k // 2] = float("nan")  # bad rows: NaN, +inf, -inf
    if n > 2:
        conf[1, 0], conf[2, k - 1] = float("inf"), float("-inf")
    conf = conf.to(DEVICE)
    ready = flags(n, gen) if with_ready else None
    edits = torch.randint(0, 9, (n,), generator=gen).to(DEVICE) if with_edits else None
    gated = flags(n, gen) if with_gated else None
    args = (ids, conf, flags(n, gen), ready, flags(n, gen), edits, gated)
    out, ref = pack_readout(*args), pack_readout_torch(*args)
    assert out.dtype == torch.int64 and out.shape == (n, k + 6)
    if gated is not None:
        assert torch.equal(out[:, k + 5], gated.long())
    assert torch.equal(out, ref)
    assert out[0, k + 2] == 1  # the NaN row is bad


@pytest.mark.parametrize("with_ready", [False, True])
def test_readout_pack_masks_waiting_rows_and_writes_their_flags(with_ready: bool) -> None:
    """With gated rows the pack reports no converged / ready / done for them and writes every
    row's flags (converged | ready << 1) into a strided column, as the torch oracle does."""
    gen = torch.Generator().manual_seed(5)
    n, k = 37, 8
    ids = torch.randint(0, 100, (n, k), generator=gen).to(DEVICE)
    conf = torch.rand(n, k, generator=gen).to(DEVICE)
    ready = flags(n, gen) if with_ready else None
    args = (ids, conf, flags(n, gen), ready, flags(n, gen), None, flags(n, gen))
    out_flags = torch.full((n, 2), 7, dtype=torch.int64, device=DEVICE)  # gate, flag columns
    ref_flags = out_flags.clone()
    out = pack_readout(*args, out_flags[:, 1])
    ref = pack_readout_torch(*args, ref_flags[:, 1])
    assert torch.equal(out, ref) and torch.equal(out_flags, ref_flags)
    gated = args[6]
    assert not out[gated][:, [k, k + 1, k + 3]].any()  # waiting rows: no converged/ready/done
    want = args[2] & ~gated
    if ready is not None:
        want = want.long() | (ready & ~gated).long() << 1
    assert torch.equal(out_flags[:, 1], want.long()) and (out_flags[:, 0] == 7).all()


@pytest.mark.parametrize("n", [1, 7, 16, 45])
def test_open_gates_fused_equals_torch(n: int) -> None:
    """Gated rows open when the block before them (same request, start - K) has one of their
    gate's flags or has no row: the fused launch's waiting rows and cleared gates equal
    `open_gates`' (strided gate / flag columns, as RowStorage keeps them)."""
    gen = torch.Generator().manual_seed(n)
    k = 4
    row_req = torch.randint(0, max(1, n // 3), (n,), generator=gen)
    row_start = torch.randint(0, 4, (n,), generator=gen) * k
    both = torch.stack([torch.randint(0, 4, (n,), generator=gen),
                        torch.randint(0, 4, (n,), generator=gen)], 1)  # (gate, flag) per row
    both[torch.rand(n, generator=gen) < 0.3, 0] = 0  # some open rows
    fused, ref = both.clone().to(DEVICE), both.clone().to(DEVICE)
    rr, rs = row_req.to(DEVICE), row_start.to(DEVICE)
    waiting = open_gates_fused(fused[:, 0], fused[:, 1], rr, rs, k)
    want = open_gates(ref[:, 0], ref[:, 1], rr, rs, k)
    assert waiting.dtype == torch.bool and torch.equal(waiting, want)
    assert torch.equal(fused, ref)  # gates cleared alike, flags untouched
    if n >= 16:
        assert want.any() and (both[:, 0] != 0).sum() > want.sum()  # some wait, some opened


def test_readout_pack_reads_strided_flags() -> None:
    """Flags that are columns of a wider tensor (a plugin's state) are read at their stride."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 100, (6, 8), generator=gen).to(DEVICE)
    conf = torch.rand(6, 8, generator=gen).to(DEVICE)
    wide = (torch.rand(6, 3, generator=gen) > 0.5).to(DEVICE)
    edits = torch.randint(0, 9, (6, 2), generator=gen).to(DEVICE)
    args = (ids, conf, wide[:, 0], wide[:, 1], wide[:, 2], edits[:, 1])
    assert torch.equal(pack_readout(*args), pack_readout_torch(*args))


def commit_case(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """ids with masks at random (row 0 none, row 1 all), predictions, confidences with ties."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (n, k), generator=gen)
    ids[torch.rand(n, k, generator=gen) < 0.6] = MASK
    ids[0] = torch.arange(k)
    if n > 1:
        ids[1] = MASK
    x = torch.randint(0, 50, (n, k), generator=gen)
    p = torch.rand(n, k, generator=gen).round(decimals=1)  # ties between positions
    if n > 3:
        p[2] = 0.1  # no position clears: the fallback takes the first masked one
        p[3, 1] = float("nan")  # NaN counts as the largest (torch.argmax)
    return ids.to(DEVICE), x.to(DEVICE), p.to(DEVICE)


@pytest.mark.parametrize("n,k", [(1, 4), (5, 32), (16, 8), (33, 32), (70, 4)])
def test_wavefront_flags_equal_torch(n: int, k: int) -> None:
    """Rows of several requests in any order (2-3 blocks each, some rows alone, padding rows
    with one shared key), some changed by the step, masked or not before it, confidences
    around tau (NaN too), readiness exactly at theta (3 of 5 over 0.6): both flags equal the
    oracle's, across the kernel's row tiles (16) and change-flag chunks (32)."""
    gen = torch.Generator().manual_seed(n * 31 + k)
    before = torch.randint(0, 6, (n, k), generator=gen)
    before[before > 2] = MASK  # about half masked
    ids = before.clone()
    step = torch.rand(n, k, generator=gen) < 0.2
    ids[step] = torch.randint(0, 6, (int(step.sum()),), generator=gen)  # some rows change
    conf = torch.rand(n, k, generator=gen)
    conf[torch.rand(n, k, generator=gen) < 0.05] = float("nan")
    if k >= 5:  # a row at exactly theta: 3 of its 5 masked positions confident
        before[0], conf[0] = 7, 0.0
        before[0, :5], conf[0, :3] = MASK, 0.95
    row_req = torch.randint(0, max(1, n // 2), (n,), generator=gen)
    row_req[-(n // 8):] = 10_000 if n >= 8 else row_req[-(n // 8):]  # padding: one key
    row_start = torch.randint(0, 4, (n,), generator=gen) * k
    args = [t.to(DEVICE) for t in (ids, before, conf, row_req, row_start)]
    got = wavefront_flags(*args, MASK, 0.9, 0.6)
    want = wavefront_flags_torch(*args, MASK, 0.9, 0.6)
    assert all(g.dtype == torch.bool and g.shape == (n,) for g in got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if k >= 5:
        assert not got[1][0]  # rho = 0.6 is not > 0.6
    assert want[0].any() or n < 8  # the case has reopened rows


@pytest.mark.parametrize("n,k", [(1, 8), (6, 8), (40, 32)])
@pytest.mark.parametrize("threshold", [0.0, 0.75, 1.0])
def test_commit_equals_low_confidence(n: int, k: int, threshold: float) -> None:
    algo = low_confidence()
    ids, x, p = commit_case(n, k, seed=n + k)
    want = ids.clone()
    done_ref = algo.commit(want, x, p, torch.full((n, 1), threshold, device=DEVICE))
    done = commit_confident(ids, x, p, MASK, Threshold(threshold))
    assert torch.equal(ids, want)
    assert torch.equal(done, done_ref)
    assert bool(done[0]) and (n == 1 or not bool(done[1]))


def test_commit_takes_each_requests_threshold() -> None:
    """params (R,) indexed by row_req: rows of requests 0 / 1 / 2 at 0.2 / 0.9 / 1.0."""
    algo = low_confidence()
    ids, x, p = commit_case(12, 16, seed=3)
    params = torch.tensor([0.2, 0.9, 1.0], device=DEVICE)
    row_req = torch.tensor([0, 1, 2] * 4, device=DEVICE)
    want = ids.clone()
    done_ref = algo.commit(want, x, p, params[row_req][:, None])
    done = commit_confident(ids, x, p, MASK, Threshold(0.5, params, row_req))
    assert torch.equal(ids, want) and torch.equal(done, done_ref)


def test_commit_edits_a_strided_view_in_place() -> None:
    algo = low_confidence()
    ids, x, p = commit_case(6, 8, seed=5)
    wide = torch.zeros(6, 16, dtype=torch.int64, device=DEVICE)
    wide[:, ::2] = ids
    want = ids.clone()
    algo.commit(want, x, p, torch.full((6, 1), 0.5, device=DEVICE))
    commit_confident(wide[:, ::2], x, p, MASK, Threshold(0.5))
    assert torch.equal(wide[:, ::2], want) and not wide[:, 1::2].any()


def joint_case(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   dict[str, torch.Tensor]]:
    """commit_case's rows with JointThreshold's state: prompt positions, some finished rows,
    rows without masks at and past the post-edit budget (2), edits so far."""
    ids, x, p = commit_case(n, k, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    same = (torch.rand(n, k, generator=gen) < 0.5).to(DEVICE)
    x = torch.where(same, ids, x)  # half the written positions predicted as they are
    state = {
        "prompt_mask": ((torch.rand(n, k, generator=gen) < 0.2).to(DEVICE) & (ids != MASK)),
        "post_edit_steps": torch.randint(0, 4, (n,), generator=gen).to(DEVICE),
        "finished": (torch.rand(n, generator=gen) < 0.2).to(DEVICE),
        "t2t_edits": torch.randint(0, 5, (n,), generator=gen).to(DEVICE),
    }
    return ids, x, p, state


@pytest.mark.parametrize("n,k", [(1, 8), (9, 8), (40, 32)])
@pytest.mark.parametrize("threshold,edit_threshold", [(0.5, 0.0), (0.9, 0.6), (1.0, 1.5)])
def test_joint_commit_equals_joint_threshold(n: int, k: int, threshold: float,
                                             edit_threshold: float) -> None:
    algo = JointThreshold(JointThresholdConfig(max_post_edit_steps=2), block_size=k,
                          mask_id=MASK)
    ids, x, p, state = joint_case(n, k, seed=7 * n + k)
    want, want_state = ids.clone(), {key: v.clone() for key, v in state.items()}
    done_ref = algo.commit(want, x, p, want_state,
                           torch.full((n, 1), threshold, device=DEVICE),
                           torch.full((n, 1), edit_threshold, device=DEVICE))
    before = {key: v.clone() for key, v in state.items()}
    done = commit_joint(ids, x, p, MASK, state, Threshold(threshold),
                        Threshold(edit_threshold), 2)
    assert torch.equal(ids, want) and torch.equal(done, done_ref)
    for key in state:
        assert torch.equal(state[key], want_state[key]), key
    if n == 40 and edit_threshold < 1:  # the case exercises T2T and the budget
        assert (state["t2t_edits"] > before["t2t_edits"]).any()
        assert (state["finished"] & ~before["finished"]).any()


def test_joint_commit_takes_each_requests_thresholds() -> None:
    algo = JointThreshold(JointThresholdConfig(max_post_edit_steps=1), block_size=16,
                          mask_id=MASK)
    ids, x, p, state = joint_case(12, 16, seed=11)
    row_req = torch.tensor([0, 1, 2] * 4, device=DEVICE)
    thr = torch.tensor([0.2, 0.9, 1.0], device=DEVICE)
    edit = torch.tensor([0.0, 0.5, 2.0], device=DEVICE)
    want, want_state = ids.clone(), {key: v.clone() for key, v in state.items()}
    done_ref = algo.commit(want, x, p, want_state, thr[row_req][:, None],
                           edit[row_req][:, None])
    done = commit_joint(ids, x, p, MASK, state, Threshold(0.5, thr, row_req),
                        Threshold(0.5, edit, row_req), 1)
    assert torch.equal(ids, want) and torch.equal(done, done_ref)
    for key in state:
        assert torch.equal(state[key], want_state[key]), key
