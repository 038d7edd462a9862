"""FlowBlock's gated wavefront: the readiness gate and the reopening of later blocks.

Per request a window of at most W adjacent active blocks [L, R) is denoised together in one
segment (block-causal: block g sees blocks L..g and the committed prefix, never a block to its
right). Leading converged blocks retire in order only; the frontier block R-1 spawns an
all-mask block R when its readiness rho = (masked positions with confidence >= tau) / (masked
positions) exceeds theta (a frontier with no masks left is ready), R - L < W counting the
retiring blocks as gone, and the new block fits the request's pages (dllm/modes.py decides).
When a block's tokens change, the later blocks of its request are reopened (their convergence
was judged against the old tokens). W = 1 is plain block-by-block decoding (no spawning).

Gated spawning (W > 1 `WavefrontConfig.gated`, dllm/modes.py; W = 1 with FDFO `standby`): the host
does not wait to read a frontier's readiness back before it opens the next block. It places the
next block ahead, in a row of its own, *gated* on its predecessor, and the device opens it in the
first step after the predecessor reported one of the gate's flags (`open_gates`: ready or converged
with W > 1; with W = 1, converged: the successor runs in its predecessor's final forward, which
stores the final K/V before any attention). Until then every step leaves the row as it entered (all
masks, fresh state) and reports it `gated`; the readout tells the host when it opened. A waiting
row costs a row of every forward it waits through and saves its request one forward (the host's
lag), so placing ahead pays only where blocks are short: the worker places blocks ahead while the
blocks it retired lately took at most `arm_forwards` forwards on average (managers/block_flow.py),
and otherwise opens them as without gating (W > 1: on the frontier's readiness read back; W = 1:
after the retirement).
"""

from __future__ import annotations

import torch


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


def wavefront_flags_torch(ids: torch.Tensor, before: torch.Tensor, confidence: torch.Tensor,
                          row_req: torch.Tensor, row_start: torch.Tensor, mask_id: int,
                          tau: float, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's wavefront flags: ids / before (N, K) the block rows after / before it,
    confidence (N, K) fp32 its confidences, row_req / row_start (N,) -> (changed_earlier,
    ready), each (N,) bool: an earlier block of the same request changed in this step (its
    convergence must be judged again), and the row's readiness exceeds theta. The oracle of
    kernels/wavefront_flags.py (one launch on CUDA) and the CPU path."""
    changed = earlier_block_changed((ids != before).any(1), row_req, row_start)
    return changed, readiness(before == mask_id, confidence, tau) > theta


def open_gates(gate: torch.Tensor, flag: torch.Tensor, row_req: torch.Tensor,
               row_start: torch.Tensor, block_size: int) -> torch.Tensor:
    """gate (N,) int64: per row the predecessor flags that open it (0: open); flag (N,) int64:
    each row's flags after its last step (CONVERGED | READY); row_req / row_start (N,) ->
    waiting (N,) bool. A gated row opens when the block before it (same request, start - K)
    has one of its gate's flags, or when that block has no row any more (it retired); an opened
    row's gate is cleared in place, so it stays open. One (N, N) comparison, no host sync."""
    pred = ((row_req[:, None] == row_req[None, :])
            & (row_start[None, :] == row_start[:, None] - block_size))  # (N, N): j before i
    hit = (pred & ((flag[None, :] & gate[:, None]) != 0)).any(1)
    waiting = (gate != 0) & pred.any(1) & ~hit
    gate.mul_(waiting)
    return waiting
