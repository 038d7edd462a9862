"""Algorithm unit tests on hand-made logits (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dllm_serve.dllm.algorithms import DenoiseBatch, DllmAlgorithm, algorithm_class, build_algorithm
from dllm_serve.dllm.algorithms.base import State
from dllm_serve.dllm.algorithms.joint_threshold import JointThreshold, JointThresholdConfig
from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.dllm.config import DllmConfig

M = 9  # mask id
V = 10  # vocab


def batch(rows: list[list[int]], **overrides: list[float]) -> DenoiseBatch:
    ids = torch.tensor(rows, dtype=torch.int64)
    n = ids.shape[0]
    return DenoiseBatch(
        block_ids=ids, num_blocks=[1] * n, first_starts=[0] * n,
        temperatures=[0.0] * n, top_ps=[1.0] * n, seeds=list(range(n)),
        params={name: torch.tensor(v) for name, v in overrides.items()},
        block_steps=np.zeros(n, dtype=np.int64))


def logits(spec: list[list[tuple[int, float]]]) -> torch.Tensor:
    """spec[b][j] = (token, prob): a row whose argmax is token with softmax prob ~ prob."""
    out = torch.empty(len(spec), len(spec[0]), V)
    for b, row in enumerate(spec):
        for j, (tok, p) in enumerate(row):
            rest = (1 - p) / (V - 1)
            out[b, j] = math.log(rest)
            out[b, j, tok] = math.log(p)
    return out.view(-1, V)


def low_conf(threshold: float = 0.95, k: int = 4) -> LowConfidence:
    return LowConfidence(LowConfidenceConfig(threshold), k, M)


def joint(k: int = 4, **kw: float) -> JointThreshold:
    return JointThreshold(JointThresholdConfig(**kw), k, M)


# ---- LowConfidence -------------------------------------------------------------------------


def test_low_confidence_unmasks_above_threshold_only() -> None:
    b = batch([[M, M, M, M]])
    done = low_conf().step(b, logits([[(1, 0.99), (2, 0.5), (3, 0.96), (4, 0.2)]]), None).done
    assert b.block_ids.tolist() == [[1, M, 3, M]]
    assert done.tolist() == [False]


def test_low_confidence_top1_fallback_picks_most_confident_mask() -> None:
    b = batch([[5, M, M, M]])
    # position 0 is not a mask: its high confidence must not be the fallback pick
    done = low_conf().step(b, logits([[(7, 0.99), (2, 0.3), (3, 0.6), (4, 0.2)]]), None).done
    assert b.block_ids.tolist() == [[5, M, 3, M]]
    assert done.tolist() == [False]


def test_low_confidence_done_on_entry() -> None:
    b = batch([[M, 1, 2, 3], [4, 5, 6, 7]])
    spec = [[(8, 0.99)] * 4, [(0, 0.99)] * 4]
    done = low_conf().step(b, logits(spec), None).done
    # row 0 got its last mask filled in this step, but is done only on the next entry
    assert done.tolist() == [False, True]
    assert b.block_ids.tolist() == [[8, 1, 2, 3], [4, 5, 6, 7]]  # written tokens never change
    assert low_conf().step(b, logits(spec), None).done.tolist() == [True, True]


def test_low_confidence_request_threshold_override() -> None:
    b = batch([[M, M], [M, M]], threshold=[0.5, 0.95])
    low_conf(k=2).step(b, logits([[(1, 0.6), (2, 0.7)], [(1, 0.6), (2, 0.7)]]), None)
    assert b.block_ids.tolist() == [[1, 2], [M, 2]]


def steps_until_done(algo: DllmAlgorithm, b: DenoiseBatch, state: State | None,
                     forward) -> int:  # type: ignore[no-untyped-def]
    """Step until every block reports done on entry; the number of steps (forwards) taken.
    Checks the `converged` contract on the way: after each step it equals the next step's
    done-on-entry flags."""
    predicted = None
    for n in range(1, 100):
        done = algo.step(b, forward(n), state).done
        if predicted is not None:
            assert done.tolist() == predicted.tolist(), f"step {n}: converged != done"
        predicted = algo.converged(b, state)
        if done.all():
            return n
    raise AssertionError("never done")


def test_low_confidence_flat_logits_need_k_plus_one_steps() -> None:
    algo, b = low_conf(k=4), batch([[M, M, M, M]])
    flat = torch.zeros(4, V)
    assert steps_until_done(algo, b, None, lambda _: flat) == 5 == algo.max_steps(4)
    assert (b.block_ids != M).all()


# ---- JointThreshold ------------------------------------------------------------------------


def test_joint_threshold_m2t_and_t2t_in_one_step_prompt_never_edited() -> None:
    algo = joint()
    b = batch([[6, 7, M, M]])  # 6 is prompt, 7 will be "decoded" below
    state = algo.init_step_state(b.block_ids)
    state["prompt_mask"][0] = torch.tensor([True, False, False, False])
    spec = [[(1, 0.99), (2, 0.9), (3, 0.8), (4, 0.1)]]
    algo.step(b, logits(spec), state)
    # prompt kept; 7 -> 2 (T2T, p > 0); mask -> 3 (M2T, p > 0.5); last mask stays
    assert b.block_ids.tolist() == [[6, 2, 3, M]]
    assert algo.edits(state).tolist() == [1]


def test_joint_threshold_finishes_when_nothing_changes_then_done() -> None:
    algo = joint(k=2)
    b = batch([[M, M]])
    state = algo.init_step_state(b.block_ids)
    spec = logits([[(1, 0.9), (2, 0.9)]])
    assert algo.step(b, spec, state).done.tolist() == [False]  # fills both
    assert algo.step(b, spec, state).done.tolist() == [False]  # no change -> finished
    assert bool(state["finished"][0])
    assert algo.step(b, spec, state).done.tolist() == [True]  # done on entry
    assert b.block_ids.tolist() == [[1, 2]]


def test_joint_threshold_post_edit_budget() -> None:
    algo = joint(k=2, max_post_edit_steps=2)
    b = batch([[3, 3]])
    state = algo.init_step_state(b.block_ids)
    state["prompt_mask"][:] = False  # decoded tokens, editable
    flip = [logits([[(4, 0.9), (4, 0.9)]]), logits([[(3, 0.9), (3, 0.9)]])]
    results = [algo.step(b, flip[i % 2], state).done.item() for i in range(4)]
    # two post-edit steps edit, the third exceeds the budget and finishes, the fourth is done
    assert results == [False, False, False, True]
    assert int(state["post_edit_steps"][0]) == 3
    assert b.block_ids.tolist() == [[3, 3]]


def test_joint_threshold_edit_threshold_above_one_disables_t2t() -> None:
    algo = joint(k=2, edit_threshold=1.5)
    b = batch([[3, M]])
    state = algo.init_step_state(b.block_ids)
    state["prompt_mask"][:] = False
    algo.step(b, logits([[(4, 0.99), (5, 0.99)]]), state)
    assert b.block_ids.tolist() == [[3, 5]]


def test_joint_threshold_request_edit_threshold_override() -> None:
    algo = joint(k=1)
    b = batch([[3], [3]], edit_threshold=[0.5, 0.95])
    state = algo.init_step_state(b.block_ids)
    state["prompt_mask"][:] = False
    algo.step(b, logits([[(4, 0.9)], [(4, 0.9)]]), state)
    assert b.block_ids.tolist() == [[4], [3]]


def test_joint_threshold_penalty_changes_argmax() -> None:
    plain, penal = joint(k=2), joint(k=2, penalty_lambda=5.0)
    spec = [[(1, 0.99), (1, 0.6)]]  # position 1 would repeat token 1
    for algo, want in ((plain, 1), (penal, 0)):
        b = batch([[1, M]])
        state = algo.init_step_state(b.block_ids)
        algo.step(b, logits(spec), state)
        assert b.block_ids[0, 1].item() == want


def test_joint_threshold_max_steps_bounds_worst_case() -> None:
    algo = joint(k=3, max_post_edit_steps=2)
    b = batch([[M, M, M]])
    state = algo.init_step_state(b.block_ids)

    def forward(i: int) -> torch.Tensor:  # flat masks (one per step), then edits
        return logits([[(1 + i % 2, 0.4)] * 3])

    assert steps_until_done(algo, b, state, forward) <= algo.max_steps(3)


def test_converged_predicts_the_next_done_for_mixed_rows() -> None:
    """Rows converging at different steps (one at once, one a mask per step, one editing)."""
    spec = logits([[(1, 0.99)] * 3, [(2, 0.5), (2, 0.4), (2, 0.3)], [(3, 0.9)] * 3])
    for algo in (low_conf(k=3), joint(k=3)):
        b = batch([[M, M, M], [M, M, M], [4, M, M]])
        state = algo.init_step_state(b.block_ids)
        assert steps_until_done(algo, b, state, lambda _: spec) <= algo.max_steps(3)


# ---- config, registry, overrides, sampling ---------------------------------------------------


def test_registry_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError, match="known: JointThreshold, LowConfidence"):
        algorithm_class("LowConfidense")


def test_unknown_setting_is_an_error() -> None:
    cfg = DllmConfig("LowConfidence", {"treshold": 0.9}, 4, M)
    with pytest.raises(ValueError, match="no setting.*treshold"):
        build_algorithm(cfg)


def test_validate_request_params() -> None:
    checked = JointThreshold.settings().validate_request_params({"edit_threshold": 1})
    assert checked == {"edit_threshold": 1.0}
    with pytest.raises(ValueError, match="dllm_edit_threshold is not a setting of LowConfidence"):
        LowConfidence.settings().validate_request_params({"edit_threshold": 0.5})
    with pytest.raises(ValueError, match="must be a number"):
        LowConfidence.settings().validate_request_params({"threshold": "high"})


@pytest.mark.parametrize("values,match", [
    ({"threshold": float("nan")}, "must be a number"),
    ({"threshold": float("inf")}, "must be a number"),
    ({"threshold": 10**400}, "must be a number"),  # JSON's big ints: float() would overflow
    ({"threshold": 1.5}, r"dllm_threshold: .*\[0, 1\]"),
    ({"threshold": -0.1}, r"dllm_threshold: .*\[0, 1\]"),
])
def test_request_params_are_range_checked_like_the_config(values: dict, match: str) -> None:
    """Regression: per-request settings skipped the config's checks (NaN and 1.5 were served,
    a huge int was a 500)."""
    with pytest.raises(ValueError, match=match):
        LowConfidence.settings().validate_request_params(values)
    with pytest.raises(ValueError, match="edit_threshold"):
        JointThreshold.settings().validate_request_params({"edit_threshold": -1})


def test_sampling_is_seeded_and_greedy_by_default() -> None:
    algo = low_conf(threshold=0.0, k=8)
    flat = torch.randn(8, V, generator=torch.Generator().manual_seed(0))

    def sample(seed: int, temp: float) -> list[int]:
        b = batch([[M] * 8])
        b.temperatures, b.seeds = [temp], [seed]
        algo.step(b, flat * 0.1, None)
        return b.block_ids[0].tolist()

    assert sample(1, 1.0) == sample(1, 1.0)
    assert sample(1, 1.0) != sample(2, 1.0)
    greedy = (flat * 0.1).index_fill(1, torch.tensor([M]), float("-inf")).argmax(-1)
    assert sample(1, 0.0) == sample(2, 0.0) == greedy.tolist()


def test_mask_token_is_never_predicted() -> None:
    b = batch([[M, M]])
    spec = torch.zeros(2, V)
    spec[:, M] = 10.0  # the model "prefers" the mask token
    spec[:, 3] = 5.0
    low_conf(threshold=0.5, k=2).step(b, spec, None)
    assert b.block_ids.tolist() == [[3, 3]]
