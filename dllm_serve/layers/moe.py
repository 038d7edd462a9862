"""Mixture-of-experts: stacked expert weights, reference compute, the MoE backends and the sparse
MoE block of a decoder layer (its router: layers/moe_router.py).

`moe_reference` (with `route`) is the plain-PyTorch oracle that fused kernels are tested
against. The router hands its logits on as P partial sums (T, P, E), and the MoE backends take
them so (or (T, E) logits, one part): a backend adds them where it likes (the Triton router,
inside its kernel). LLaDA2 adds a shared expert to the routed ones; SDAR-MoE has none.
Expert weights are stacked: `w13` (E, 2I, hidden) holds each expert's gate rows over its up
rows, `w2` (E, hidden, I) its down projection. How routed experts are computed is a backend
chosen by name (`MOE_BACKENDS`: "torch" and "dense" here, "triton" in dllm_serve.kernels), set on
a built model with `set_moe_backend`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.layers.mlp import SwiGLUMLP, swiglu
from dllm_serve.layers.moe_router import Router, RoutingParams, route, sum_logit_parts
from dllm_serve.layers.norm import RMSNorm
from dllm_serve.utils.registry import Registry


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
