"""`DllmAlgorithm`: token selection for one denoise step, plus the two execution modes.

An algorithm owns token selection and nothing else. Per round the worker hands it a
`DenoiseBatch` of B blocks of K = block_size token ids and a `forward` callable that runs the
model over exactly those ids (the ids tensor is a view of the forward's input, so editing it in
place changes the next forward). Contract of `step` (SGLang's): it edits `batch.block_ids` in
place and returns, per block, whether the block was already complete *on entry*, i.e. the
forward that produced these logits saw the block's final tokens, so its cached KV is exact and
the block can be committed. That costs one extra forward per block, and makes a committed
block's KV always consistent with its tokens.

Execution modes live here, independent of the algorithm:
- sync: forward -> step until every block of the batch is done;
- FDFO: forward -> step, re-looping in place while no block is done; return as soon as one is.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

State = dict[str, torch.Tensor]  # batched per-block state, every tensor with leading dim B
RowState = dict[str, np.ndarray]  # one block's state, as stored by the scheduler (opaque to it)


@dataclass
class DenoiseBatch:
    """The B blocks of one round on the worker's device.

    block_ids: (B, K) int64 on the device, edited in place by `step`.
    params: per-row values (B,) on the device of the settings a request may override.
    Host-side, per row: temperatures (0 = greedy), top_ps in (0, 1], sampling seeds, the
    absolute position of each block, and block_steps (B,) int64, the forwards each block has
    had so far (carried across FDFO rounds).
    """

    block_ids: torch.Tensor
    params: dict[str, torch.Tensor]
    temperatures: list[float]
    top_ps: list[float]
    seeds: list[int]
    block_starts: list[int]
    block_steps: np.ndarray

    @property
    def size(self) -> int:
        return self.block_ids.shape[0]

    @property
    def sampled(self) -> bool:
        return any(t > 0 for t in self.temperatures)


@dataclass
class RoundOutput:
    """What one round did. done: (B,) host bool; forwards: forwards run this round;
    finished_at: (B,) the forward (1-based) at which each block reported done, 0 if not done."""

    done: np.ndarray
    forwards: int
    finished_at: np.ndarray


@dataclass(frozen=True)
class AlgorithmConfig:
    """Base of each algorithm's frozen settings dataclass (loaded from the YAML)."""


class DllmAlgorithm(ABC):
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    # Settings a request may override with `dllm_<name>` (e.g. dllm_threshold).
    request_params: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: AlgorithmConfig, block_size: int, mask_id: int) -> None:
        self.config = config
        self.block_size = block_size
        self.mask_id = mask_id

    @classmethod
    def from_dict(cls, settings: dict[str, Any], block_size: int, mask_id: int) -> DllmAlgorithm:
        return cls(cls.parse_config(settings), block_size, mask_id)

    @classmethod
    def parse_config(cls, settings: dict[str, Any]) -> AlgorithmConfig:
        known = {f.name for f in dataclasses.fields(cls.Config)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known)) or '(none)'}")
        return cls.Config(**settings)

    @classmethod
    def validate_request_params(cls, values: dict[str, Any]) -> dict[str, float]:
        """Check per-request overrides (names without the dllm_ prefix); raise ValueError."""
        out = {}
        for name, value in values.items():
            if name not in cls.request_params:
                allowed = ", ".join(f"dllm_{p}" for p in cls.request_params) or "none"
                raise ValueError(f"dllm_{name} is not a setting of {cls.__name__} "
                                 f"(per-request settings: {allowed})")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"dllm_{name} must be a number, got {value!r}")
            out[name] = float(value)
        return out

    # ---- what subclasses implement -------------------------------------------------------

    def init_step_state(self, block_ids: torch.Tensor) -> State | None:
        """State for blocks that start now; block_ids (B, K). Default: stateless."""
        return None

    @abstractmethod
    def step(self, batch: DenoiseBatch, full_logits: torch.Tensor,
             state: State | None) -> torch.Tensor:
        """full_logits (B * K, V) -> done-on-entry flags (B,) bool, on the device.

        Edits batch.block_ids (and state) in place; must not synchronise with the host.
        """

    def max_steps(self, block_size: int) -> int:
        """Upper bound on step() calls for one block, the done-on-entry step included."""
        return block_size + 1

    # ---- execution modes (shared by every algorithm) -------------------------------------

    def run(self, forward: Callable[[], torch.Tensor], batch: DenoiseBatch, state: State | None,
            fdfo: bool) -> RoundOutput:
        """Run one round: sync (until all blocks are done) or FDFO (until any block is)."""
        size = batch.size
        finished_at = np.zeros(size, dtype=np.int64)
        cap = self.max_steps(self.block_size)
        for forwards in range(1, cap + 1):
            done = self.step(batch, forward(), state)
            batch.block_steps += 1
            done_host = done.cpu().numpy()  # the one host sync per forward
            finished_at[(finished_at == 0) & done_host] = forwards
            if (done_host.any() if fdfo else done_host.all()):
                return RoundOutput(finished_at > 0, forwards, finished_at)
            if (batch.block_steps >= cap).any():
                break
        raise RuntimeError(f"{type(self).__name__}: a block was not done after {cap} steps")

    # ---- helpers shared by algorithms ----------------------------------------------------

    def param(self, batch: DenoiseBatch, name: str) -> torch.Tensor:
        """Per-row value of a setting as a (B, 1) tensor (request override or config)."""
        if name in batch.params:
            return batch.params[name][:, None]
        return torch.full((batch.size, 1), float(getattr(self.config, name)),
                          device=batch.block_ids.device)

    def predict(self, batch: DenoiseBatch, logits: torch.Tensor) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
        """logits (B, K, V) -> (x, p): predicted token (B, K) and its confidence (B, K).

        Greedy rows take the argmax; rows with temperature > 0 sample by the Gumbel-max rule on
        logits / temperature (restricted to the top_p nucleus). The confidence is the softmax
        probability of the chosen token, computed without a full probability tensor. The mask
        token is never predicted (so every step with masks unmasks at least one position).
        """
        logits = logits.float()
        logits[..., self.mask_id] = float("-inf")
        x = logits.argmax(-1)
        if batch.sampled:
            x = sample_rows(batch, logits, x)
        p = torch.exp(logits.gather(-1, x[..., None])[..., 0] - logits.logsumexp(-1))
        return x, p

    def top1_fallback(self, conf: torch.Tensor, transfer: torch.Tensor,
                      has_mask: torch.Tensor) -> torch.Tensor:
        """Where a row with masks transfers nothing, transfer its most confident position."""
        top1 = torch.zeros_like(transfer).scatter_(1, conf.argmax(1, keepdim=True), True)
        need = has_mask & ~transfer.any(1)
        return transfer | (top1 & need[:, None])


def sample_rows(batch: DenoiseBatch, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Replace x on rows with temperature > 0 by a Gumbel-max sample (seeded per row/step)."""
    for i, t in enumerate(batch.temperatures):
        if t <= 0:
            continue
        gen = torch.Generator(device=logits.device)
        key = (batch.seeds[i], batch.block_starts[i], int(batch.block_steps[i]))
        gen.manual_seed(hash(key) & (2**63 - 1))
        scaled = nucleus(logits[i] / t, batch.top_ps[i])
        u = torch.rand(scaled.shape, generator=gen, device=logits.device).clamp_(1e-20, 1.0)
        x[i] = (scaled - torch.log(-torch.log(u))).argmax(-1)
    return x


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the smallest set whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the first token always
    sorted_logits[drop] = float("-inf")
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
