"""Request bodies (pydantic, strict types): what every route accepts, as /openapi.json shows it.

Types are strict: "2" is not an integer and 1 is not a boolean. Floats must be finite and within
float32's range. Fields of SGLang's and OpenAI's APIs that dllm-serve accepts but does not use
come from the one table in `dllm_serve/request_fields.py` (declared here so the schema lists
them; checked by `unused_and_overrides`). `dllm_<name>` fields are per-request settings of the
running decoding algorithm, checked by the algorithm itself. Bodies are read and parsed by
body.py before validation.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator

from dllm_serve.errors import RequestError
from dllm_serve.request_fields import (
    ANY,
    CHAT,
    GENERATE,
    NONE_LIST,
    OPENAI,
    SAMPLING,
    ZERO_MAP,
    check_unused,
)
from dllm_serve.request_fields import fields_of as table_fields
from dllm_serve.sampling_params import DLLM_PREFIX, FLOAT32_MAX, MAX_N, SEED_MAX, SEED_MIN

COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions
DLLM_DOC = ("dllm_<setting>: a per-request setting of the running decoding algorithm "
            "(e.g. dllm_threshold); other extra fields are a 400.")


def _float(low: float, high: float = FLOAT32_MAX, above: bool = False) -> Any:
    bound = {"gt": low} if above else {"ge": low}
    return Annotated[float, Field(le=high, allow_inf_nan=False, **bound)]


Temperature = _float(0.0)  # < 1e-5: greedy
TopP = _float(0.0, 1.0, above=True)
MinP = _float(0.0, 1.0)
TopK = Annotated[int, Field(ge=-1)]  # -1: off; 0 is refused
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]  # any int64, as vLLM
Count = Annotated[int, Field(ge=0)]
Rid = Annotated[str, Field(min_length=1)]  # "" would be replaced by a random id, unabortable
Stops = str | list[str] | None


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class WithOverrides(BaseModel):
    """Extra fields are kept (model_extra) and sorted out by `unused_and_overrides`."""

    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={
        "patternProperties": {f"^{DLLM_PREFIX}": {"type": "number", "description": DLLM_DOC}},
        "additionalProperties": False})


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # with include_usage: every chunk has the usage so far
    include_obfuscation: bool = True  # accepted (OpenAI's client sends it); chunks carry no
    # obfuscation padding


def _null_is_default(value: Any, info: ValidationInfo) -> Any:
    """A field that OpenAI's spec makes nullable: null means its default."""
    return SamplingFields.model_fields[info.field_name].default if value is None else value


class SamplingFields(WithOverrides):
    """What /v1/completions and /v1/chat/completions share (with SGLang's and vLLM's extras).
    temperature absent = 0: dLLM decoding is greedy unless asked."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    min_tokens: Count = 0
    stop: Stops = None
    stop_regex: Stops = None
    stop_token_ids: list[int] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None

    _nulls = field_validator("n", "stream", mode="before")(_null_is_default)


class _Completion(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]  # see prompt_batch
    # Absent: COMPLETION_MAX_TOKENS (OpenAI's 16) or fewer if fewer fit; null: as many as fit.
    max_tokens: int | None = Field(None, ge=0)  # 0: an empty completion (OpenAI allows it)


class ContentPart(Strict):
    type: str
    text: str | None = None


class ChatMessage(Strict):
    """One message. The fields OpenAI's client echoes back on an assistant message
    (`message.model_dump()` appended to the history) are accepted empty: dllm-serve has no
    refusals, annotations, audio or tool calls to replay."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_call_id: None = None


