"""Expert load balancing without an auxiliary loss, through the routers' `expert_bias`.

LLaDA2's router selects experts by `sigmoid(logits) + expert_bias` while weighting them by the
unbiased scores; the bias exists to balance the load (the "aux-loss-free" method: after each
optimizer step, raise the bias of under-used experts and lower that of over-used ones by a
fixed rate). Loads are counted with forward hooks on the routers while `counting` is on, on
the device and without a host sync.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_serve.layers.moe_router import Router, route, sum_logit_parts


class ExpertBalancer:
    """Counts per-layer expert loads during training forwards; `update()` nudges the biases."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = rate
        self.counting = False
        self.routers: list[Router] = []
        self.loads: list[torch.Tensor] = []
        self.last_ratio: torch.Tensor | None = None  # max / mean load of the last update
        for module in model.modules():
            router = getattr(module, "gate", None)
            if isinstance(router, Router) and router.expert_bias is not None:
                self._watch(router, module.routing)

    def _watch(self, router: Router, routing: object) -> None:
        load = torch.zeros_like(router.expert_bias, dtype=torch.float32)
        self.routers.append(router)
        self.loads.append(load)

        def hook(_: nn.Module, args: tuple[torch.Tensor], parts: torch.Tensor) -> None:
            if self.counting:
                with torch.no_grad():
                    ids, _ = route(sum_logit_parts(parts), router.expert_bias,
                                   routing)  # type: ignore[arg-type]
                    load.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten(),
                                                                      dtype=torch.float32))

        router.register_forward_hook(hook)

    @torch.no_grad()
    def update(self) -> None:
        """bias += rate * sign(mean load - load), per layer; then reset the counts."""
        if self.loads:
            self.last_ratio = torch.stack([x.max() / x.mean().clamp(min=1) for x in self.loads])
        for router, load in zip(self.routers, self.loads, strict=True):
            bias = router.expert_bias
            assert bias is not None
            bias += self.rate * torch.sign(load.mean() - load).to(bias.dtype)
            load.zero_()

    def imbalance(self) -> float:
        """Busiest expert's load over the mean load at the last update, worst layer (1 = even)."""
        return 1.0 if self.last_ratio is None else self.last_ratio.max().item()
