"""The one table of request fields that SGLang's clients send and dllm-serve accepts unused.

SGLang's `/generate`, its OpenAI routes, its frontend language, `bench_serving` and
sglang-router send these fields, usually at their "off" values. Each is accepted at an off value
(or, where `off` is ANY, at every value: the field only tunes something dllm-serve does
differently, e.g. `stream_interval`, since a dLLM streams one chunk per committed block); any
other value is a 400 that names the field. The fields the engine honours are not here: they are
typed fields of `SamplingParams` and of the HTTP request models (temperature, top_p, top_k,
min_p, n, stop, stop_regex, stop_token_ids, ignore_eos, seed (native: also by SGLang's name
sampling_seed), max_new_tokens / max_tokens, min_new_tokens / min_tokens, skip_special_tokens,
spaces_between_special_tokens, no_stop_trim, dllm_*). Every route, and the offline `Engine`,
checks its fields against this one table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from dllm_serve.errors import RequestError

# Where a field may appear.
SAMPLING: Final = "sampling"  # native sampling_params (/generate, Engine.generate)
GENERATE: Final = "generate"  # the /generate body
OPENAI: Final = "openai"  # /v1/completions and /v1/chat/completions bodies
CHAT: Final = "chat"  # /v1/chat/completions only

ANY: Final = ("<any value>",)  # `off` of a field that is ignored whatever it holds
NONE_LIST: Final = ("<null or a list of nulls>",)  # lora_path: null per prompt
ZERO_MAP: Final = ("<null or an object of zeros>",)  # logit_bias: every bias 0


@dataclass(frozen=True)
class Unused:
    off: tuple[Any, ...]  # the values that mean "not used"; ANY: every value
    scopes: frozenset[str]
    why: str = ""  # why it is ignored (for fields whose off is ANY)


def _f(off: tuple[Any, ...], *scopes: str, why: str = "") -> Unused:
    return Unused(off, frozenset(scopes), why)


_LOGPROB = "log probabilities are not returned (return_logprob must be off)"
_CACHE = "the prefix cache is shared and matched by tokens alone"
_ROUTE = "one engine: routing and tracing hints have nothing to choose"
_STREAM = "a dLLM streams one chunk per committed block"
_REASONING = "no reasoning parser: the whole output is the content"
NULL, EMPTY = (None,), (None, "")

FIELDS: Final[dict[str, Unused]] = {
    # ---- sampling (native sampling_params and the OpenAI routes) ----------------------------
    "frequency_penalty": _f((None, 0), SAMPLING, OPENAI),
    "presence_penalty": _f((None, 0), SAMPLING, OPENAI),
    "repetition_penalty": _f((None, 1), SAMPLING, OPENAI),
    "logit_bias": _f(ZERO_MAP, SAMPLING, OPENAI),
    "json_schema": _f(EMPTY, SAMPLING, OPENAI),
    "regex": _f(EMPTY, SAMPLING, OPENAI),
    "ebnf": _f(EMPTY, SAMPLING, OPENAI),
    "structural_tag": _f(EMPTY, SAMPLING),
    "beam_width": _f((None, 1), SAMPLING),
    "stream_interval": _f(ANY, SAMPLING, why=_STREAM),
    "watermark": _f(NULL, SAMPLING, GENERATE, OPENAI),
    "custom_params": _f(ANY, SAMPLING, OPENAI, why="no custom logit processors"),
    "custom_logit_processor": _f(NULL, GENERATE, OPENAI),
    # ---- the /generate body -------------------------------------------------------------------
    "model": _f(ANY, GENERATE, why="one model; sglang-router names it on /generate"),
    "return_logprob": _f((None, False), GENERATE),
    "logprob_start_len": _f(ANY, GENERATE, why=_LOGPROB),
    "top_logprobs_num": _f(ANY, GENERATE, why=_LOGPROB),
    "token_ids_logprob": _f(ANY, GENERATE, why=_LOGPROB),
    "return_text_in_logprobs": _f(ANY, GENERATE, why=_LOGPROB),
    "return_flat_raw_top_logprobs": _f((None, False), GENERATE),
    "return_flat_raw_output_top_logprobs": _f((None, False), GENERATE, OPENAI),
    "return_sampling_mask": _f((None, False), GENERATE, OPENAI),
    "sampling_logprobs_mode": _f(NULL, GENERATE, OPENAI),
    "return_hidden_states": _f((None, False), GENERATE, OPENAI),
    "return_routed_experts": _f((None, False), GENERATE, OPENAI),
    "routed_experts_start_len": _f(ANY, GENERATE, OPENAI, why="routed experts are not returned"),
    "return_indexer_topk": _f((None, False), GENERATE),
    "return_entropy": _f((None, False), GENERATE),
    "return_bytes": _f((None, False), GENERATE),
    "return_prompt_token_ids": _f((None, False), GENERATE, OPENAI),
    "log_metrics": _f(ANY, GENERATE, why="every request is counted in /metrics"),
    "no_logs": _f(ANY, GENERATE, why="requests are not logged one by one"),
    "custom_labels": _f(ANY, GENERATE, OPENAI, why="metrics carry model_name only"),
    "lora_path": _f(NONE_LIST, GENERATE, OPENAI),
    "lora_id": _f(NONE_LIST, GENERATE),
    "image_data": _f((None, []), GENERATE, OPENAI),
    "video_data": _f((None, []), GENERATE),
    "audio_data": _f((None, []), GENERATE),
    "input_embeds": _f(NULL, GENERATE),
    "mm_hashes": _f(NULL, GENERATE),
    "modalities": _f((None, [], ["text"]), GENERATE, OPENAI),
    "use_audio_in_video": _f((None, False), GENERATE, CHAT),
    "video_config": _f(NULL, GENERATE, CHAT),
    "images_config": _f(NULL, GENERATE, OPENAI),
    "mm_processor_kwargs": _f(NULL, GENERATE, OPENAI),
    "max_dynamic_patch": _f(NULL, GENERATE, CHAT),
    "min_dynamic_patch": _f(NULL, GENERATE, CHAT),
    "session_id": _f(NULL, GENERATE, OPENAI),
    "session_params": _f(NULL, GENERATE, OPENAI),
    "bootstrap_host": _f(NULL, GENERATE),
    "bootstrap_port": _f(NULL, GENERATE),
    "bootstrap_room": _f(NULL, GENERATE),
    "bootstrap_pair_key": _f(NULL, GENERATE),
    "decode_tp_size": _f(NULL, GENERATE),
    "data_parallel_rank": _f((None, 0), GENERATE, OPENAI),
    "routed_dp_rank": _f((None, 0), GENERATE),
    "disagg_prefill_dp_rank": _f((None, 0), GENERATE),
    "routing_key": _f(ANY, GENERATE, why=_ROUTE),
    "conversation_id": _f(ANY, GENERATE, why=_ROUTE),
    "external_trace_header": _f(ANY, GENERATE, why=_ROUTE),
    "received_time": _f(ANY, GENERATE, why=_ROUTE),
    "extra_key": _f(ANY, GENERATE, OPENAI, why=_CACHE),
    "cache_salt": _f(ANY, GENERATE, OPENAI, why=_CACHE),
    "priority": _f(NULL, GENERATE, OPENAI),
    "background": _f((None, False), GENERATE),
    "require_reasoning": _f((None, False), GENERATE),
    "max_thinking_tokens": _f(NULL, GENERATE),
    # ---- the OpenAI routes ------------------------------------------------------------------
    "echo": _f((None, False), OPENAI),
    "suffix": _f(EMPTY, OPENAI),
    "logprobs": _f((None, False), OPENAI),
    "top_logprobs": _f((None, 0), OPENAI),
    "best_of": _f((None, 1), OPENAI),
    "tools": _f((None, []), OPENAI),
    "tool_choice": _f((None, "none"), OPENAI),
    "parallel_tool_calls": _f(ANY, OPENAI, why="no tools"),
    "functions": _f((None, []), OPENAI),
    "function_call": _f((None, "none"), OPENAI),
    "response_format": _f((None, {"type": "text"}), OPENAI),
    "store": _f((None, False), OPENAI),
    "metadata": _f((None, {}), OPENAI),
    "service_tier": _f((None, "auto", "default"), OPENAI),
    "reasoning_effort": _f((None, "none"), OPENAI),
    "verbosity": _f((None, "medium"), OPENAI),
    "moderation": _f(NULL, OPENAI),
    "safety_identifier": _f(ANY, OPENAI, why="no per-user policy (as `user`)"),
    "prompt_cache_key": _f(ANY, OPENAI, why=_CACHE),
    "prompt_cache_options": _f(ANY, OPENAI, why=_CACHE),
    "prompt_cache_retention": _f(ANY, OPENAI, why=_CACHE),
    "thinking": _f(NULL, OPENAI),
    "prediction": _f(NULL, OPENAI),
    "audio": _f(NULL, OPENAI),
    "web_search_options": _f(NULL, OPENAI),
    "return_cached_tokens_details": _f((None, False), OPENAI),
    "return_spec_tokens_details": _f((None, False), OPENAI),
    "return_token_ids": _f((None, False), OPENAI),
    "return_meta_info": _f((None, False), OPENAI),
    "return_input_ids_in_sglext": _f((None, False), OPENAI),
    "return_output_ids_in_sglext": _f((None, False), OPENAI),
    "rid": _f(NULL, OPENAI),
    "continue_final_message": _f((None, False), CHAT),
    "separate_reasoning": _f(ANY, CHAT, why=_REASONING),
    "stream_reasoning": _f(ANY, CHAT, why=_REASONING),
    "chat_template_kwargs": _f((None, {}), CHAT),
    "input_ids": _f(NULL, CHAT),
    "task": _f(NULL, CHAT),
}


@cache
def fields_of(scope: str) -> dict[str, Unused]:
    """The table's fields that may appear in `scope` (CHAT includes OPENAI's). Made once per
    scope (every request asks): the caller must not change it."""
    scopes = {scope, OPENAI} if scope == CHAT else {scope}
    return {name: f for name, f in FIELDS.items() if f.scopes & scopes}


def check_unused(values: Mapping[str, Any], scope: str) -> list[str]:
    """Raise RequestError (400) naming a table field of `scope` that is not at an off value;
    return the names of `values` that are not table fields of `scope` (for the caller)."""
    table = fields_of(scope)
    for name, value in values.items():
        if name in table and not is_off(value, table[name].off):
            raise RequestError(f"Unsupported value {name}={_short(value)}: dllm-serve does not "
                               f"implement {name}; leave it out or send "
                               f"{_offs(table[name].off)}.", param=name)
    return [name for name in values if name not in table]


def is_off(value: Any, off: tuple[Any, ...]) -> bool:
    if off is ANY:
        return True
    if off is NONE_LIST:
        return value is None or (isinstance(value, list) and all(v is None for v in value))
    if off is ZERO_MAP:
        return value is None or (isinstance(value, dict) and all(
            not isinstance(v, bool) and isinstance(v, int | float) and v == 0
            for v in value.values()))
    return any(_same(value, o) for o in off)


def _same(value: Any, off: Any) -> bool:
    """Equality that keeps booleans apart from numbers (False is not a penalty of 0); an
    object's null members count as absent ({"type": "text", "json_schema": null} is off)."""
    if off is None or isinstance(off, bool):
        return value is off
    if isinstance(off, dict):
        return isinstance(value, dict) and {
            k: v for k, v in value.items() if v is not None} == off
    return not isinstance(value, bool) and type(value) in (type(off), int, float) \
        and value == off


def _offs(off: tuple[Any, ...]) -> str:
    if off is NONE_LIST:
        return "null"
    if off is ZERO_MAP:
        return "null or only zero biases"
    return " or ".join("null" if o is None else repr(o).lower() if isinstance(o, bool)
                       else repr(o) for o in off)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