class _Chat(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI; same meaning
    max_completion_tokens: int | None = Field(None, ge=1)  # absent: as many as fit


class _NativeSampling(WithOverrides):
    """SGLang's native sampling_params (dllm-serve's SamplingParams)."""

    max_new_tokens: Count | None = None  # absent or null: 128 or fewer if fewer fit; 0: empty
    min_new_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: Stops = None
    stop_regex: Stops = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    seed: Seed | None = None
    sampling_seed: Seed | None = None  # SGLang's name for seed (SamplingParams.from_dict)


def _with_table(name: str, base: type[BaseModel], scope: str) -> Any:
    """`base` plus the table's fields of `scope`, each documented with its off values."""
    extra = {field: (Any, Field(None, description=_describe(f.off, f.why),
                                json_schema_extra=_values(f.off)))
             for field, f in table_fields(scope).items() if field not in base.model_fields}
    return create_model(name, __base__=base, __doc__=base.__doc__, **extra)


def _values(off: tuple[Any, ...]) -> dict[str, Any] | None:
    """The JSON-schema of the accepted values: any (ANY), null or a list of nulls, or an enum
    of the off values."""
    if off is ANY:
        return None
    if off is NONE_LIST:
        return {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "null"}}]}
    if off is ZERO_MAP:
        return {"anyOf": [{"type": "null"}, {"type": "object",
                                             "additionalProperties": {"const": 0}}]}
    return {"enum": list(off)}


def _describe(off: tuple[Any, ...], why: str) -> str:
    if off is ANY:
        return f"Accepted and ignored: {why}."
    if off is NONE_LIST:
        return "Not implemented: accepted only as null (or a list of nulls)."
    if off is ZERO_MAP:
        return "Not implemented: accepted only as null or an object of zero biases."
    return "Not implemented: accepted only at its off value(s) " + ", ".join(
        "null" if o is None else repr(o) for o in off) + "."


CompletionRequest = _with_table("CompletionRequest", _Completion, OPENAI)
ChatCompletionRequest = _with_table("ChatCompletionRequest", _Chat, CHAT)
NativeSamplingParams = _with_table("NativeSamplingParams", _NativeSampling, SAMPLING)


class _Generate(Strict):
    """SGLang's native /generate: text or input_ids (one or a batch)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    rid: Rid | list[Rid] | None = None


GenerateRequest = _with_table("GenerateRequest", _Generate, GENERATE)


class AbortRequest(Strict):
    rid: Rid | None = None
    abort_all: bool = False


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def unused_and_overrides(req: BaseModel, scope: str) -> dict[str, Any]:
    """Check the table's fields of `scope` that the request set (400 naming one at a value
    dllm-serve cannot honour) and its extra fields: the dllm_* ones are returned, any other
    is a 400 naming it."""
    table = table_fields(scope)
    check_unused({k: getattr(req, k) for k in req.model_fields_set if k in table}, scope)
    extra = dict(req.model_extra or {})
    overrides = {k: v for k, v in extra.items() if k.startswith(DLLM_PREFIX)}
    bad = sorted(k for k in extra if k not in overrides)
    if bad:
        raise RequestError(f"Unsupported field(s): {', '.join(bad)}. dllm-serve does not "
                           f"implement them; remove them from the request.", param=bad[0])
    return overrides


def native_params(p: BaseModel | None) -> dict[str, Any] | None:
    """A /generate sampling_params model -> the dict SamplingParams.from_dict takes."""
    if p is None:
        return None
    return {**p.model_dump(exclude_unset=True), **(p.model_extra or {})}


def prompt_batch(prompt: Any) -> list[str | list[int]]:
    """A completion `prompt` -> a non-empty list of prompts (each text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    if prompt == [] or prompt == [[]]:
        raise RequestError("Prompt cannot be empty.", param="prompt")
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a "
                       "list of token-id lists.", param="prompt")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the chat template expects them; text content only."""
    return [{"role": m.role, "content": _text(m.content),
             **({"name": m.name} if m.name is not None else {})} for m in messages]


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    kinds = sorted({p.type for p in content if p.type != "text"})
    if kinds:
        raise RequestError(f"Unsupported content part type(s): {', '.join(kinds)}; only "
                           f"text is supported.", param="messages")
    return "".join(p.text or "" for p in content)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
