"""FlowBlock's gated wavefront: the readiness gate and the reopening of later blocks.

Per request a window of at most W adjacent active blocks [L, R) is denoised together in one
segment (block-causal: block g sees blocks L..g and the committed prefix, never a block to its
right). Leading converged blocks retire in order only; the frontier block R-1 spawns an
all-mask block R when its readiness rho = (masked positions with confidence >= tau) / (masked
positions) exceeds theta (a frontier with no masks left is ready), R - L < W counting the
retiring blocks as gone, and the new block fits the request's pages (dllm/modes.py decides).
When a block's tokens change, the later blocks of its request are reopened (their convergence
was judged against the old tokens). W = 1 is plain block-by-block decoding (no spawning).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WavefrontConfig:
    size: int = 1  # W: most active blocks per request
    spawn_threshold: float = 0.6  # theta
    token_threshold: float | None = None  # tau; None: the algorithm's own threshold
    lockstep: bool = False  # baseline: every request spawns and retires together

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--dllm-wavefront-size must be >= 1, got {self.size}")
        if not 0.0 <= self.spawn_threshold <= 1.0:
            raise ValueError(f"--dllm-spawn-threshold must be in [0, 1], got "
                             f"{self.spawn_threshold}")
        tau = self.token_threshold
        if tau is not None and not 0.0 <= tau <= 1.0:
            raise ValueError(f"--dllm-spawn-token-threshold must be in [0, 1], got {tau}")


def readiness(masked: torch.Tensor, confidence: torch.Tensor, tau: float) -> torch.Tensor:
    """masked, confidence (N, K) -> rho (N,): share of masked positions with confidence >= tau
    (1 for a block with no masks)."""
    n_masked = masked.sum(1)
    n_ready = (masked & (confidence >= tau)).sum(1)
    return torch.where(n_masked > 0, n_ready / n_masked.clamp(min=1), 1.0)


def earlier_block_changed(changed: torch.Tensor, row_req: torch.Tensor,
                          row_start: torch.Tensor) -> torch.Tensor:
    """changed (N,) bool per block, row_req / row_start (N,) each block's request key and
    position -> (N,) bool: some block of the same request at an earlier position changed.

    Rows may be in any order (the worker keeps each block in a row of its own, wherever a row
    was free): one (N, N) comparison, no host scalars, so it can be captured in a graph."""
    same = row_req[:, None] == row_req[None, :]  # (N, N): row i, row j of one request
    earlier = row_start[None, :] < row_start[:, None]  # j before i
    return (same & earlier & changed[None, :]).any(1)
