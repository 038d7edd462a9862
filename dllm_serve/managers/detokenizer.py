"""Incremental detokenisation of committed blocks, with stop-string and UTF-8 hold-back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dllm_serve.utils.text import GrowingText, partial_stop_len


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    While the request runs, a trailing U+FFFD (half a UTF-8 character) and a trailing prefix of
    a stop string are held back, so no client ever sees text that a later block retracts.
    On a stop-string (or stop-regex) finish the text ends just before the matched string, or
    after it with keep_stop (SGLang's no_stop_trim); on a stop token's finish (EOS or a
    stop_token_ids entry) it ends before that token's text, or after it with keep_stop. A
    stop regex is not held back while streaming: a match that spans two blocks may have sent
    its beginning already. An update decodes only the new ids and a few before them
    (`GrowingText`).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str],
                 keep_stop: bool = False) -> None:
        self.decoded = GrowingText(decode)
        self.stops = list(dict.fromkeys(stops))  # each distinct stop string once
        self.keep_stop = keep_stop
        self.sent = 0
        self.text = ""

    def update(self, output_ids: list[int], finish_reason: dict[str, Any] | None,
               at: int | None = None) -> str:
        """The new text. On a stop finish the text is cut at `at` (where the match starts,
        as the scheduler found it: a regex's match need not be the matched text's first
        occurrence), else at the matched string's first occurrence."""
        reason = finish_reason or {}
        matched, stop = reason.get("matched"), reason.get("type") == "stop"
        if stop and isinstance(matched, int) and not self.keep_stop:
            output_ids = output_ids[:-1]  # a stop token (EOS included) leaves the text, as
            # SGLang's trim (its id stays in output_ids)
        text = self.decoded.text(output_ids)
        if finish_reason is None:
            limit = len(text) - partial_stop_len(text, self.stops)
            while limit > 0 and text[limit - 1] == "\ufffd":
                limit -= 1
        else:
            if stop and isinstance(matched, str):
                cut = text.find(matched) if at is None else at
                if cut >= 0:
                    text = text[:cut + len(matched) if self.keep_stop else cut]
            limit = len(text)
        limit = max(limit, self.sent)
        delta = text[self.sent:limit]
        self.sent = limit
        self.text = text[:limit]
        return delta
