"""The MoE router: its linear layer (`Router`) and the routing (`route`, grouped top-k), which
picks each token's experts and their combine weights.

`route` is the plain-PyTorch oracle that the Triton router (kernels/moe_route.py) is tested
against. The router hands its logits on as P partial sums (T, P, E) (`sum_logit_parts` adds
them). Two routings are in use: LLaDA2's (sigmoid scores, an expert bias for selection only,
group-limited top-k, renormalised, scaled) and Qwen3-MoE's, which SDAR-MoE keeps (softmax over
all experts, top-k, renormalised when `norm_topk_prob`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORE_FUNCTIONS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class RoutingParams:
    top_k: int
    score_function: str  # "sigmoid" | "softmax"
    n_group: int  # 0: no group limit
    topk_group: int  # groups kept per token when n_group > 0
    renormalize: bool  # combine weights sum to 1 before scaling (when top_k > 1)
    scaling: float  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"unknown MoE score_function {self.score_function!r}; "
                             f"known: {', '.join(SCORE_FUNCTIONS)}")


def route(logits: torch.Tensor, expert_bias: torch.Tensor | None, p: RoutingParams
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick `p.top_k` experts per token and their combine weights.

    logits (T, E), expert_bias (E,) or None -> topk_ids (T, K) int64, topk_weights (T, K) fp32.
    Selection ranks `scores + expert_bias` (limited to the best groups when n_group > 0);
    the weights are the *unbiased* scores of the chosen experts, optionally renormalised,
    times `p.scaling`.
    """
    logits = logits.float()
    scores = torch.sigmoid(logits) if p.score_function == "sigmoid" else logits.softmax(-1)
    choice = scores if expert_bias is None else scores + expert_bias.float()  # (T, E)
    if p.n_group > 0:
        choice = limit_to_groups(choice, p.n_group, p.topk_group)
    topk_ids = choice.topk(p.top_k, dim=-1).indices  # (T, K)
    weights = scores.gather(1, topk_ids)  # (T, K)
    if p.renormalize and p.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, weights * p.scaling


def sum_logit_parts(logits: torch.Tensor) -> torch.Tensor:
    """Router logits as P partial sums (T, P, E), or (T, E) (one part) -> (T, E): the parts
    added in order (torch's sum over P; the one part itself, a view, when P = 1)."""
    if logits.dim() == 2:
        return logits
    return logits[:, 0] if logits.shape[1] == 1 else logits.sum(1)


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice (T, E) -> (T, E) with -inf outside each token's `topk_group` best groups.

    Experts form `n_group` contiguous groups; a group's score is the sum of its two best
    choice values.
    """
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)  # (T, G, E/G)
    best = min(2, e // n_group)
    group_scores = grouped.topk(best, dim=-1).values.sum(-1)  # (T, G)
    kept = group_scores.topk(topk_group, dim=-1).indices  # (T, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (T, G)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)


class Router(nn.Module):
    """`weight` (E, hidden); `expert_bias` (E,) biases selection only (sigmoid routing).

    The logits come out as P partial sums (T, P, E), whose sum over P in order
    (`sum_logit_parts`) is the logits: P = 3 for the split GEMM below, else 1.
    fp32 logits of bf16 activations on CUDA run on the tensor cores: the fp32 weight is split
    once into three bf16 parts whose sum is the weight to fp32 precision (`split_bf16`), one
    bf16 GEMM with fp32 output takes x against all three, and the three partial logits are
    left for the consumer to sum (the Triton router: inside its kernel, no launch of its
    own). Products of bf16 values are exact in fp32, so the logits are the fp32 product up
    to summation order, at a fraction of the cost of an fp32 GEMM (about 1 ms a round at 64
    blocks of LLaDA2.0-mini on an H200). Elsewhere: the plain fp32 GEMM."""

    def __init__(self, hidden_size: int, num_experts: int, expert_bias: bool,
                 fp32_logits: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if expert_bias else None
        self.register_parameter("expert_bias", bias)
        self.fp32_logits = fp32_logits
        self._split: tuple[int, int, torch.Tensor] | None = None  # weight's address, version, parts
        self.split_gemm = True  # cleared if this torch lacks the bf16 GEMM with fp32 output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> partial router logits (T, P, E), fp32 when `fp32_logits`."""
        if not self.fp32_logits:
            return F.linear(x, self.weight.to(x.dtype))[:, None]
        if self.splits(x):
            try:
                parts = torch.mm(x, self.parts().t(), out_dtype=torch.float32)  # (T, 3E)
                return parts.view(x.shape[0], 3, -1)
            except (RuntimeError, TypeError):
                self.split_gemm = False
        return F.linear(x.float(), self.weight.float())[:, None]

    def splits(self, x: torch.Tensor) -> bool:
        """Whether the logits of x come from the split bf16 GEMM (three partial logits)."""
        return (self.fp32_logits and self.split_gemm and x.is_cuda
                and x.dtype == torch.bfloat16 and x.dim() == 2)

    def parts(self) -> torch.Tensor:
        """(3E, hidden) bf16: the weight's split, made again whenever the weight changed."""
        key = version_key(self.weight)
        if self._split is None or self._split[:2] != key:
            self._split = (*key, split_bf16(self.weight.detach().float()).flatten(0, 1))
        return self._split[2]


def version_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, version) of a tensor: changes whenever it is replaced or written in place
    (a cache made from it is stale)."""
    return t.data_ptr(), 0 if t.is_inference() else t._version


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """w (...) fp32 -> (3, ...) bf16 parts, largest first, whose fp32 sum equals w up to
    rounding in its last bit (each part holds the next 8 bits of the mantissa)."""
    hi = w.bfloat16()
    rest = w - hi.float()
    mid = rest.bfloat16()
    lo = (rest - mid.float()).bfloat16()
    return torch.stack([hi, mid, lo])
