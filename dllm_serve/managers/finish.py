"""Commit a block's new tokens to a request and decide whether it finished.

Finish conditions, checked token by token in order: EOS (unless ignore_eos), a stop token id,
max_new_tokens; then stop strings on the decoded text. Tokens after the finishing one are
dropped, so EOS and stop strings truncate inside a block. The finishing token is kept in
output_ids (SGLang's convention); the front cuts the text at a matched stop string.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dllm_serve.managers.req import Req
from dllm_serve.utils.text import find_stop

Decode = Callable[[list[int]], str]


class FinishChecker:
    def __init__(self, eos_ids: set[int], decode: Decode | None) -> None:
        self.eos_ids = eos_ids
        self.decode = decode

    def commit(self, req: Req, new_tokens: np.ndarray) -> np.ndarray:
        """Append new_tokens to req.output_ids up to the first finish; return what was added."""
        start = len(req.output_ids)
        for t in new_tokens.tolist():
            req.output_ids.append(t)
            req.finish_reason = self._token_finish(req, t)
            if req.finish_reason is not None:
                break
        if req.params.stop and self.decode is not None:
            self._stop_strings(req, start)
        return np.asarray(req.output_ids[start:], dtype=np.int64)

    def _token_finish(self, req: Req, token: int) -> dict | None:
        params = req.params
        if token in self.eos_ids and not params.ignore_eos:
            return {"type": "stop", "matched": token}
        if token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if len(req.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        return None

    def _stop_strings(self, req: Req, start: int) -> None:
        """Finish at the first stop string that ends inside the tokens added since start."""
        assert self.decode is not None
        stops = req.params.stop
        if find_stop(self.decode(req.output_ids), stops) is None:
            return
        for n in range(start + 1, len(req.output_ids) + 1):
            hit = find_stop(self.decode(req.output_ids[:n]), stops)
            if hit is not None:
                del req.output_ids[n:]
                req.finish_reason = {"type": "stop", "matched": hit[1]}
                return
