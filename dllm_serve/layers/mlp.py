"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused in one weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x (N, hidden), gate_up (2I, hidden) = [gate rows | up rows], down (hidden, I).

    Returns (N, hidden).
    """
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # (N, I) each
    return F.linear(F.silu(gate) * up, down)


class SwiGLUMLP(nn.Module):
    """Bias-free SwiGLU MLP; `gate_up_proj.weight` (2I, hidden) = HF gate_proj over up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); with residual (T, hidden): residual + that."""
        y = swiglu(x, self.gate_up_proj.weight, self.down_proj.weight)
        return y if residual is None else residual + y
