"""The bucket tables: every size a bucketed forward runs at, in blocks of block_size tokens.

A forward is padded up to the smallest bucket that holds it (model/graph_layout.py), and every
bucket is compiled (and captured) at startup, so these tables are the whole set of shapes the
kernels ever see:
  denoise: DENOISE_BUCKETS up to the most active blocks, steps of 64 past 256, the max itself;
  prefill: token counts that are powers of two up to 256, then steps of 256 up to the prefill
           budget (--chunked-prefill-size in whole blocks), each rounded up to whole blocks.
The scheduler cuts prefills by `prefill_budget` (this module has no heavy imports for it).
"""

from __future__ import annotations

DENOISE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DENOISE_STEP = 64  # denoise buckets past the table: multiples of this
PREFILL_POW2_TOKENS = 256  # prefill buckets: powers of two up to this many tokens,
PREFILL_STEP_TOKENS = 256  # then multiples of this


def prefill_budget(chunked_prefill_size: int, block_size: int) -> int:
    """The most tokens of one prefill forward: --chunked-prefill-size in whole blocks (at least
    one). The scheduler cuts prefills by it; the runner's prefill buckets reach it."""
    return max(block_size, chunked_prefill_size // block_size * block_size)


def denoise_buckets(max_blocks: int) -> list[int]:
    """Denoise bucket sizes, in active blocks, up to max_blocks (always one of them)."""
    past = range(DENOISE_BUCKETS[-1] + DENOISE_STEP, max_blocks, DENOISE_STEP)
    return sorted({b for b in (*DENOISE_BUCKETS, *past) if b < max_blocks} | {max_blocks})


def prefill_buckets(block_size: int, max_tokens: int) -> list[int]:
    """Prefill bucket sizes, in blocks, holding every whole-block token count up to max_tokens
    (a multiple of block_size, e.g. `prefill_budget`)."""
    tokens = [1 << i for i in range(PREFILL_POW2_TOKENS.bit_length())]
    tokens += range(PREFILL_POW2_TOKENS + PREFILL_STEP_TOKENS, max_tokens, PREFILL_STEP_TOKENS)
    blocks = {-(-t // block_size) for t in tokens if t < max_tokens}
    return sorted(blocks | {max_tokens // block_size})


def pick_bucket(num_blocks: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding num_blocks blocks; None when none does."""
    return next((b for b in buckets if b >= num_blocks), None)
