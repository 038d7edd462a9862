"""`DllmAlgorithm`: token selection for one denoise step.

An algorithm owns token selection and nothing else. Each step it gets a `DenoiseBatch` of N
active blocks of K = block_size ids and the scores of a forward over exactly those ids: its
logits (N * K, V), or (CUDA-graph steps) a `HeadInput` from which `predict` takes each
position's greedy token and confidence without a logits tensor (`as_logits` gives the logits
of either); the next forward reads the ids as the step left them. Contract of `step` (SGLang's): it
edits `batch.block_ids` in place and returns, per block, whether the block was already complete
*on entry*, i.e. the forward that produced these logits saw the block's final tokens, so its
cached KV is exact and the block can be committed. That costs one extra forward per block, and
keeps a committed block's KV consistent with its tokens.

`converged` says, after a step, which blocks the *next* step will report done on entry. The
worker reads it one forward late (it launches forward k + 1 before it reads step k's results),
which is exactly when it needs it: a block converged after step k has its final forward in
k + 1, so it leaves the batch right after that forward and its place is taken in k + 2. The
algorithm is called by the worker's loop (managers/worker.py), never the other way round; the
execution modes (sync, FDFO, wavefront) live there and in dllm/modes.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from dllm_serve.dllm.algorithm_settings import AlgorithmConfig, Settings
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.sampling import sample_rows
from dllm_serve.model.head import HeadInput, Scores, as_logits

State = dict[str, torch.Tensor]  # batched per-block state, every tensor with leading dim N
RowState = dict[str, np.ndarray]  # one block's state, as stored by the scheduler (opaque to it)


@dataclass
class StepOutput:
    """done (N,) bool: the block was complete on entry (its KV from this forward is exact);
    confidence (N, K) fp32: the confidence of each position's predicted token this step."""

    done: torch.Tensor
    confidence: torch.Tensor


