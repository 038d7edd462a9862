"""`SamplingParams`: per-request generation settings (SGLang's native names).

Numbers must be finite and within float32's range (the compute dtype's; bfloat16 shares its
exponent), so no setting can turn the logits into inf or NaN. Temperatures below
GREEDY_TEMPERATURE decode greedily (vLLM's convention): `normalize()` sets them to 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import regex

from dllm_serve.request_fields import SAMPLING, check_unused

# max_new_tokens when a request leaves it out (SGLang's); the front lowers it to what fits.
DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_TEMPERATURE = 1e-5  # below it: greedy
FLOAT32_MAX = 3.4028234663852886e38
DLLM_PREFIX = "dllm_"
MAX_N = 128
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # any int64, as vLLM takes it (-1 is a seed too)
SEED_ALIAS = "sampling_seed"  # SGLang's native name for `seed`
# Stop strings and regexes are searched in the scheduler at every commit of the request and,
# when streaming, held back in the front at every block: both loops serve every request, so one
# request's stops are bounded (OpenAI takes at most 4 stop strings; these are far past any use).
MAX_STOPS, MAX_STOP_CHARS = 128, 1024  # stop strings, characters in each
MAX_STOP_REGEXES, MAX_STOP_REGEX_CHARS = 16, 1024  # stop regexes, characters in each


@dataclass
class SamplingParams:
    # None: DEFAULT_MAX_NEW_TOKENS, or fewer if fewer fit (set by the front's validate()).
    # 0: nothing is generated (SGLang's prefill-only request); the answer is empty.
    max_new_tokens: int | None = None
    min_new_tokens: int = 0  # EOS and stop tokens cannot end the output before this many
    temperature: float = 0.0  # 0 (or < GREEDY_TEMPERATURE) = greedy; > 0 samples
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    n: int = 1  # copies of the request (the front submits n engine requests)
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False  # keep the matched stop string in the text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # the fast tokenizer decodes the same either way
    seed: int | None = None
    # Per-request algorithm overrides, names without the "dllm_" prefix (e.g. threshold).
    dllm: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> SamplingParams:
        """Build from SGLang-style keys (dllm_<name> keys go to `dllm`). Fields of SGLang's
        that dllm-serve does not use are accepted at their off values (request_fields.py);
        anything else raises ValueError."""
        d = {k: v for k, v in (d or {}).items()}
        _take_seed_alias(d)
        dllm = {k[len(DLLM_PREFIX):]: d.pop(k) for k in list(d) if k.startswith(DLLM_PREFIX)}
        rest = check_unused(d, SAMPLING)
        unknown = sorted(set(rest) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        known = {k: v for k, v in d.items() if k in KNOWN_KEYS}
        for key in ("stop", "stop_regex"):
            if known.get(key) in (None, ""):  # no stop, as the OpenAI routes read it
                known.pop(key, None)
            elif isinstance(known.get(key), str):
                known[key] = [known[key]]
        if known.get("stop_token_ids") is None:
            known.pop("stop_token_ids", None)
        params = SamplingParams(**{k: v for k, v in known.items()
                                   if v is not None or k in NULLABLE})
        params.dllm.update(dllm)
        return params

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError with a user-facing message if a value is out of range."""
        _check(self.max_new_tokens is None or (_is_int(self.max_new_tokens)
                                               and self.max_new_tokens >= 0),
               f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        _check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens
               <= (self.max_new_tokens if self.max_new_tokens is not None else 2**62),
               f"min_new_tokens must be an integer in [0, max_new_tokens], "
               f"got {self.min_new_tokens!r}")
        check_float("temperature", self.temperature, low=0.0)
        check_float("top_p", self.top_p, low=0.0, high=1.0, open_low=True)
        check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check(_is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k),
               f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        check_n(self.n)
        self._verify_stops(vocab_size)
        for flag in ("ignore_eos", "no_stop_trim", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            _check(isinstance(getattr(self, flag), bool), f"{flag} must be a boolean")
        _check(self.seed is None or _is_seed(self.seed),
               f"seed must be a 64-bit signed integer, got {self.seed!r}")
        _check(isinstance(self.dllm, dict), "dllm settings must be an object")
        for name, value in self.dllm.items():
            check_float(DLLM_PREFIX + name, value)

    def _verify_stops(self, vocab_size: int) -> None:
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a non-empty string or a list of non-empty strings")
        _check(len(self.stop) <= MAX_STOPS and all(len(s) <= MAX_STOP_CHARS for s in self.stop),
               f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters "
               f"each, got {len(self.stop)} of up to {max(map(len, self.stop), default=0)}")
        _check(isinstance(self.stop_regex, list)
               and all(isinstance(s, str) and s for s in self.stop_regex),
               "stop_regex must be a non-empty regular expression or a list of them (an empty "
               "pattern would match before any output)")
        _check(len(self.stop_regex) <= MAX_STOP_REGEXES
               and all(len(s) <= MAX_STOP_REGEX_CHARS for s in self.stop_regex),
               f"stop_regex takes at most {MAX_STOP_REGEXES} patterns of at most "
               f"{MAX_STOP_REGEX_CHARS} characters each, got {len(self.stop_regex)} of up to "
               f"{max(map(len, self.stop_regex), default=0)}")
        _check(all(_compiles(s) for s in self.stop_regex),
               "stop_regex must be a regular expression or a list of them (Python syntax)")
        _check(isinstance(self.stop_token_ids, list)
               and all(_is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
               f"stop_token_ids must be token ids in [0, {vocab_size})")

    def normalize(self) -> None:
        """After verify(): temperatures below GREEDY_TEMPERATURE decode greedily."""
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


KNOWN_KEYS = frozenset(f.name for f in fields(SamplingParams)) - {"dllm"}
NULLABLE = frozenset({"max_new_tokens", "seed"})  # null means "the default" for the others


def _take_seed_alias(d: dict[str, Any]) -> None:
    """SGLang's native sampling_params name the seed `sampling_seed`: it becomes `seed` (both
    given with different values is a ValueError; so is a value that is no int64, named as
    sampling_seed)."""
    alias = d.pop(SEED_ALIAS, None)
    if alias is None:
        return
    _check(_is_seed(alias), f"{SEED_ALIAS} must be a 64-bit signed integer, got {alias!r}")
    if d.get("seed") is not None and d["seed"] != alias:
        raise ValueError(f"seed ({d['seed']!r}) and {SEED_ALIAS} ({alias!r}) differ: give one")
    d["seed"] = alias


def _is_seed(value: object) -> bool:
    """An int (not a bool) in int64's range."""
    return _is_int(value) and SEED_MIN <= value <= SEED_MAX  # type: ignore[operator]


def copy_seed(seed: int, copy: int) -> int:
    """Copy `copy`'s seed of a request asked with `n` copies: seed + copy, wrapped into the
    int64 range (copy 0 keeps the seed asked)."""
    return (seed + copy - SEED_MIN) % 2**64 + SEED_MIN


def check_float(name: str, value: object, low: float = -FLOAT32_MAX,
                high: float = FLOAT32_MAX, open_low: bool = False) -> None:
    """ValueError naming `name` unless value is a finite number within float32's range and
    within [low, high] (or (low, high] with open_low)."""
    if not is_finite_number(value) or abs(value) > FLOAT32_MAX:  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a finite number within float32's range "
                         f"(|x| <= {FLOAT32_MAX:.4g}), got {value!r}")
    number = float(value)  # type: ignore[arg-type]
    if number < low or number > high or (open_low and number == low):
        lo = "(" if open_low else "["
        raise ValueError(f"{name} must be in {lo}{_num(low)}, {_num(high)}], got {value!r}")


def _num(x: float) -> str:
    return "inf" if x == FLOAT32_MAX else f"{x:g}"


def _compiles(pattern: str) -> bool:
    """The pattern compiles with the `regex` package (what the finish check searches with)."""
    try:
        regex.compile(pattern)
    except (regex.error, RecursionError, OverflowError, ValueError):
        return False
    return True


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


def check_n(n: Any) -> None:
    """ValueError unless n (choices per prompt) is an integer in [1, MAX_N]."""
    _check(_is_int(n) and 1 <= n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {n!r}")
