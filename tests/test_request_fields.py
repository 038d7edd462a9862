"""The one table of SGLang's unused fields, and the numeric limits of every float setting."""

from __future__ import annotations

import math

import pytest

from dllm_serve.engine import expand_n, per_prompt_params
from dllm_serve.errors import RequestError
from dllm_serve.http import protocol
from dllm_serve.request_fields import (
    ANY,
    CHAT,
    FIELDS,
    GENERATE,
    NONE_LIST,
    OPENAI,
    SAMPLING,
    ZERO_MAP,
    check_unused,
)
from dllm_serve.sampling_params import (
    FLOAT32_MAX,
    MAX_STOP_CHARS,
    MAX_STOP_REGEX_CHARS,
    MAX_STOP_REGEXES,
    MAX_STOPS,
    SamplingParams,
    copy_seed,
)

EXTREMES = [1e308, -1e308, 5e-324, 3.5e38, -0.0, math.inf, math.nan, 1e400]


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_field_accepts_its_off_values_and_names_itself_otherwise(name: str) -> None:
    field = FIELDS[name]
    scope = sorted(field.scopes)[0]
    if field.off is ANY:
        check_unused({name: "anything"}, scope)
        return
    offs = ([None, [None]] if field.off is NONE_LIST else
            [None, {}, {"5": 0, "7": 0.0}] if field.off is ZERO_MAP else field.off)
    for off in offs:
        check_unused({name: off}, scope)
    with pytest.raises(RequestError) as e:
        check_unused({name: "certainly-not-off"}, scope)
    assert e.value.param == name and name in str(e.value) and "Unsupported" in str(e.value)


def test_booleans_are_not_numbers() -> None:
    with pytest.raises(RequestError):
        check_unused({"frequency_penalty": False}, SAMPLING)
    check_unused({"frequency_penalty": -0.0, "repetition_penalty": 1.0}, SAMPLING)
    check_unused({"lora_path": [None, None]}, GENERATE)
    with pytest.raises(RequestError):
        check_unused({"lora_path": [None, "a"]}, GENERATE)
    with pytest.raises(RequestError):
        check_unused({"logit_bias": {"5": False}}, SAMPLING)


@pytest.mark.parametrize("model,scope", [
    (protocol.CompletionRequest, OPENAI), (protocol.ChatCompletionRequest, CHAT),
    (protocol.GenerateRequest, GENERATE), (protocol.NativeSamplingParams, SAMPLING)])
def test_request_models_declare_the_table(model: type, scope: str) -> None:
    """/openapi.json lists every table field of the route's scope."""
    table = {n for n, f in FIELDS.items() if f.scopes & ({scope, OPENAI} if scope == CHAT
                                                          else {scope})}
    assert table <= set(model.model_fields)


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "dllm_threshold"])
def test_float_settings_are_finite_and_within_float32(name: str, value: float) -> None:
    params = SamplingParams.from_dict({name: value, "max_new_tokens": 4})
    ok = math.isfinite(value) and abs(value) <= FLOAT32_MAX and {
        "temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
        "dllm_threshold": True}[name]
    if ok:
        params.verify(vocab_size=100)
        return
    with pytest.raises(ValueError, match=name):
        params.verify(vocab_size=100)


def test_an_integer_past_the_float_range_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, temperature=10**400).verify(vocab_size=100)


@pytest.mark.parametrize("t,greedy", [(5e-324, True), (9.99e-6, True), (1e-5, False),
                                      (0.7, False), (3.4e38, False), (-0.0, True)])
def test_tiny_temperatures_decode_greedily(t: float, greedy: bool) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=t)
    params.verify(vocab_size=100)
    params.normalize()
    assert (params.temperature == 0.0) == greedy


@pytest.mark.parametrize("bad", [{"top_k": 0}, {"top_k": -2}, {"min_new_tokens": 5},
                                 {"n": 0}, {"stop_regex": ["("]}, {"max_new_tokens": -1}])
def test_integer_and_regex_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams.from_dict({"max_new_tokens": 4, **bad}).verify(vocab_size=100)


