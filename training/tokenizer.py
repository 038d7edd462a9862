"""Train the small model's tokenizer: byte-level BPE over the training text, LLaDA2's specials.

The pre-tokenizer splits every digit on its own (so numbers are spelled digit by digit, the
same way whatever their size) and then applies GPT-2's byte-level split; the BPE merges are
learned from the training text with the `tokenizers` library, over all 256 byte symbols (no
unknown token can occur). LLaDA2's special and role tokens are appended after the learned
vocabulary, like the real model's (whose specials sit at the end of its vocabulary).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dllm_serve.tools.llada2_format import SPECIAL_TOKENS, add_special_tokens


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` ids (specials included) if the text allows."""
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    add_special_tokens(tok)
    return tok


def first_special_id(tok: Tokenizer) -> int:
    """Ids below this are ordinary text tokens; the special tokens follow them."""
    return min(tok.token_to_id(t) for t in SPECIAL_TOKENS)
