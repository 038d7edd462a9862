"""LowConfidence: unmask every masked position whose confidence exceeds a threshold.

A row with masks that clears nothing unmasks its single most confident masked position
(top-1 fallback), so every step makes progress: a block needs at most block_size unmasking
steps plus the done-on-entry step. Tokens already written are never changed.
"""

from __future__ import annotations

import torch

from dllm_serve.dllm.algorithm_settings import LOW_CONFIDENCE, LowConfidenceConfig
from dllm_serve.dllm.algorithms.base import (
    DenoiseBatch,
    DllmAlgorithm,
    Scores,
    State,
    StepOutput,
)
from dllm_serve.dllm.algorithms.registry import ALGORITHMS
from dllm_serve.kernels.commit import commit_confident, threshold_of


@ALGORITHMS.register()
class LowConfidence(DllmAlgorithm):
    Config = LowConfidenceConfig
    config: LowConfidenceConfig
    request_params = LOW_CONFIDENCE.request_params

    def step(self, batch: DenoiseBatch, full_logits: Scores,
             state: State | None) -> StepOutput:
        ids = batch.block_ids  # (B, K)
        masked = ids == self.mask_id
        x, p = self.predict(batch, full_logits, masked)  # only masked positions are read
        if ids.is_cuda:  # the commit below in one launch (kernels/commit.py)
            thr = threshold_of(batch, "threshold", self.config.threshold)
            return StepOutput(commit_confident(ids, x, p, self.mask_id, thr), p)
        return StepOutput(self.commit(ids, x, p, self.param(batch, "threshold")), p)

    def commit(self, ids: torch.Tensor, x: torch.Tensor, p: torch.Tensor,
               threshold: torch.Tensor) -> torch.Tensor:
        """ids (N, K) edited in place from x (N, K) where p (N, K) > threshold (N, 1) at a
        masked position, or at the most confident masked one when none is -> done (N,): no
        mask on entry. The oracle of kernels/commit.py."""
        masked = ids == self.mask_id
        has_mask = masked.any(1)
        conf = torch.where(masked, p, float("-inf"))
        transfer = self.top1_fallback(conf, conf > threshold, has_mask) & masked
        ids.copy_(torch.where(transfer, x, ids))
        return ~has_mask

    def converged(self, batch: DenoiseBatch, state: State | None) -> torch.Tensor:
        return ~(batch.block_ids == self.mask_id).any(1)

    def readiness_threshold(self) -> float:
        return self.config.threshold
