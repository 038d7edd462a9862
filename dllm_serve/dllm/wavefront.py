"""FlowBlock's gated wavefront: when a request may open its next block, and which blocks retire.

Per request a window of at most W adjacent active blocks [L, R) is denoised together in one
segment (block-causal: block g sees blocks L..g and the committed prefix, never a block to its
right). After each forward the leading blocks that report done (on entry) retire, in order
only; then the frontier block R-1 spawns an all-mask block R when its readiness
rho = (masked positions with confidence >= tau) / (masked positions) exceeds theta (a frontier
with no masks left is ready), R - L < W counting the retiring blocks as gone, and the new block
fits the request's limit. W = 1 is plain block-by-block decoding (no spawning).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


def earlier_block_changed(changed: torch.Tensor, row_req: torch.Tensor) -> torch.Tensor:
    """changed (N,) bool per block -> (N,) bool: some earlier block of the same request changed.

    Rows are grouped by request in order, so an exclusive cumulative count within each request
    is the running count minus the count at the request's first row.
    """
    count = changed.long().cumsum(0) - changed.long()  # changed blocks strictly before each row
    first = torch.zeros_like(row_req, dtype=torch.bool)
    first[0] = True
    first[1:] = row_req[1:] != row_req[:-1]
    base = torch.cummax(torch.where(first, count, 0), 0).values
    return count - base > 0


def retire_counts(done: np.ndarray, num_blocks: list[int]) -> np.ndarray:
    """Per request, how many leading blocks are done (blocks retire in order only)."""
    out = np.zeros(len(num_blocks), dtype=np.int64)
    offset = 0
    for b, n in enumerate(num_blocks):
        lead = done[offset:offset + n]
        out[b] = n if lead.all() else int(np.argmin(lead))
        offset += n
    return out


def spawn_mask(ready: np.ndarray, num_blocks: list[int], retired: np.ndarray,
               room: list[bool], cfg: WavefrontConfig) -> np.ndarray:
    """Which requests open a new block: frontier ready, window not full once this forward's
    retiring blocks have left, room under the limit.

    ready: (N,) per block; retired[b]: leading blocks retiring now; room[b]: the request may
    still place a block after its frontier. Lockstep opens blocks only when every request that
    could is ready, all together.
    """
    ends = np.cumsum(num_blocks) - 1
    eligible = np.array([n - k < cfg.size and r for n, k, r in
                         zip(num_blocks, retired, room, strict=True)])
    frontier_ready = ready[ends] if len(ends) else np.zeros(0, dtype=bool)
    if cfg.lockstep:
        go = eligible.any() and frontier_ready[eligible].all()
        return eligible & go
    return eligible & frontier_ready
