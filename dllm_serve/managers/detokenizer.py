"""Incremental detokenisation of committed blocks, with stop-string and UTF-8 hold-back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dllm_serve.utils.text import partial_stop_len

# Tokens before the new ones that each update decodes again with them: a decoder that looks
# back (a Metaspace decoder drops the first token's leading space) sees the same context in
# the window as in the whole output.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    While the request runs, a trailing U+FFFD (half a UTF-8 character) and a trailing prefix of
    a stop string are held back, so no client ever sees text that a later block retracts.
    On a stop-string (or stop-regex) finish the text ends just before the matched string, or
    after it with keep_stop (SGLang's no_stop_trim). A stop regex is not held back while
    streaming: a match that spans two blocks may have sent its beginning already.

    An update decodes only the new ids and CONTEXT_TOKENS before them, not the whole output
    (that made a request's detokenisation quadratic in its length). Invariant: `_fixed` is the
    whole-output decode of ids[:_end] and ends in a complete character (not U+FFFD), so the
    text of later ids only appends to it; `_context` is decode(ids[_start:_end]). A window
    whose decode does not begin with `_context` (a decoder that looks further back) falls back
    to decoding the whole output.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str],
                 keep_stop: bool = False) -> None:
        self.decode = decode
        self.stops = stops
        self.keep_stop = keep_stop
        self.sent = 0
        self.text = ""
        self._fixed = ""
        self._context = ""
        self._start = self._end = 0

    def update(self, output_ids: list[int], finish_reason: dict[str, Any] | None) -> str:
        text = self._decoded(output_ids)
        if finish_reason is None:
            limit = len(text) - partial_stop_len(text, self.stops)
            while limit > 0 and text[limit - 1] == "\ufffd":
                limit -= 1
        else:
            matched = finish_reason.get("matched")
            if finish_reason.get("type") == "stop" and isinstance(matched, str):
                cut = text.find(matched)
                if cut >= 0:
                    text = text[:cut + len(matched) if self.keep_stop else cut]
            limit = len(text)
        limit = max(limit, self.sent)
        delta = text[self.sent:limit]
        self.sent = limit
        self.text = text[:limit]
        return delta

    def _decoded(self, ids: list[int]) -> str:
        """decode(ids), from the fixed text and a decode of the ids after it (with context)."""
        window = self.decode(ids[self._start:])
        if window.startswith(self._context):
            text = self._fixed + window[len(self._context):]
        else:
            text = self.decode(ids)
            self._fixed, self._context, self._start, self._end = "", "", 0, 0
        if len(ids) > self._end and not text.endswith("\ufffd"):
            self._fixed, self._end = text, len(ids)
            self._start = max(0, self._end - CONTEXT_TOKENS)
            self._context = self.decode(ids[self._start:self._end])
        return text
