"""LowConfidence: unmask every masked position whose confidence exceeds a threshold.

A row with masks that clears nothing unmasks its single most confident masked position
(top-1 fallback), so every step makes progress: a block needs at most block_size unmasking
steps plus the done-on-entry step. Tokens already written are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_serve.dllm.algorithms.base import (
    AlgorithmConfig,
    DenoiseBatch,
    DllmAlgorithm,
    Scores,
    State,
    StepOutput,
)
from dllm_serve.dllm.algorithms.registry import ALGORITHMS


@dataclass(frozen=True)
class LowConfidenceConfig(AlgorithmConfig):
    threshold: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"LowConfidence threshold must be in [0, 1], got {self.threshold}")


@ALGORITHMS.register()
class LowConfidence(DllmAlgorithm):
    Config = LowConfidenceConfig
    config: LowConfidenceConfig
    request_params = ("threshold",)

    def step(self, batch: DenoiseBatch, full_logits: Scores,
             state: State | None) -> StepOutput:
        ids = batch.block_ids  # (B, K)
        masked = ids == self.mask_id
        has_mask = masked.any(1)
        x, p = self.predict(batch, full_logits, masked)  # only masked positions are read
        conf = torch.where(masked, p, float("-inf"))
        transfer = conf > self.param(batch, "threshold")
        transfer = self.top1_fallback(conf, transfer, has_mask) & masked
        ids.copy_(torch.where(transfer, x, ids))
        return StepOutput(~has_mask, p)

    def converged(self, batch: DenoiseBatch, state: State | None) -> torch.Tensor:
        return ~(batch.block_ids == self.mask_id).any(1)

    def readiness_threshold(self) -> float:
        return self.config.threshold
