"""A benchmark-only decoding algorithm: blocks finish after a realistic number of forwards.

Random weights never converge (every block takes all K + 1 forwards), so at real model shapes
they cannot show what FDFO gains when blocks finish at different times. `ScheduledDenoise`
gives each block a forward count F drawn from a distribution and unmasks ceil(masked / steps
left) of its masked positions a step (the most confident first), so the block converges after
F - 1 steps and is done on entry at its F-th forward. Its forwards, step and logits are the
real ones; only the schedule is imposed.

F is a pure function of (request seed, block position), computed on the device from the batch's
row_seed and row_start, so FDFO and sync runs of the same requests draw the same schedule and
the step can be captured in a CUDA graph like the built-in ones. Distributions (the algorithm
YAML):
- lognormal (default): mean `mean` (12: LLaDA2.0-mini's ~2.5 tokens per forward on GSM8K with
  32-token blocks) and log-space spread `spread` (0.5), clamped to [min_forwards, max_forwards];
- histogram: `histogram: PATH` names a JSON file with {"histogram": {forwards: count}}, e.g.
  benchmarks/data/default_model_block_forwards.json (the built-in model on GSM8K).

Not shipped in the engine's registry: name it `benchmarks.scheduled_denoise:ScheduledDenoise`
(the module registers it when imported).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from dllm_serve.dllm.algorithms import ALGORITHMS, DllmAlgorithm, StepOutput
from dllm_serve.dllm.algorithms.base import AlgorithmConfig, Scores, State
from dllm_serve.dllm.batch import DenoiseBatch

MASK62 = (1 << 62) - 1  # int64 products wrap mod 2**64; masking keeps 62 exact bits


@dataclass(frozen=True)
class ScheduledConfig(AlgorithmConfig):
    mean: float = 12.0
    spread: float = 0.5
    min_forwards: int = 2
    max_forwards: int = 32
    histogram: str = ""

    def __post_init__(self) -> None:
        if not 2 <= self.min_forwards <= self.max_forwards:
            raise ValueError("need 2 <= min_forwards <= max_forwards")
        if self.mean <= 0 or self.spread < 0:
            raise ValueError("mean must be > 0 and spread >= 0")


def uniform(seed: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """(N,) int64 seeds and block starts -> (N,) float64 uniforms in (0, 1): a multiply /
    xor-shift hash, exact in int64 (every intermediate kept to 62 bits)."""
    z = (seed * 0x9E3779B1 + start * 0x85EBCA77 + 0x165667B1) & MASK62
    z = ((z ^ (z >> 29)) * 0x94D049BB) & MASK62
    z = ((z ^ (z >> 32)) * 0x2545F491) & MASK62
    z = z ^ (z >> 31)
    return ((z >> 9).double() + 0.5) / 2.0**53


@ALGORITHMS.register()
class ScheduledDenoise(DllmAlgorithm):
    Config = ScheduledConfig
    config: ScheduledConfig

    def __init__(self, config: ScheduledConfig, block_size: int, mask_id: int) -> None:
        super().__init__(config, block_size, mask_id)
        self.table: torch.Tensor | None = None  # the histogram expanded, sorted
        if config.histogram:
            hist = json.loads(open(config.histogram).read())["histogram"]
            self.table = torch.tensor(np.repeat([int(k) for k in hist],
                                                [int(v) for v in hist.values()]))

    def draw(self, seed: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """(N,) forwards the blocks at `start` of requests with `seed` take."""
        u, c = uniform(seed, start), self.config
        if self.table is not None:
            table = self.table
            f = table[(u * len(table)).long().clamp(max=len(table) - 1)]
        else:
            mu = math.log(c.mean) - c.spread**2 / 2  # so that the mean is c.mean
            f = torch.exp(mu + c.spread * torch.special.ndtri(u)).round().long()
        return f.clamp(c.min_forwards, c.max_forwards)

    def bind_device(self, device: torch.device) -> None:
        if self.table is not None:
            self.table = self.table.to(device)

    def forwards(self, seed: int, start: int) -> int:
        """draw() for one block, on the algorithm's device."""
        dev = self.table.device if self.table is not None else torch.device("cpu")
        return int(self.draw(torch.tensor([seed], device=dev),
                             torch.tensor([start], device=dev))[0])

    def init_step_state(self, block_ids: torch.Tensor) -> State:
        return {"age": torch.zeros(block_ids.shape[0], dtype=torch.int64,
                                   device=block_ids.device)}

    def step(self, batch: DenoiseBatch, full_logits: Scores,
             state: State | None) -> StepOutput:
        assert state is not None
        ids = batch.block_ids  # (N, K)
        masked = ids == self.mask_id
        x, p = self.predict(batch, full_logits, masked)
        need = self.draw(batch.row_seed, batch.row_start)
        left = (need - 1 - state["age"]).clamp(min=1)  # unmasking steps left
        quota = (masked.sum(1) + left - 1) // left  # ceil(masked / left)
        conf = torch.where(masked, p, float("-inf"))
        rank = torch.empty_like(ids).scatter_(
            1, conf.argsort(1, descending=True),
            torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous())
        ids.copy_(torch.where(masked & (rank < quota[:, None]), x, ids))
        state["age"] += 1
        return StepOutput(~masked.any(1), p)

    def converged(self, batch: DenoiseBatch, state: State | None) -> torch.Tensor:
        return ~(batch.block_ids == self.mask_id).any(1)

    def max_steps(self, block_size: int) -> int:
        return max(block_size, self.config.max_forwards) + 1
