"""Output-text helpers shared by the scheduler (finding stops) and the front (streaming):
stop-string search and hold-back, and the decode of a growing output."""

from __future__ import annotations

from collections.abc import Callable


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in text: (index, stop), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


# Characters at the end of the text that partial_stop_len looks for in each stop string.
TAIL_CHARS = 16
# Candidate lengths partial_stop_len compares whole in one stop string before it settles for a
# bound (a periodic stop, such as "a" * 1000, makes nearly every length a candidate).
MAX_CANDIDATES = 32


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string, or
    more (never more than the text): what streaming holds back, since the next block may
    complete the stop string; holding back more only delays that text.

    A length n >= len(tail) (the text's last TAIL_CHARS characters) needs stop[n - len(tail):n]
    == tail, so those lengths are found with `str.rfind` of the tail in the stop, longest
    first, and only they are compared whole; the few shorter lengths are compared one by one.
    (Trying every length cost O(len(stop) ** 2) a stop at every block, on the front's thread.)
    A stop whose MAX_CANDIDATES longest candidates all fail counts as matching just below the
    last of them (an upper bound of its exact length): the answer is then at least the exact
    one, and a block's work is bounded whatever the stop strings.
    """
    tail = text[-TAIL_CHARS:]
    longest = 0
    for stop in stops:
        n = min(len(stop) - 1, len(text))
        tried = 0
        while n >= len(tail) and n > longest:
            at = stop.rfind(tail, 0, n)  # the longest candidate <= n ends where the tail does
            if at < 0:
                n = len(tail) - 1
                break
            n = at + len(tail)
            if n > longest and text.endswith(stop[:n]):
                longest = n
                break
            n -= 1
            tried += 1
            if tried == MAX_CANDIDATES:  # the exact length is at most n: hold back n
                longest = max(longest, n)
                break
        for short in range(min(n, len(tail) - 1), longest, -1):
            if text.endswith(stop[:short]):
                longest = short
                break
    return longest


# Tokens before the new ones that each update decodes again with them: a decoder that looks
# back (a Metaspace decoder drops the first token's leading space) sees the same context in
# the window as in the whole output.
CONTEXT_TOKENS = 4


class GrowingText:
    """decode() of a growing list of ids, decoding only the ids added since the last call and
    CONTEXT_TOKENS before them (decoding the whole output at every block made a request's
    cost quadratic in its length).

    Invariants: the ids only grow between calls (a shorter list starts over); `_fixed` is the
    whole-list decode of ids[:_end] and does not end in U+FFFD (half a UTF-8 character), so
    the text of later ids only appends to it; `_context` is decode(ids[_start:_end]). A
    window whose decode does not begin with `_context` (a decoder that looks further back)
    falls back to decoding the whole list.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self._fixed = self._context = ""
        self._start = self._end = 0

    def text(self, ids: list[int]) -> str:
        """decode(ids), from the fixed text and a decode of the ids after it (with context)."""
        window = self.decode(ids[self._start:]) if len(ids) >= self._end else None
        if window is not None and window.startswith(self._context):
            text = self._fixed + window[len(self._context):]
        else:
            text = self.decode(ids)
            self._fixed, self._context, self._start, self._end = "", "", 0, 0
        if len(ids) > self._end and not text.endswith("\ufffd"):
            self._fixed, self._end = text, len(ids)
            self._start = max(0, self._end - CONTEXT_TOKENS)
            self._context = self.decode(ids[self._start:self._end])
        return text
