"""Training text: GSM8K train + generated word problems, in the GSM8K prompt format, tokenized.

Every example is a prompt and a completion, as the engine will see them:
    prompt     = "Question: {q}\\nAnswer:"   (sometimes preceded by k solved examples,
                 "Question: {q_i}\\nAnswer: {a_i}\\n\\n" each, as in the few-shot GSM8K protocol)
    completion = " {worked answer ending in the final number}"
and the token sequence is prompt + completion + <|endoftext|> repeated up to the end of the block
(at least one). The loss only ever falls on completion positions (see objective.py).

A `TokenPool` holds every sequence of a pool flat in one array, padded to whole blocks; it is a
pure function of (DataConfig, tokenizer, GSM8K rows), so a resumed run rebuilds the same pool.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dllm_serve.tools.llada2_format import EOS
from training.problems import QA, generate_problems

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataConfig:
    num_generated: int = 300_000  # generated problems in the training pool
    gsm8k_fraction: float = 0.15  # share of GSM8K examples in the pool (0: none)
    fewshot_fraction: float = 0.1  # examples whose prompt starts with solved examples
    max_shots: int = 5
    max_len: int = 1536  # longer sequences are dropped
    gsm8k_holdout: int = 200  # last rows of GSM8K train kept for the eval loss
    num_eval_generated: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.gsm8k_fraction < 1.0:
            raise ValueError(f"gsm8k_fraction must be in [0, 1), got {self.gsm8k_fraction}")
        if not 0.0 <= self.fewshot_fraction <= 1.0:
            raise ValueError(f"fewshot_fraction must be in [0, 1], got {self.fewshot_fraction}")

    @property
    def eval_seed(self) -> int:
        """Seed of the held-out generated problems (distinct from the training seed)."""
        return self.seed + 1_000_003


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str


@dataclass
class TokenPool:
    """n sequences, flat. Sequence i is ids[starts[i] : starts[i] + lens[i]]; lens[i] is a
    multiple of the block size; positions [prompt_lens[i], lens[i]) are the completion."""

    ids: np.ndarray  # (sum(lens),) int32
    starts: np.ndarray  # (n,) int64
    lens: np.ndarray  # (n,) int64
    prompt_lens: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.lens)

    def sequence(self, i: int) -> np.ndarray:
        return self.ids[self.starts[i]: self.starts[i] + self.lens[i]]

    @property
    def num_tokens(self) -> int:
        return int(self.lens.sum())


def read_gsm8k(path: str | Path) -> list[QA]:
    """GSM8K rows ({"question", "answer"} per line), answers verbatim (ending '#### N')."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [QA(r["question"], r["answer"]) for r in rows]


def format_prompt(shots: list[QA], qa: QA) -> str:
    solved = "".join(f"Question: {s.question}\nAnswer: {s.answer}\n\n" for s in shots)
    return f"{solved}Question: {qa.question}\nAnswer:"


def make_examples(items: list[QA], copies: int, cfg: DataConfig, rng: random.Random
                  ) -> list[Example]:
    """Each item `copies` times; a `fewshot_fraction` of them behind 1..max_shots other items."""
    out = []
    for _ in range(copies):
        for qa in items:
            shots: list[QA] = []
            if len(items) > 1 and rng.random() < cfg.fewshot_fraction:
                shots = rng.sample(items, min(len(items) - 1, rng.randint(1, cfg.max_shots)))
                shots = [s for s in shots if s is not qa]
            out.append(Example(format_prompt(shots, qa), " " + qa.answer))
    return out


def training_examples(cfg: DataConfig, gsm8k: list[QA]) -> list[Example]:
    """The training pool: every generated problem once, GSM8K rows (minus the held-out tail)
    repeated to make up `gsm8k_fraction` of the pool."""
    rng = random.Random(cfg.seed)
    examples = make_examples(generate_problems(cfg.num_generated, cfg.seed), 1, cfg, rng)
    train_rows = gsm8k[:-cfg.gsm8k_holdout] if cfg.gsm8k_holdout else gsm8k
    if train_rows and cfg.gsm8k_fraction > 0:
        want = cfg.gsm8k_fraction / (1 - cfg.gsm8k_fraction) * len(examples)
        examples += make_examples(train_rows, max(1, round(want / len(train_rows))), cfg, rng)
    return examples


def eval_examples(cfg: DataConfig, gsm8k: list[QA]) -> list[Example]:
    """Held-out examples for the eval loss: problems from `eval_seed` and the GSM8K tail."""
    rng = random.Random(cfg.eval_seed)
    items = generate_problems(cfg.num_eval_generated, cfg.eval_seed)
    if cfg.gsm8k_holdout:
        items += gsm8k[-cfg.gsm8k_holdout:]
    return make_examples(items, 1, cfg, rng)


def tokenizer_corpus(examples: list[Example], limit: int = 100_000) -> list[str]:
    """The texts the BPE is trained on: a deterministic spread of the training examples."""
    step = max(1, len(examples) // limit)
    return [e.prompt + e.completion for e in examples[::step]]


def tokenize_pool(examples: list[Example], tok: Tokenizer, block_size: int,
                  max_len: int) -> TokenPool:
    """Tokenize prompts and completions, append EOS up to the block end, drop long ones."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    prompts = encode([e.prompt for e in examples], add_special_tokens=False)
    completions = encode([e.completion for e in examples], add_special_tokens=False)
    eos = tok.token_to_id(EOS)
    seqs, prompt_lens = [], []
    for p, c in zip(prompts, completions, strict=True):
        n = len(p.ids) + len(c.ids)
        total = (n // block_size + 1) * block_size  # room for at least one EOS
        if total <= max_len:
            seqs.append(p.ids + c.ids + [eos] * (total - n))
            prompt_lens.append(len(p.ids))
    dropped = len(examples) - len(seqs)
    if not seqs:
        raise ValueError(f"every one of the {len(examples)} examples is longer than max_len "
                         f"{max_len} tokens")
    if dropped:
        logger.info("dropped %d of %d examples longer than %d tokens", dropped, len(examples),
                    max_len)
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    ids = np.concatenate([np.array(s, dtype=np.int32) for s in seqs])
    return TokenPool(ids, starts, lens, np.array(prompt_lens, dtype=np.int64))
