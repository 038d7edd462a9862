"""Everything a run prepares before its first step: device, data pools, tokenizer, config.json.

The pools are pure functions of (TrainConfig.data, GSM8K rows, tokenizer); a resumed run loads
the tokenizer from its train state instead of training a new one, so it rebuilds the very same
pools (checked through `fingerprint`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from dllm_serve.tools.llada2_format import EOS, llada2_config
from training.config import PRESETS, RunConfig, TrainConfig
from training.data import (
    TokenPool,
    eval_examples,
    read_gsm8k,
    tokenize_pool,
    tokenizer_corpus,
    training_examples,
)
from training.tokenizer import first_special_id, train_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    device: torch.device
    tok: Tokenizer
    hf_config: dict[str, Any]  # the checkpoint's config.json
    pool: TokenPool
    eval_pool: TokenPool
    mask_id: int
    eos_id: int
    num_text_tokens: int  # ids [0, num_text_tokens) are text; the special tokens follow

    @property
    def fingerprint(self) -> list[int]:
        return [len(self.pool), self.pool.num_tokens, len(self.eval_pool)]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def prepare(cfg: TrainConfig, run: RunConfig, tok: Tokenizer | None) -> Prepared:
    """Read GSM8K, build the example pools, train (or reuse) the tokenizer, tokenize."""
    start = time.monotonic()
    gsm8k = read_gsm8k(run.data_path) if run.data_path is not None else []
    examples = training_examples(cfg.data, gsm8k)
    if tok is None:
        tok = train_tokenizer(tokenizer_corpus(examples), cfg.vocab_size)
    hf = llada2_config(tok, PRESETS[cfg.preset], {**cfg.overrides, "dtype": cfg.dtype})
    bs, max_len = cfg.block_size, cfg.data.max_len
    pool = tokenize_pool(examples, tok, bs, max_len)
    eval_pool = tokenize_pool(eval_examples(cfg.data, gsm8k), tok, bs, max_len)
    logger.info("data ready in %.1f s: %d GSM8K rows, %d training sequences (%.1fM tokens), "
                "%d held-out, vocab %d", time.monotonic() - start, len(gsm8k), len(pool),
                pool.num_tokens / 1e6, len(eval_pool), tok.get_vocab_size())
    return Prepared(resolve_device(run.device), tok, hf, pool, eval_pool,
                    mask_id=hf["mask_token_id"], eos_id=tok.token_to_id(EOS),
                    num_text_tokens=first_special_id(tok))