def reference_predict(batch: DenoiseBatch, logits: torch.Tensor,
                      mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`DllmAlgorithm.predict` in plain PyTorch (the oracle of kernels/step.py)."""
    logits = logits.float()
    logits[..., mask_id] = float("-inf")
    x = logits.argmax(-1)
    if batch.sampled:
        x = sample_rows(batch, logits, x)
    p = torch.exp(logits.gather(-1, x[..., None])[..., 0] - logits.logsumexp(-1))
    return x, p


class DllmAlgorithm(ABC):
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    # Settings a request may override with `dllm_<name>` (e.g. dllm_threshold).
    request_params: ClassVar[tuple[str, ...]] = ()
    fused_predict: bool | None = None  # None: the fused step kernel on CUDA (use_fused_predict)
    # The greedy step reads only device tensors of the batch (block_ids, params, row_req,
    # row_start, row_seed), so it may be captured in a CUDA graph with the forward. An
    # algorithm whose step reads the batch's host lists must set this False.
    graph_safe: ClassVar[bool] = True

    def __init__(self, config: AlgorithmConfig, block_size: int, mask_id: int) -> None:
        self.config = config
        self.block_size = block_size
        self.mask_id = mask_id

    @classmethod
    def from_dict(cls, settings: dict[str, Any], block_size: int, mask_id: int) -> DllmAlgorithm:
        return cls(cls.parse_config(settings), block_size, mask_id)

    @classmethod
    def parse_config(cls, settings: dict[str, Any]) -> AlgorithmConfig:
        return cls.settings().parse_config(settings)

    @classmethod
    def settings(cls) -> Settings:
        """Its Config and request_params, as the front checks a request's dllm_* overrides
        (dllm/algorithm_settings.py)."""
        return Settings(cls.__name__, cls.Config, cls.request_params)

    # ---- what subclasses implement -------------------------------------------------------

    def init_step_state(self, block_ids: torch.Tensor) -> State | None:
        """State for blocks that start now; block_ids (N, K). Default: stateless."""
        return None

    @abstractmethod
    def step(self, batch: DenoiseBatch, full_logits: Scores,
             state: State | None) -> StepOutput:
        """full_logits (N * K, V) or a HeadInput of N * K rows -> done-on-entry flags and
        confidences, on the device.

        Edits batch.block_ids (and state) in place; must not synchronise with the host. A block
        done on entry is left unchanged (further steps over it change nothing).
        """

    @abstractmethod
    def converged(self, batch: DenoiseBatch, state: State | None) -> torch.Tensor:
        """(N,) bool, after a step: the blocks the next step will report done on entry."""

    def bind_device(self, device: torch.device) -> None:
        """Move whatever tensors the algorithm holds to the worker's device (called once,
        before any CUDA graph is captured). Default: it holds none."""
        return None

    def readiness_threshold(self) -> float:
        """The wavefront's default tau: confidence a masked position needs to count as ready
        (--dllm-spawn-token-threshold overrides it). Algorithms with a threshold return it."""
        return 0.9

    def max_steps(self, block_size: int) -> int:
        """Upper bound on step() calls for one block, the done-on-entry step included."""
        return block_size + 1

    def edits(self, state: State | None) -> torch.Tensor | None:
        """(N,) tokens each block has had rewritten (token-to-token edits), if the algorithm
        edits; reported per committed block as meta_info["block_edits"]."""
        return None

    def reopen(self, state: State | None, rows: torch.Tensor) -> None:
        """Blocks whose left context just changed (rows (N,) bool): forget any convergence
        judged against the old context. Default: nothing to forget."""
        return None

    # ---- helpers shared by algorithms ----------------------------------------------------

    def param(self, batch: DenoiseBatch, name: str) -> torch.Tensor:
        """Per-block value of a setting as an (N, 1) tensor (request override or config)."""
        if name in batch.params:
            return batch.params[name][batch.row_req][:, None]
        return torch.full((batch.size, 1), float(getattr(self.config, name)),
                          device=batch.block_ids.device)

    def use_fused_predict(self, batch: DenoiseBatch, scores: torch.Tensor) -> bool:
        """Greedy batches on CUDA take the fused kernels (kernels/lm_head.py from a HeadInput,
        kernels/step.py from logits); `fused_predict` True / False forces them on or off
        (tests run them under the Triton interpreter). scores: the logits or hidden states."""
        if batch.sampled:
            return False
        return scores.is_cuda if self.fused_predict is None else self.fused_predict

    def predict(self, batch: DenoiseBatch, scores: Scores, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """scores: logits (N * K, V) or (N, K, V), or a HeadInput of N * K rows -> (x, p):
        predicted token (N, K) int64 and its confidence (N, K) fp32. rows (N, K) bool: the
        positions the caller reads (None: all); elsewhere x and p are unspecified (the fused
        head, kernels/lm_head.py, skips them: x = mask_id, p = 0).

        Greedy rows take the argmax; rows with temperature > 0 sample by the Gumbel-max rule on
        logits / temperature (restricted to the top_p nucleus). The confidence is the softmax
        probability of the chosen token, computed without a full probability tensor. The mask
        token is never predicted (so every step with masks unmasks at least one position).
        """
        shape = batch.block_ids.shape
        if isinstance(scores, HeadInput) and self.use_fused_predict(batch, scores.hidden):
            from dllm_serve.kernels.lm_head import head_greedy

            x, p = head_greedy(scores.hidden, scores.weight, self.mask_id,
                               None if rows is None else rows.reshape(-1), skip_id=self.mask_id)
            return x.view(shape), p.view(shape)
        logits = as_logits(scores).view(*shape, -1)
        if self.use_fused_predict(batch, logits):
            from dllm_serve.kernels.step import argmax_confidence

            return argmax_confidence(logits, self.mask_id)
        return reference_predict(batch, logits, self.mask_id)

    def top1_fallback(self, conf: torch.Tensor, transfer: torch.Tensor,
                      has_mask: torch.Tensor) -> torch.Tensor:
        """Where a row with masks transfers nothing, transfer its most confident position."""
        top1 = torch.zeros_like(transfer).scatter_(1, conf.argmax(1, keepdim=True), True)
        need = has_mask & ~transfer.any(1)
        return transfer | (top1 & need[:, None])
