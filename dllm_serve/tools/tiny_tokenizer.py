"""Small byte-level BPE tokenizers in real models' file formats, built deterministically offline.

`build_tokenizer` (LLaDA2): the 256 byte tokens (ids 0..255, by byte value), then merges learned
from a built-in English + arithmetic text (ties broken by the pair itself, so the result never
varies), then LLaDA2's special tokens; ids differ from the real model's, and config.json names
the tiny model's own special ids.

`build_qwen_tokenizer` (SDAR): Qwen2's shape, so that special tokens sit at their real ids:
Qwen's pre-tokenizer split, the same byte tokens and learned merges, then filler tokens (made-up
lower-case words, never produced by encoding, decoded as themselves) up to id 151642, then
Qwen3's special tokens at 151643..151668 and SDAR's `<|MASK|>` at 151669. No real vocabulary is
involved: ordinary text encodes to other ids than with the real tokenizer.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from dllm_serve.tools.llada2_format import add_special_tokens
from dllm_serve.tools.sdar_format import FIRST_SPECIAL_ID, QWEN_SPECIAL_TOKENS

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


def byte_level_bpe(pre: pre_tokenizers.PreTokenizer, num_merges: int) -> tuple[
        dict[str, int], list[tuple[str, str]]]:
    """Byte tokens then the merges learned over `pre`'s split of the training text."""
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(training_text()))
    merges = learn_merges(words, num_merges)
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab, merges


def build_tokenizer(num_merges: int = 200) -> Tokenizer:
    """Byte-level BPE: 256 bytes + learned merges + LLaDA2's special tokens, in that order."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab, merges = byte_level_bpe(pre, num_merges)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    add_special_tokens(tok)
    return tok


# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs,
# newlines, spaces.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def filler_word(i: int) -> str:
    """A made-up word for filler id i: 'Ġ' (a space) then syllables spelling i in base 70."""
    parts = []
    while True:
        i, r = divmod(i, len(SYLLABLES))
        parts.append(SYLLABLES[r])
        if i == 0:
            return "Ġ" + "".join(reversed(parts))


def fill_to(vocab: dict[str, int], size: int) -> None:
    """Add filler words until `vocab` holds ids [0, size) (skipping words it already has)."""
    n = 0
    while len(vocab) < size:
        word = filler_word(n)
        n += 1
        if word not in vocab:
            vocab[word] = len(vocab)


def build_qwen_tokenizer(num_merges: int = 200) -> Tokenizer:
    """Qwen-style byte-level BPE with Qwen3's and SDAR's special tokens at their real ids."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab, merges = byte_level_bpe(pre, num_merges)
    fill_to(vocab, FIRST_SPECIAL_ID)
    for i, (token, _) in enumerate(QWEN_SPECIAL_TOKENS):
        vocab[token] = FIRST_SPECIAL_ID + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, special in QWEN_SPECIAL_TOKENS if special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, special in QWEN_SPECIAL_TOKENS if not special])
    return tok
