"""The floor of one denoise round: the bytes it must move and the FLOPs it must do.

A round is one forward over B blocks of K tokens (T = B * K rows) followed by the step. The
fewest bytes: every weight the round touches read once (the routed experts that some token
chose, the embedding rows of the T tokens, everything else whole), each request's cached K/V
read once (prefix + own block) and the block's K/V written once. Logits need not reach memory
(a fused lm_head + argmax would keep them on chip), so they are not counted. FLOPs: 2 per
multiply-add of every matrix product (the experts once per chosen (token, expert)), and
attention's QK^T and PV over each query's visible keys (prefix + its own block).

The serial floor (`serial_floor_s`): the same bytes and FLOPs cut into the stages whose data
dependencies order them (the embedding; per layer its attention, then its MLP or experts; the
final norm and the LM head), each stage at the larger of its own bytes / bandwidth and FLOPs /
peak, summed. Inside a stage every product is taken as fused, its compute hidden under its
loads (or the reverse); across stages nothing overlaps. A round whose kernels run one after
another, however fused within a stage, is no faster. It is above the floor where
compute-bound stages (the attention's projections and the LM head at many rows) alternate with
memory-bound ones (the experts' weights): then no kernel order reaches the floor. Given the
rows the step reads (a LowConfidence round reads only its masked positions), the LM head's
product counts those rows only, as the fused head (kernels/lm_head.py) computes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dllm_serve.layers.moe import SparseMoeBlock
from dllm_serve.models import get_model_class
from dllm_serve.models.decoder import DecoderSpec

LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class RoundCost:
    weight_bytes: int
    kv_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def floor_s(self, bandwidth: float, peak_flops: float) -> float:
        """The larger of bytes / bandwidth and flops / peak: no version runs much faster."""
        return max(self.bytes / bandwidth, self.flops / peak_flops)

    def bound(self, bandwidth: float, peak_flops: float) -> str:
        return "memory" if self.bytes / bandwidth >= self.flops / peak_flops else "compute"


def meta_model(hf: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model of config.json `hf` on the meta device, in `dtype`: its shapes for the
    counts below, no memory."""
    with torch.device("meta"):
        return get_model_class(hf["architectures"][0])(hf).to(dtype)


def param_bytes(name: str, p: nn.Parameter, tokens: int,
                experts_touched: dict[int, int]) -> int:
    """Bytes of one weight a round of `tokens` rows reads: a routed expert tensor only for its
    experts chosen, an embedding only for its rows read."""
    size = p.numel() * p.element_size()
    if name.endswith(("experts.w13", "experts.w2")):
        return size // p.shape[0] * experts_touched[layer_of(name)]
    if "embed_tokens" in name:
        return tokens * p.shape[1] * p.element_size()
    return size


def weight_bytes(model: nn.Module, tokens: int, experts_touched: dict[int, int]) -> int:
    """Bytes of the weights a round of `tokens` rows reads; experts_touched: MoE layer ->
    distinct experts chosen in it."""
    return sum(param_bytes(name, p, tokens, experts_touched)
               for name, p in model.named_parameters())


def layer_of(name: str) -> int:
    return int(LAYER.search(name).group(1))  # type: ignore[union-attr]


def kv_bytes(cfg: DecoderSpec, prefixes: list[int], block: int, itemsize: int) -> int:
    """Every layer reads each request's K and V for prefix + block and writes the block's."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    read = sum(p + block for p in prefixes)
    return per_token * (read + block * len(prefixes))


def param_flops(name: str, p: nn.Parameter, top_k: int, tokens: int) -> int:
    """FLOPs of one weight's product: a 2-D weight once per token (embeddings: none), a routed
    expert tensor once per (token, chosen expert)."""
    if p.dim() < 2 or "embed_tokens" in name:
        return 0
    per_token = 2 * p.numel()
    if name.endswith(("experts.w13", "experts.w2")):
        per_token = per_token // p.shape[0] * top_k
    return tokens * per_token


def matmul_flops(model: nn.Module, top_k: int, tokens: int) -> int:
    """Dense products: every 2-D weight once per token (embeddings excluded); routed experts
    once per (token, chosen expert)."""
    return sum(param_flops(name, p, top_k, tokens) for name, p in model.named_parameters())


def attention_flops(cfg: DecoderSpec, prefixes: list[int], block: int) -> int:
    """QK^T and PV: 4 * heads * head_dim per (query, visible key), over every layer."""
    pairs = sum(block * (p + block) for p in prefixes)
    return 4 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers


def routed_top_k(model: nn.Module) -> int:
    """Experts each token is routed to (0 for a dense model)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return blocks[0].routing.top_k if blocks else 0


def round_cost(model: nn.Module, prefixes: list[int], block: int,
               experts_touched: dict[int, int], itemsize: int) -> RoundCost:
    """The floor of a round of one block per request over `prefixes`, for any DecoderLM."""
    tokens, spec = block * len(prefixes), model.spec
    return RoundCost(
        weight_bytes=weight_bytes(model, tokens, experts_touched),
        kv_bytes=kv_bytes(spec, prefixes, block, itemsize),
        flops=matmul_flops(model, routed_top_k(model), tokens)
        + attention_flops(spec, prefixes, block))


def stage_of(name: str) -> str:
    """The stage of a round that a parameter's product runs in: "embed", "head" (the final
    norm and the LM head), "<layer>.attention" (its input norm and self_attn) or
    "<layer>.mlp" (the rest of the layer: post-attention norm, router, experts, MLP)."""
    if "embed_tokens" in name:
        return "embed"
    match = LAYER.search(name)
    if match is None:
        return "head"
    part = "attention" if "self_attn" in name or "input_layernorm" in name else "mlp"
    return f"{match.group(1)}.{part}"


def stage_costs(model: nn.Module, prefixes: list[int], block: int,
                experts_touched: dict[int, int], itemsize: int,
                asked_rows: int | None = None) -> dict[str, RoundCost]:
    """`round_cost` cut into stages (`stage_of`); each layer's attention stage also holds its
    share of the K/V bytes and the attention FLOPs. The stages' sums are round_cost's, but
    for `asked_rows` (the rows the step reads): the LM head's FLOPs over those rows only."""
    tokens, spec, top_k = block * len(prefixes), model.spec, routed_top_k(model)
    parts: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        stage = stage_of(name)
        rows = asked_rows if stage == "head" and asked_rows is not None else tokens
        acc = parts.setdefault(stage, [0, 0, 0])
        acc[0] += param_bytes(name, p, tokens, experts_touched)
        acc[2] += param_flops(name, p, top_k, rows)
    kv, attention = kv_bytes(spec, prefixes, block, itemsize), attention_flops(
        spec, prefixes, block)
    for layer in range(spec.num_layers):  # every layer reads and computes the same share
        acc = parts.setdefault(f"{layer}.attention", [0, 0, 0])
        acc[1] += kv // spec.num_layers
        acc[2] += attention // spec.num_layers
    return {stage: RoundCost(*acc) for stage, acc in parts.items()}


def serial_floor_s(stages: dict[str, RoundCost], bandwidth: float, peak_flops: float) -> float:
    """The floor of a round whose stages run one after another (module docstring)."""
    return sum(cost.floor_s(bandwidth, peak_flops) for cost in stages.values())
