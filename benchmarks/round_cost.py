"""The floor of one denoise round: the bytes it must move and the FLOPs it must do.

A round is one forward over B blocks of K tokens (T = B * K rows) followed by the step. The
fewest bytes: every weight the round touches read once (the routed experts that some token
chose, the embedding rows of the T tokens, everything else whole), each request's cached K/V
read once (prefix + own block) and the block's K/V written once. Logits need not reach memory
(a fused lm_head + argmax would keep them on chip), so they are not counted. FLOPs: 2 per
multiply-add of every matrix product (the experts once per chosen (token, expert)), and
attention's QK^T and PV over each query's visible keys (prefix + its own block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from dllm_serve.layers.moe import SparseMoeBlock
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


def weight_bytes(model: nn.Module, tokens: int, experts_touched: dict[int, int]) -> int:
    """Bytes of the weights a round of `tokens` rows reads; experts_touched: MoE layer ->
    distinct experts chosen in it."""
    total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith(("experts.w13", "experts.w2")):
            layer = int(LAYER.search(name).group(1))  # type: ignore[union-attr]
            total += size // p.shape[0] * experts_touched[layer]
        elif "embed_tokens" in name:
            total += tokens * p.shape[1] * p.element_size()
        else:
            total += size
    return total


def kv_bytes(cfg: DecoderSpec, prefixes: list[int], block: int, itemsize: int) -> int:
    """Every layer reads each request's K and V for prefix + block and writes the block's."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    read = sum(p + block for p in prefixes)
    return per_token * (read + block * len(prefixes))


def matmul_flops(model: nn.Module, top_k: int, tokens: int) -> int:
    """Dense products: every 2-D weight once per token (embeddings excluded); routed experts
    once per (token, chosen expert)."""
    total = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:
            continue
        per_token = 2 * p.numel()
        if name.endswith(("experts.w13", "experts.w2")):
            per_token = per_token // p.shape[0] * top_k
        total += tokens * per_token
    return total


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
