"""`HeadInput`: a forward's output before its LM head, for a step that may never need logits.

A denoise step that only takes each position's greedy token and its confidence needs no (T, V)
logits tensor: `kernels/lm_head.py` computes both from the hidden states in one pass, and skips
the positions the algorithm does not read (e.g. LowConfidence's unmasked ones). The forward +
step graphs (model/denoise_graphs.py) hand the step a HeadInput; whatever needs the logits
themselves (sampling, a logit penalty, a plugin that edits them, the CPU) calls `logits()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadInput:
    """hidden (T, H) after the final norm; weight (V, H) the LM head's; `logits()` writes and
    returns the logits (T, V) in the model's dtype (the LM head's GEMM: the values a forward
    returns)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    logits: Callable[[], torch.Tensor]


Scores = torch.Tensor | HeadInput  # what a denoise step gets: logits (T, V), or the head's input


def as_logits(scores: Scores) -> torch.Tensor:
    """The logits (T, V) of either form."""
    return scores.logits() if isinstance(scores, HeadInput) else scores
