"""JointThreshold (LLaDA2.1): unmask by threshold (M2T) and edit written tokens (T2T).

Per block state, created when the block starts:
  prompt_mask (B, K) bool: positions that were not masks at block start (prompt tokens of the
      first generation block); never edited.
  post_edit_steps (B,) int64: steps taken since the block had no masks left.
  finished (B,) bool: the block converged; the next step reports it done.
  t2t_edits (B,) int64: tokens rewritten by T2T so far (reported per committed block).
Each step: M2T unmasks masked positions with confidence > threshold (top-1 fallback);
T2T rewrites non-prompt written positions whose argmax differs from the current token with
confidence > edit_threshold. A block finishes when a step changes nothing, or when it has spent
more than max_post_edit_steps steps without masks. An edit_threshold above 1 disables T2T.
"""

from __future__ import annotations

import torch

from dllm_serve.dllm.algorithm_settings import JOINT_THRESHOLD, JointThresholdConfig
from dllm_serve.dllm.algorithms.base import (
    DenoiseBatch,
    DllmAlgorithm,
    Scores,
    State,
    StepOutput,
)
from dllm_serve.dllm.algorithms.registry import ALGORITHMS
from dllm_serve.kernels.commit import commit_joint, threshold_of
from dllm_serve.model.head import as_logits


@ALGORITHMS.register()
class JointThreshold(DllmAlgorithm):
    Config = JointThresholdConfig
    config: JointThresholdConfig
    request_params = JOINT_THRESHOLD.request_params

    def init_step_state(self, block_ids: torch.Tensor) -> State:
        size = block_ids.shape[0]
        return {
            "prompt_mask": block_ids != self.mask_id,
            "post_edit_steps": torch.zeros(size, dtype=torch.int64, device=block_ids.device),
            "finished": torch.zeros(size, dtype=torch.bool, device=block_ids.device),
            "t2t_edits": torch.zeros(size, dtype=torch.int64, device=block_ids.device),
        }

    def max_steps(self, block_size: int) -> int:
        # block_size unmasking steps, max_post_edit_steps + 1 post steps, the done step.
        return block_size + self.config.max_post_edit_steps + 2

    def step(self, batch: DenoiseBatch, full_logits: Scores,
             state: State | None) -> StepOutput:
        assert state is not None
        ids = batch.block_ids  # (B, K)
        x, p = self.predict(batch, self.penalize(full_logits, ids))  # every position is read
        if ids.is_cuda:  # the commit below in one launch (kernels/commit.py)
            cfg = self.config
            done = commit_joint(ids, x, p, self.mask_id, state,
                                threshold_of(batch, "threshold", cfg.threshold),
                                threshold_of(batch, "edit_threshold", cfg.edit_threshold),
                                cfg.max_post_edit_steps)
            return StepOutput(done, p)
        return StepOutput(self.commit(ids, x, p, state, self.param(batch, "threshold"),
                                      self.param(batch, "edit_threshold")), p)

    def commit(self, ids: torch.Tensor, x: torch.Tensor, p: torch.Tensor, state: State,
               threshold: torch.Tensor, edit_threshold: torch.Tensor) -> torch.Tensor:
        """M2T and T2T from predictions x (N, K) with confidences p (N, K), thresholds (N, 1);
        ids and state edited in place -> done (N,): finished on entry. The oracle of
        kernels/commit.py."""
        done = state["finished"].clone()
        active = ~done
        masked = ids == self.mask_id
        has_mask = masked.any(1)
        post = active & ~has_mask
        state["post_edit_steps"] += post.long()
        over_budget = post & (state["post_edit_steps"] > self.config.max_post_edit_steps)
        live = active & ~over_budget

        conf = torch.where(masked, p, float("-inf"))
        m2t = self.top1_fallback(conf, conf > threshold, has_mask) & masked
        editable = ~masked & ~state["prompt_mask"]
        t2t = (p > edit_threshold) & (ids != x) & editable
        transfer = (m2t | t2t) & live[:, None]

        state["finished"] |= over_budget | (live & ~transfer.any(1))
        state["t2t_edits"] += (t2t & live[:, None]).sum(1)
        ids.copy_(torch.where(transfer, x, ids))
        return done

    def converged(self, batch: DenoiseBatch, state: State | None) -> torch.Tensor:
        assert state is not None
        return state["finished"].clone()

    def readiness_threshold(self) -> float:
        return self.config.threshold

    def edits(self, state: State | None) -> torch.Tensor | None:
        assert state is not None
        return state["t2t_edits"]

    def reopen(self, state: State | None, rows: torch.Tensor) -> None:
        assert state is not None
        state["finished"] &= ~rows

    def penalize(self, scores: Scores, ids: torch.Tensor) -> Scores:
        """Lower the logit at j + 1 of the token at j by penalty_lambda (repetition penalty);
        with a penalty the logits (B, K, V) are computed (as_logits)."""
        lam = self.config.penalty_lambda
        if lam == 0.0:
            return scores
        out = as_logits(scores).float().view(*ids.shape, -1).clone()  # (B, K, V)
        prev = ids[:, :-1, None]  # (B, K-1, 1)
        out[:, 1:].scatter_add_(-1, prev, torch.full(prev.shape, -lam, device=out.device))
        return out
