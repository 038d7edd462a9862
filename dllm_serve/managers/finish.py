"""Commit a block's new tokens to a request and decide whether it finished.

Finish conditions, checked token by token in order: EOS (unless ignore_eos), a stop token id,
max_new_tokens; then stop strings and stop regexes on the decoded text. An EOS or stop token
counts only with min_new_tokens tokens before it (earlier ones stay in the output as ordinary
tokens; stop strings still end it, as in SGLang). Tokens
after the finishing one are dropped, so EOS and stop strings truncate inside a block. The
finishing token is kept in output_ids (SGLang's convention); the front cuts the text at a
matched stop string or regex match (`matched` holds the matched text; with a stop_regex, whose
search covers the whole output's text, `at` holds where the match starts in it). The text
searched is decoded as the client's is: with or without special tokens, as the request asks.

A stop_regex is searched with the `regex` package under a time limit: a pattern that
backtracks without end (e.g. `(.*.*)*x$`) would otherwise hold the scheduler forever. The limit,
STOP_REGEX_TIMEOUT_S, holds for all of a request's searches at one commit together (its
patterns, and the prefixes searched once one matched), so no request takes the scheduler longer
than that a commit, however many patterns it sends; past it the request ends with a 400 that
says so, and the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import numpy as np
import regex

from dllm_serve.managers.req import Req
from dllm_serve.utils.text import GrowingText, find_stop

Decode = Callable[..., str]  # decode(ids, skip_special_tokens=True) -> text
STOP_REGEX_TIMEOUT_S = 0.05  # a request's regex searches at one commit, together
# stop sets are shared between requests that send the same stop ids (a server sees a few):
# at most STOP_SETS_KEPT of them are kept (past it the caches start over), and only sets of at
# most STOP_SET_SHARED_IDS ids, so that clients that send a new set with every request, each up
# to a body's worth of ids, do not grow the scheduler's memory (a larger set is its request's)
STOP_SETS_KEPT = 256
STOP_SET_SHARED_IDS = 64
K = TypeVar("K")
V = TypeVar("V")


def remember(cache: dict[K, V], key: K, value: V, ids: int) -> V:
    """`value`, kept in `cache` under `key` if its set of `ids` ids may be shared (see
    STOP_SETS_KEPT and STOP_SET_SHARED_IDS)."""
    if ids <= STOP_SET_SHARED_IDS:
        if len(cache) >= STOP_SETS_KEPT:
            cache.clear()
        cache[key] = value
    return value


class StopRegexTooSlow(Exception):
    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        self.pattern = pattern


class FinishChecker:
    def __init__(self, eos_ids: set[int], decode: Decode | None) -> None:
        self.eos_ids = eos_ids
        self.decode = decode
        # the stop token sets, by (stop_token_ids, ignore_eos): a few distinct ones per server
        # (the small ones kept: `remember`)
        self._stop_sets: dict[tuple[tuple[int, ...], bool], frozenset[int]] = {}

    def commit(self, req: Req, new_tokens: np.ndarray) -> np.ndarray:
        """Append new_tokens (T,) int64 to req.output_ids up to the first finish; return what
        was added (a view of new_tokens unless a stop string cut the output)."""
        start = len(req.output_ids)
        added = new_tokens[:0]
        if len(new_tokens):
            end, req.finish_reason = self._token_finish(req, new_tokens)
            added = new_tokens[:end]
            req.output_ids.extend(added.tolist())
        if (req.params.stop or req.params.stop_regex) and self.decode is not None:
            try:
                self._stop_strings(req, start)
            except StopRegexTooSlow as e:
                req.finish_reason = {
                    "type": "abort", "status_code": 400,
                    "message": f"stop_regex searches took longer than "
                               f"{1e3 * STOP_REGEX_TIMEOUT_S:.0f} ms at one block of the output "
                               f"(runaway backtracking? the last: {e.pattern!r}): simplify the "
                               f"patterns"}
            return np.asarray(req.output_ids[start:], dtype=np.int64)
        return added

    def stop_set(self, req: Req) -> frozenset[int]:
        """The token ids that stop the request: its stop_token_ids, and EOS unless
        ignore_eos (min_new_tokens aside: the caller applies it). Made once per request (a
        client's list may hold millions of ids: no work per block in proportion to it) and
        shared between requests that send the same list."""
        if req.stops is None:
            req.stops = self._shared_stop_set(req)
        return req.stops

    def _shared_stop_set(self, req: Req) -> frozenset[int]:
        p = req.params
        key = (tuple(p.stop_token_ids), p.ignore_eos)
        stops = self._stop_sets.get(key)
        if stops is None:
            stops = remember(self._stop_sets, key, frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else frozenset(self.eos_ids)), len(key[0]))
        return stops

    def _token_finish(self, req: Req, tokens: np.ndarray) -> tuple[int, dict | None]:
        """(how many of tokens (T,) >= 1 join the output, the finish they reach): they end
        at the first one that finishes, in order: EOS (unless ignore_eos) or a stop token id
        with at least min_new_tokens tokens before it (as SGLang and vLLM: the stop is then
        the (min_new_tokens + 1)-th token at the earliest), then max_new_tokens reached. At
        least one joins."""
        params, before = req.params, len(req.output_ids)
        # token i makes the output before + i + 1 long
        at_length = max(0, params.max_new_tokens - before - 1)
        stops = self.stop_set(req)
        first = max(0, params.min_new_tokens - before)  # the first that may stop it
        ids = tokens.tolist()  # a block's few ids: a loop over a list beats numpy compares
        for i in range(first, min(len(ids), at_length + 1)):
            if ids[i] in stops:
                return i + 1, {"type": "stop", "matched": ids[i]}
        if at_length < len(ids):
            return at_length + 1, {"type": "length", "length": params.max_new_tokens}
        return len(ids), None

    def _stop_strings(self, req: Req, start: int) -> None:
        """Finish at the first stop string or regex match that ends inside the tokens added
        since start (min_new_tokens does not hold these back, as in SGLang). Stop strings
        alone are looked for in the text of the new tokens and the stop_lookback(stops)
        before them (one that ends earlier finished the request at an earlier commit), so a
        commit costs the same at any length of the output; a regex may span the whole text,
        which is searched whole (its text decoded only where it grew: `req.text`)."""
        assert self.decode is not None
        params, ids = req.params, req.output_ids
        decode = (self.decode if params.skip_special_tokens
                  else partial(self.decode, skip_special_tokens=False))
        if params.stop_regex:
            req.text = req.text or GrowingText(decode)
            lo, text = 0, req.text.text(ids)
        else:
            lo = max(0, start - stop_lookback(params.stop))
            text = decode(ids[lo:])
        deadline = time.monotonic() + STOP_REGEX_TIMEOUT_S  # every regex search of this commit
        if _find(text, params.stop, params.stop_regex, deadline) is None:
            return
        prefix = GrowingText(decode)  # each prefix's text, decoded where it grew
        for n in range(start + 1, len(ids) + 1):
            hit = _find(prefix.text(ids[lo:n]), params.stop, params.stop_regex, deadline)
            if hit is not None:
                del req.output_ids[n:]
                req.finish_reason = {"type": "stop", "matched": hit[1]}
                if params.stop_regex:  # the whole text was searched: hit[0] indexes it
                    req.finish_reason["at"] = hit[0]
                return


def stop_lookback(stops: list[str]) -> int:
    """Tokens before a commit's new ones whose text may hold the start of a stop string that
    ends in them: twice the longest stop string's characters and some (a token's text is
    almost always a character or more; tokens that decode to nothing, such as skipped
    special tokens, and a window that starts inside a character are what the margin is
    for)."""
    return 2 * max(map(len, stops), default=0) + 16


def _find(text: str, stops: list[str], regexes: list[str],
          deadline: float) -> tuple[int, str] | None:
    """The earliest stop string or regex match in text: (index, the matched text); the
    regexes searched by time.monotonic() `deadline` (StopRegexTooSlow past it)."""
    hits = [h for h in [find_stop(text, stops), *(_search(text, r, deadline) for r in regexes)]
            if h]
    return min(hits, default=None, key=lambda h: h[0])


def _search(text: str, pattern: str, deadline: float) -> tuple[int, str] | None:
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        found = regex.search(pattern, text, timeout=left)
    except TimeoutError:
        raise StopRegexTooSlow(pattern) from None
    return None if found is None else (found.start(), found.group(0))
