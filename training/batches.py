"""Length-bucketed batches over a TokenPool, deterministic per (seed, epoch).

A sequence of length L whose prompt has P tokens costs L + (L - block_start(P)) layout tokens
in training: the clean sequence plus a noised copy of the blocks that hold completion tokens
(objective.py). An epoch shuffles the pool, sorts windows of it by that cost, cuts each window
into batches whose padded size (rows x longest layout) stays within a token budget, and
shuffles the batches. Batch k of epoch e is a pure function of (pool, budget, seed, e, k), so
a run resumes exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from training.data import TokenPool

WINDOW_BATCHES = 64  # batches' worth of examples sorted together


@dataclass
class HostBatch:
    """Clean sequences of one batch, right-padded (pads are never attended to nor trained on).

    clean: (R, L) int64, L = max lens; lens, prompt_lens: (R,) int64;
    noised_len: the longest noised copy, in tokens (a multiple of block_size).
    """

    clean: torch.Tensor
    lens: torch.Tensor
    prompt_lens: torch.Tensor
    noised_len: int
    block_size: int

    @property
    def layout_tokens(self) -> int:
        return self.clean.shape[0] * (self.clean.shape[1] + self.noised_len)

    @property
    def completion_tokens(self) -> int:
        """Completion positions (answer + EOS padding): where the loss may fall."""
        return int(self.lens.sum() - self.prompt_lens.sum())

    def to(self, device: torch.device) -> HostBatch:
        """A device copy; on CUDA from pinned memory without waiting for the device."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda":
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        return HostBatch(move(self.clean), move(self.lens), move(self.prompt_lens),
                         self.noised_len, self.block_size)


def layout_costs(pool: TokenPool, block_size: int) -> np.ndarray:
    """(n,) layout tokens of each sequence: clean length + noised-copy length."""
    return 2 * pool.lens - pool.prompt_lens // block_size * block_size


def plan_epoch(pool: TokenPool, block_size: int, tokens_per_batch: int, seed: int,
               epoch: int) -> list[np.ndarray]:
    """The epoch's batches, as arrays of pool indices."""
    rng = np.random.default_rng([seed, epoch])
    costs = layout_costs(pool, block_size)
    order = rng.permutation(len(pool))
    window = max(1, WINDOW_BATCHES * tokens_per_batch // int(costs.mean()))
    batches: list[np.ndarray] = []
    for lo in range(0, len(order), window):
        chunk = order[lo:lo + window]
        batches += _cut(chunk[np.argsort(costs[chunk], kind="stable")], costs, tokens_per_batch)
    return [batches[i] for i in rng.permutation(len(batches))]


def _cut(sorted_idx: np.ndarray, costs: np.ndarray, budget: int) -> list[np.ndarray]:
    """Greedy cut of cost-sorted indices: rows x max cost <= budget (at least one row)."""
    out, start = [], 0
    for i in range(1, len(sorted_idx) + 1):
        if i == len(sorted_idx) or (i - start + 1) * costs[sorted_idx[i]] > budget:
            out.append(sorted_idx[start:i])
            start = i
    return out


def collate(pool: TokenPool, idx: np.ndarray, block_size: int, pad_id: int) -> HostBatch:
    lens, prompt_lens = pool.lens[idx], pool.prompt_lens[idx]
    clean = np.full((len(idx), int(lens.max())), pad_id, dtype=np.int64)
    for row, i in enumerate(idx):
        clean[row, :lens[row]] = pool.sequence(int(i))
    noised = int((lens - prompt_lens // block_size * block_size).max())
    return HostBatch(torch.from_numpy(clean), torch.from_numpy(lens),
                     torch.from_numpy(prompt_lens), noised, block_size)