@pytest.mark.parametrize("key,value,ok", [
    ("stop", ["s"] * MAX_STOPS, True), ("stop", ["s"] * (MAX_STOPS + 1), False),
    ("stop", ["x" * MAX_STOP_CHARS], True), ("stop", ["x" * (MAX_STOP_CHARS + 1)], False),
    ("stop_regex", ["a+"] * MAX_STOP_REGEXES, True),
    ("stop_regex", ["a+"] * (MAX_STOP_REGEXES + 1), False),
    ("stop_regex", ["a" * MAX_STOP_REGEX_CHARS], True),
    ("stop_regex", ["a" * (MAX_STOP_REGEX_CHARS + 1)], False)])
def test_a_request_s_stop_strings_and_regexes_are_bounded(key: str, value: list[str],
                                                          ok: bool) -> None:
    """The scheduler searches them at every commit and the front holds stop strings back at
    every block, for every request: one request's are bounded (400 past the bounds, naming
    them)."""
    params = SamplingParams.from_dict({"max_new_tokens": 4, key: value})
    if ok:
        params.verify(vocab_size=100)
        return
    with pytest.raises(ValueError, match=f"{key} takes at most"):
        params.verify(vocab_size=100)


@pytest.mark.parametrize("key", ["stop", "stop_regex"])
def test_an_empty_stop_string_is_no_stop_and_an_empty_one_in_a_list_is_refused(key: str) -> None:
    """As the OpenAI routes read it: a bare "" is no stop; [""] would match at once (400)."""
    params = SamplingParams.from_dict({"max_new_tokens": 4, key: ""})
    params.verify(vocab_size=100)
    assert getattr(params, key) == []
    with pytest.raises(ValueError, match=key):
        SamplingParams.from_dict({"max_new_tokens": 4, key: [""]}).verify(vocab_size=100)


def test_one_params_dict_for_a_batch_gives_each_request_its_own_params() -> None:
    """A dict for all prompts is parsed once; each request still gets its own SamplingParams
    (validation fills in a prompt's own max_new_tokens default and changes nothing else's)."""
    params = per_prompt_params({"temperature": 0.5, "stop": ["x"]}, 3)
    requests = expand_n([[1], [2, 3], [4]], params, [None, None, None])
    ps = [p for _, p, _ in requests]
    assert len({id(p) for p in ps}) == 3 and len({id(p.stop) for p in ps}) == 3
    ps[0].max_new_tokens = 7
    ps[1].stop.append("y")
    assert ps[2].max_new_tokens is None and ps[2].stop == ["x"] and ps[2].temperature == 0.5


def test_copies_seeds_wrap_in_int64() -> None:
    """Copy i of n gets seed + i wrapped into int64; every int64 verifies, nothing past it."""
    params = per_prompt_params({"n": 3, "seed": 2**63 - 2}, 1)
    seeds = [p.seed for _, p, _ in expand_n([[1]], params, [None])]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert copy_seed(-1, 0) == -1 and copy_seed(-1, 1) == 0
    for ok in (-(2**63), -1, 0, 2**63 - 1):
        SamplingParams.from_dict({"seed": ok}).verify(vocab_size=100)
    for bad in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
            SamplingParams.from_dict({"seed": bad}).verify(vocab_size=100)
    for bad in (-(2**63) - 1, 2**63, "7", 7.0, True):  # SGLang's name: the message names it
        with pytest.raises(ValueError, match="sampling_seed must be a 64-bit signed integer"):
            SamplingParams.from_dict({"sampling_seed": bad})


@pytest.mark.parametrize("model", [protocol.CompletionRequest, protocol.ChatCompletionRequest,
                                   protocol.NativeSamplingParams])
def test_schema_allows_only_dllm_extra_fields(model: type) -> None:
    """Regression: the schema allowed any extra numeric field, where only dllm_* ones are
    served (others are a 400)."""
    schema = model.model_json_schema()
    assert schema["additionalProperties"] is False
    assert list(schema["patternProperties"]) == ["^dllm_"]
    assert schema["patternProperties"]["^dllm_"]["type"] == "number"
