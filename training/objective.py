"""The block-diffusion training objective (BD3LM-style) with a token-to-token corruption term.

Layout of one training row (R rows per batch, all on the device):
    [ clean sequence, L tokens | noised copy of the completion blocks, Ln tokens ]
The noised copy starts at the block that holds the first completion token and keeps the
absolute positions of the tokens it copies (RoPE sees the same positions in both halves).
Attention (`bd3_mask`), per row, with b(.) the block index of a position:
    clean  query -> clean  key   iff b(k) <= b(q)   (block-causal, exactly the engine's cache)
    noised query -> clean  key   iff b(k) <  b(q)   (the clean blocks before its own)
    noised query -> noised key   iff b(k) == b(q)   (its own block, bidirectionally)
    clean  query -> noised key   never
so the noised block b sees what the engine's block b sees: the committed KV of every earlier
block and itself. Padding keys are seen by nobody; a padding query sees only itself.

Noise, per noised block: t ~ U(eps, 1) and ceil(t * n) of its n completion positions become
<|mask|> (chosen uniformly); of the rest, a fraction c ~ U(0, corrupt_max) is replaced by a
random token (half uniform over the text vocabulary, half a token drawn from the batch, i.e.
a plausible one). Prompt positions inside a block are left as they are (the engine's first
block starts with the prompt's tail). Logits are not shifted: row j predicts token j.

Loss = mean CE over masked positions (M2T) + t2t_weight * mean CE over the other completion
positions of the noised blocks, whose target is the original token (T2T: fix the corrupted
ones, keep the rest). Plain means rather than the 1/t-weighted ELBO: both are minimised by the
same per-position conditionals, the ELBO's weights only trade capacity between noise levels and
make the gradient much noisier (a block with t near eps would weigh 1/eps); the plain mean is
what confidence-based decoding needs, good predictions at every mask ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.layers.attention import block_causal
from training.attention import TrainingAttention, training_batch
from training.batches import HostBatch

CLEAN, NOISED, PAD = 0, 1, 2


@dataclass(frozen=True)
class NoiseConfig:
    eps: float = 1e-3  # t ~ U(eps, 1): fraction of a block's completion positions masked
    corrupt_max: float = 0.2  # c ~ U(0, corrupt_max): fraction of unmasked ones replaced
    plausible_fraction: float = 0.5  # replacements drawn from the batch's own tokens
    t2t_weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"eps must be in (0, 1), got {self.eps}")
        if not 0.0 <= self.corrupt_max <= 1.0:
            raise ValueError(f"corrupt_max must be in [0, 1], got {self.corrupt_max}")


@dataclass
class Layout:
    """ids, positions, kind: (R, N) with N = L + Ln; kind in {CLEAN, NOISED, PAD}.
    trainable: (R, Ln) completion positions of the noised copy (where the loss may fall)."""

    ids: torch.Tensor
    positions: torch.Tensor
    kind: torch.Tensor
    trainable: torch.Tensor
    clean_len: int

    @property
    def targets(self) -> torch.Tensor:
        """(R, Ln) the clean tokens the noised copy must recover."""
        return self.ids[:, self.clean_len:]


@dataclass
class Noised:
    """The layout's ids after noise (R, N) and, over the noised copy (R, Ln), which trainable
    positions were masked, corrupted (replaced by a different token) or kept."""

    ids: torch.Tensor
    masked: torch.Tensor
    corrupted: torch.Tensor
    kept: torch.Tensor


def build_layout(batch: HostBatch, block_size: int) -> Layout:
    """The (R, L + Ln) layout of a device batch (see the module docstring)."""
    clean, lens, prompt_lens = batch.clean, batch.lens, batch.prompt_lens  # (R, L), (R,), (R,)
    rows, length = clean.shape
    dev = clean.device
    j = torch.arange(length, device=dev)[None, :].expand(rows, -1)  # (R, L)
    first = prompt_lens // block_size * block_size  # (R,) start of the first noised block
    pos = first[:, None] + torch.arange(batch.noised_len, device=dev)[None, :]  # (R, Ln)
    valid = pos < lens[:, None]
    pos = torch.where(valid, pos, 0)
    copy = clean.gather(1, pos)  # (R, Ln)
    kind = torch.cat([torch.where(j < lens[:, None], CLEAN, PAD),
                      torch.where(valid, NOISED, PAD)], dim=1)
    return Layout(ids=torch.cat([clean, copy], dim=1), positions=torch.cat([j, pos], dim=1),
                  kind=kind, trainable=valid & (pos >= prompt_lens[:, None]),
                  clean_len=length)


def bd3_mask(kind: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """kind, positions (R, N) -> (R, 1, N, N) bool: query row may attend to key column."""
    qk, kk = kind[:, :, None], kind[:, None, :]  # (R, N, 1), (R, 1, N)
    qb = torch.div(positions, block_size, rounding_mode="floor")
    same = qb[:, :, None] == qb[:, None, :]
    causal = block_causal(positions[:, :, None], positions[:, None, :], block_size)
    clean_key = (kk == CLEAN) & (((qk == CLEAN) & causal) | ((qk == NOISED) & causal & ~same))
    noised_key = (kk == NOISED) & (qk == NOISED) & same
    eye = torch.eye(kind.shape[1], dtype=torch.bool, device=kind.device)[None]
    return (clean_key | noised_key | ((qk == PAD) & eye))[:, None]


def apply_noise(layout: Layout, cfg: NoiseConfig, block_size: int, mask_id: int,
                num_text_tokens: int, gen: torch.Generator | None = None) -> Noised:
    """Mask and corrupt the noised copy, block by block (see the module docstring)."""
    target = layout.targets  # (R, Ln)
    rows, ln = target.shape
    shape = (rows, ln // block_size, block_size)

    def rand(*size: int) -> torch.Tensor:
        return torch.rand(size, generator=gen, device=target.device)

    trainable = layout.trainable.view(shape)
    t = cfg.eps + (1 - cfg.eps) * rand(*shape[:2], 1)
    n_mask = torch.ceil(t * trainable.sum(-1, keepdim=True))
    keys = rand(*shape).masked_fill(~trainable, 2.0)
    rank = keys.argsort(-1).argsort(-1)
    masked = trainable & (rank < n_mask)
    c = cfg.corrupt_max * rand(*shape[:2], 1)
    corrupt = trainable & ~masked & (rand(*shape) < c)
    uniform = (rand(*shape) * num_text_tokens).long().clamp_(max=num_text_tokens - 1)
    flat = layout.ids[:, :layout.clean_len].reshape(-1)
    drawn = flat[(rand(*shape) * flat.numel()).long().clamp_(max=flat.numel() - 1)]
    repl = torch.where(rand(*shape) < cfg.plausible_fraction, drawn, uniform)
    orig = target.view(shape)
    new = torch.where(masked, mask_id, torch.where(corrupt, repl, orig))
    corrupted = corrupt & (repl != orig)
    ids = torch.cat([layout.ids[:, :layout.clean_len], new.view(rows, ln)], dim=1)
    view = (rows, ln)
    return Noised(ids, masked.view(view), corrupted.view(view),
                  (trainable & ~masked & ~corrupted).view(view))


@dataclass
class LossParts:
    """Scalar tensors (no host sync until read): the loss and its terms."""

    loss: torch.Tensor
    m2t: torch.Tensor  # mean CE over masked positions
    t2t: torch.Tensor  # mean CE over unmasked completion positions (corrupted + kept)
    ce: torch.Tensor  # (R, Ln) per-position CE, for metrics
    logits_argmax: torch.Tensor  # (R, Ln)


def diffusion_loss(logits: torch.Tensor, layout: Layout, noised: Noised,
                   cfg: NoiseConfig) -> LossParts:
    """logits (R * Ln, V) fp32 over the noised copy -> LossParts."""
    target = layout.targets
    ce = F.cross_entropy(logits, target.reshape(-1), reduction="none").view(target.shape)
    m2t = _masked_mean(ce, noised.masked)
    t2t = _masked_mean(ce, noised.corrupted | noised.kept)
    argmax = logits.detach().argmax(-1).view(target.shape)
    return LossParts(m2t + cfg.t2t_weight * t2t, m2t, t2t, ce.detach(), argmax)


def _masked_mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    return (values * where).sum() / where.sum().clamp(min=1)


def metrics(parts: LossParts, layout: Layout, noised: Noised) -> dict[str, float]:
    """Host-side numbers for logging (syncs): loss terms and per-category accuracy."""
    right = parts.logits_argmax == layout.targets
    out = {"loss": parts.loss.item(), "m2t": parts.m2t.item(), "t2t": parts.t2t.item()}
    for name, where in (("acc_masked", noised.masked), ("acc_fixed", noised.corrupted),
                        ("acc_kept", noised.kept)):
        out[name] = _masked_mean(right.float(), where).item()
    return out


def forward_loss(model: nn.Module, attn: TrainingAttention, batch: HostBatch,
                 noise: NoiseConfig, mask_id: int, num_text_tokens: int,
                 gen: torch.Generator | None = None) -> tuple[LossParts, Layout, Noised]:
    """One training forward on a device batch: layout, noise, mask, model, loss."""
    block_size = batch.block_size
    layout = build_layout(batch, block_size)
    noised = apply_noise(layout, noise, block_size, mask_id, num_text_tokens, gen)
    mask = bd3_mask(layout.kind, layout.positions, block_size)
    fb = training_batch(noised.ids, layout.positions, mask, attn, block_size)
    rows = noised.ids.shape[0]
    hidden = model(fb).view(rows, -1, model.config.hidden_size)[:, layout.clean_len:]  # (R, Ln, d)
    logits = model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))  # (R * Ln, V) fp32
    return diffusion_loss(logits, layout, noised, noise), layout, noised
