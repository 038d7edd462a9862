"""`SamplingParams`: per-request generation settings (SGLang's native names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# max_new_tokens when a request leaves it out (SGLang's); the front lowers it to what fits.
DEFAULT_MAX_NEW_TOKENS = 128
KNOWN_KEYS = ("max_new_tokens", "temperature", "top_p", "stop", "stop_token_ids", "ignore_eos",
              "seed", "dllm")


@dataclass
class SamplingParams:
    # None: DEFAULT_MAX_NEW_TOKENS, or fewer if fewer fit (set by the front's validate()).
    max_new_tokens: int | None = None
    temperature: float = 0.0  # 0 = greedy; > 0 samples with the algorithm's noise rule
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # Per-request algorithm overrides, names without the "dllm_" prefix (e.g. threshold).
    dllm: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> SamplingParams:
        """Build from SGLang-style keys (dllm_<name> keys go to `dllm`); unknown keys raise."""
        d = dict(d or {})
        dllm = {k[len("dllm_"):]: d.pop(k) for k in list(d) if k.startswith("dllm_")}
        unknown = sorted(set(d) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        params = SamplingParams(**d)
        params.dllm.update(dllm)
        return params

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError with a user-facing message if a value is out of range."""
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
               f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        _check(is_finite_number(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a non-empty string or a list of non-empty strings")
        _check(isinstance(self.stop_token_ids, list)
               and all(_is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
               f"stop_token_ids must be token ids in [0, {vocab_size})")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite_number(x: object) -> bool:
    """An int or float (not a bool) that is finite as a float: NaN, +-inf and ints past the
    float range (JSON allows 1e999 and 10**400) are not."""
    try:
        return _is_num(x) and math.isfinite(x)  # type: ignore[arg-type]
    except OverflowError:
        return False


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
