"""Mixture-of-experts: the router (grouped top-k), stacked expert weights, reference compute,
and the sparse MoE block of a decoder layer.

`route` and `moe_reference` are the plain-PyTorch oracles that fused kernels are tested against.
The router hands its logits on as P partial sums (T, P, E) (`sum_logit_parts` adds them), and
the MoE backends take them so (or (T, E) logits, one part): a backend adds them where it likes
(the Triton router, inside its kernel).
Two routings are in use: LLaDA2's (sigmoid scores, an expert bias for selection only,
group-limited top-k, renormalised, scaled, plus a shared expert) and Qwen3-MoE's, which SDAR-MoE
keeps (softmax over all experts, top-k, renormalised when `norm_topk_prob`, no shared expert).
Expert weights are stacked: `w13` (E, 2I, hidden) holds each expert's gate rows over its up
rows, `w2` (E, hidden, I) its down projection. How routed experts are computed is a backend
chosen by name (`MOE_BACKENDS`: "torch" and "dense" here, "triton" in dllm_serve.kernels), set on
a built model with `set_moe_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.layers.mlp import SwiGLUMLP, swiglu
from dllm_serve.layers.norm import RMSNorm
from dllm_serve.utils.registry import Registry

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


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Routed experts, grouped by expert, one SwiGLU per expert that received tokens.

    x (T, hidden), w13 (E, 2I, hidden), w2 (E, hidden, I), topk_ids (T, K) int64,
    topk_weights (T, K) -> (T, hidden) in x.dtype. Expert outputs are combined in fp32.
    """
    t, k = topk_ids.shape
    flat = topk_ids.flatten()  # (T*K,)
    order = flat.argsort(stable=True)  # (T*K,) assignment rows grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # host sync: reference only
    out = x.new_empty(t * k, x.shape[-1])  # (T*K, hidden)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = order[start:start + n]
            out[rows] = swiglu(x[rows // k], w13[expert], w2[expert])
            start += n
    combined = (out.view(t, k, -1).float() * topk_weights.float()[:, :, None]).sum(1)
    return combined.to(x.dtype)


def moe_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`moe_reference`'s function computed densely: every expert on every token, no host sync.

    Same arguments and result (up to rounding) as moe_reference. The routing weights are
    scattered into (T, E), zero for the experts a token did not choose, and scale each
    expert's SwiGLU activation before the down projection (linear, so the same sum as weighting
    the outputs); all experts then form one wide SwiGLU: two large matmuls, autograd-friendly,
    no data-dependent shapes. It costs E / K times the routed FLOPs: the right trade for
    training small models with few experts, not for serving large ones.
    """
    t, e, inter = x.shape[0], w13.shape[0], w2.shape[-1]
    weights = torch.zeros(t, e, dtype=torch.float32, device=x.device)
    weights.scatter_(1, topk_ids, topk_weights.float())  # (T, E)
    h = F.linear(x, w13.reshape(e * 2 * inter, -1)).view(t, e, 2, inter)  # (T, E, 2, I)
    act = F.silu(h[:, :, 0]) * h[:, :, 1] * weights[:, :, None].to(h.dtype)  # (T, E, I)
    down = w2.permute(1, 0, 2).reshape(w2.shape[1], e * inter)  # (hidden, E * I)
    return F.linear(act.reshape(t, e * inter), down).to(x.dtype)


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


# A shared expert of the routed experts' width: (gate_up (2I, hidden), down (hidden, I)).
SharedExpert = tuple[torch.Tensor, torch.Tensor]
# (x (T, hidden), router_logits (T, P, E) partial sums (`sum_logit_parts`) or (T, E),
# expert_bias (E,) | None, routing, w13, w2, addends, shared) -> (T, hidden): the routed
# experts' weighted sum, then the shared expert's output (when given), then each addend
# (T, hidden), added in order (a kernel backend may take fewer addends: "triton" two, or one
# beside a shared expert)
MoeImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, RoutingParams,
                    torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], SharedExpert | None],
                   torch.Tensor]
MOE_BACKENDS: Registry[MoeImpl] = Registry("MoE backend")
# The backends that compute a shared expert of the routed shape and dtype among the routed ones
# (one more expert in their GEMMs): the MoE block hands it to them instead of running it itself
FUSES_SHARED: set[str] = set()
# An RMSNorm's (weight (hidden,), eps)
NormParams = tuple[torch.Tensor, float]
# The backends that also take `norm=NormParams` and then return (out, RMSNorm(out)) (the next
# layer's input norm computed in their final pass: at a denoise round's few rows a launch of
# its own costs more than its bytes)
FUSES_NORM: set[str] = set()


def fuses_shared(shared: SharedExpert, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the shared expert can run as one more expert beside (w13, w2): the routed
    experts' shapes and dtypes (a kernel reads both through one pointer type)."""
    return all(s.shape == w.shape[1:] and s.dtype == w.dtype
               for s, w in zip(shared, (w13, w2), strict=True))


def add_in_order(y: torch.Tensor, addends: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """y + addends[0] + addends[1] + ..., one tensor add at a time (the oracle of the fused
    kernels' epilogue: each sum rounded to y's dtype)."""
    for a in addends:
        y = y + a
    return y


def with_shared(x: torch.Tensor, shared: SharedExpert | None,
                addends: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The addends after the routed sum: the shared expert's output (`swiglu`), if any, first."""
    return addends if shared is None else (swiglu(x, *shared), *addends)


@MOE_BACKENDS.register("torch")
def torch_moe(x: torch.Tensor, router_logits: torch.Tensor, expert_bias: torch.Tensor | None,
              p: RoutingParams, w13: torch.Tensor, w2: torch.Tensor,
              addends: tuple[torch.Tensor, ...] = (), shared: SharedExpert | None = None
              ) -> torch.Tensor:
    """The reference: `route` of the summed logits, then `moe_reference`, then the shared
    expert and the addends."""
    topk_ids, topk_weights = route(sum_logit_parts(router_logits), expert_bias, p)
    return add_in_order(moe_reference(x, w13, w2, topk_ids, topk_weights),
                        with_shared(x, shared, addends))


@MOE_BACKENDS.register("dense")
def dense_moe(x: torch.Tensor, router_logits: torch.Tensor, expert_bias: torch.Tensor | None,
              p: RoutingParams, w13: torch.Tensor, w2: torch.Tensor,
              addends: tuple[torch.Tensor, ...] = (), shared: SharedExpert | None = None
              ) -> torch.Tensor:
    """`route` of the summed logits, then `moe_dense` (training: no host sync,
    autograd-friendly), then the shared expert and the addends."""
    topk_ids, topk_weights = route(sum_logit_parts(router_logits), expert_bias, p)
    return add_in_order(moe_dense(x, w13, w2, topk_ids, topk_weights),
                        with_shared(x, shared, addends))


class Experts(nn.Module):
    """Stacked routed experts: `w13` (E, 2I, hidden) = [gate | up], `w2` (E, hidden, I)."""

    backend = "torch"  # a MOE_BACKENDS name; see set_moe_backend

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                expert_bias: torch.Tensor | None, routing: RoutingParams,
                addends: tuple[torch.Tensor, ...] = (), shared: SharedExpert | None = None,
                norm: NormParams | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden), router_logits (T, P, E) partial sums or (T, E) -> routed experts'
        weighted sum (T, hidden), plus the shared expert's output and the addends (T, hidden)
        in order. `norm` (only for a backend in FUSES_NORM): (that, RMSNorm(that))."""
        impl = MOE_BACKENDS.get(self.backend)
        if norm is None:
            return impl(x, router_logits, expert_bias, routing, self.w13, self.w2, addends,
                        shared)
        if self.backend not in FUSES_NORM:
            raise ValueError(f"MoE backend {self.backend!r} does not fuse a norm")
        return impl(x, router_logits, expert_bias, routing, self.w13, self.w2, addends, shared,
                    norm=norm)


def set_moe_backend(model: nn.Module, name: str) -> None:
    """Compute every `Experts` of `model` with backend `name` (unknown names raise)."""
    MOE_BACKENDS.get(name)
    for module in model.modules():
        if isinstance(module, Experts):
            module.backend = name


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE: routed experts weighted by the router, plus shared experts
    (unweighted) when `shared_intermediate` > 0. HF names: `gate` (the router, with
    `expert_bias` when asked), `experts` (stacked), `shared_experts`."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int,
                 routing: RoutingParams, expert_bias: bool, router_fp32: bool,
                 shared_intermediate: int = 0) -> None:
        super().__init__()
        self.routing = routing
        self.gate = Router(hidden_size, num_experts, expert_bias, router_fp32)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_experts = (SwiGLUMLP(hidden_size, shared_intermediate)
                               if shared_intermediate else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                norm: RMSNorm | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (T, hidden); with residual (T, hidden): residual + that. The
        shared experts' output and the residual are added in the experts' final pass
        (`add_in_order`: routed sum + shared, then + residual). With the Triton experts and a
        shared expert of the routed width, the shared expert is computed as one more routed
        expert (kernels/fused_moe.py). With `norm` (the next layer's input norm): (out,
        norm(out)), the norm in the experts' final pass when their backend fuses it."""
        shared = self._fused_shared()
        own = () if shared is not None or self.shared_experts is None else (
            self.shared_experts(x),)  # the shared experts run here unless fused
        addends = own + (() if residual is None else (residual,))
        logits, bias = self.gate(x), self.gate.expert_bias
        if norm is not None and self.experts.backend in FUSES_NORM:
            return self.experts(x, logits, bias, self.routing, addends, shared,
                                (norm.weight, norm.eps))
        out = self.experts(x, logits, bias, self.routing, addends, shared)
        return out if norm is None else (out, norm(out))

    def _fused_shared(self) -> SharedExpert | None:
        """The shared expert's weights when the experts' backend computes it among the routed
        ones (`FUSES_SHARED`; the routed experts' shapes and dtypes), else None."""
        s, e = self.shared_experts, self.experts
        if s is None or e.backend not in FUSES_SHARED:
            return None
        shared = (s.gate_up_proj.weight, s.down_proj.weight)
        return shared if fuses_shared(shared, e.w13, e.w2) else None
