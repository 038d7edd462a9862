"""A small byte-level BPE tokenizer in LLaDA2's file format, built deterministically offline.

The vocabulary is the 256 byte tokens (ids 0..255, by byte value), then merges learned from a
built-in English + arithmetic text (ties broken by the pair itself, so the result never varies),
then LLaDA2's special tokens. No real vocabulary is involved: ids differ from the real model's,
and config.json names the tiny model's own special ids.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dllm_serve.tools.llada2_format import add_special_tokens

_PROSE = """\
The quick brown fox jumps over the lazy dog. A farmer has some hens, and every morning the hens
lay eggs. She sells the eggs at the market for two dollars each. How many dollars does she make
in a week? Let us think step by step. First we count the eggs, then we multiply by the price.
The answer is the total amount of money. Tom reads a book with many pages. He reads the same
number of pages every day, and he finishes the book at the end of the month. What is the number
of pages that he reads in one day? There are three boxes and each box holds twelve apples.
Questions and answers: the model writes the answer after thinking about the question.
"""


def training_text() -> str:
    """English prose plus a deterministic block of small sums and products."""
    sums = [f"{a} + {b} = {a + b}." for a in range(3, 60, 7) for b in range(2, 40, 9)]
    products = [f"{a} * {b} = {a * b}." for a in range(2, 13, 3) for b in range(3, 15, 4)]
    return _PROSE + " ".join(sums) + "\n" + " ".join(products) + "\n"


def bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable-character map of byte-level BPE (as `ByteLevel.alphabet()`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return dict(sorted(mapping.items()))


def learn_merges(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE over pre-tokenised words: the most frequent pair (then the smallest) wins."""
    splits = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(splits[word]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        splits = {w: _merge(parts, best) for w, parts in splits.items()}
    return merges


def _merge(parts: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(parts):
        if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
            out.append(parts[i] + parts[i + 1])
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return out


def build_tokenizer(num_merges: int = 200) -> Tokenizer:
    """Byte-level BPE: 256 bytes + learned merges + LLaDA2's special tokens, in that order."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(training_text()))
    merges = learn_merges(words, num_merges)
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    add_special_tokens(tok)
    return tok
