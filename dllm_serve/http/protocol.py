"""Request bodies (pydantic, strict types) and the rules for fields we do not implement.

Bodies are JSON objects in UTF-8, of valid Unicode (a lone UTF-16 surrogate such as "\\ud800" is
refused), nested at most MAX_DEPTH levels deep.
Types are strict: "2" is not an integer and 1 is not a boolean. A field of OpenAI's API that
dllm-serve does not implement is a 400 naming it, unless it carries its "off" value (some
clients send those by default). `dllm_<name>` fields are per-request settings of the running
decoding algorithm, checked by the algorithm itself.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dllm_serve.http.errors import APIError, validation_message

M = TypeVar("M", bound=BaseModel)

DLLM_PREFIX = "dllm_"
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions
MAX_DEPTH = 64  # OpenAI's bodies need about 5 levels
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Unimplemented OpenAI fields -> the values that mean "not used".
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "suffix": (None, ""), "logprobs": (None, False), "top_logprobs": (None,),
    "logit_bias": (None, {}), "best_of": (None, 1), "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "functions": (None, []), "function_call": (None, "none"), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "prediction": (None,),
    "audio": (None,), "web_search_options": (None,),
}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Lenient(BaseModel):
    """Extra fields are kept (model_extra) and sorted out by `dllm_overrides`."""

    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Lenient):
    """What /v1/completions and /v1/chat/completions share (plus SGLang's ignore_eos and
    stop_token_ids). temperature absent = 0: dLLM decoding is greedy unless asked."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]; see prompt_batch
    # Absent: COMPLETION_MAX_TOKENS (OpenAI's 16) or fewer if fewer fit; null: as many as fit.
    max_tokens: int | None = Field(None, ge=1)


class ContentPart(Strict):
    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI; same meaning
    max_completion_tokens: int | None = Field(None, ge=1)  # absent: as many as fit


Rid = Annotated[str, Field(min_length=1)]  # "" would be replaced by a random id, unabortable


class GenerateRequest(Strict):
    """SGLang's native /generate: text or input_ids (one or a batch)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: Rid | list[Rid] | None = None


class AbortRequest(Strict):
    rid: Rid | None = None
    abort_all: bool = False


def parse_body(model: type[M], body: bytes) -> M:
    """JSON bytes -> a validated request; 400 with a readable message otherwise."""
    try:
        text = body.decode("utf-8-sig")  # strict: no encoded surrogates, no other encodings
        obj = json.loads(text)
    except UnicodeDecodeError as e:
        raise APIError(400, f"The request body is not valid UTF-8: {e}") from None
    except ValueError as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(obj, dict):
        raise APIError(400, "The request body must be a JSON object.")
    _check_depth(obj, text)
    _check_unicode(obj, text)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise APIError(400, message, param=param) from None


def _check_depth(obj: object, text: str) -> None:
    """400 if containers nest deeper than MAX_DEPTH (walked only when the body has that many
    brackets at all)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    level: list[tuple[object, int]] = [(obj, 1)]
    while level:
        value, depth = level.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        children = value.values() if isinstance(value, dict) else value  # only containers
        level.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _too_deep() -> APIError:
    return APIError(400, f"The request body nests deeper than {MAX_DEPTH} levels.")


def _check_unicode(obj: object, text: str) -> None:
    """400 for a lone surrogate escape (valid JSON, but not Unicode text: the tokenizer and
    every UTF-8 encoder refuse it). Checked only when the body has a surrogate escape."""
    if not _SURROGATE_ESCAPE.search(text):
        return
    try:
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise APIError(400, f"The request body has a lone UTF-16 surrogate "
                       f"(\\u{ord(e.object[e.start]):x}), which is not valid Unicode.") from None


def dllm_overrides(req: Lenient) -> dict[str, Any]:
    """The request's dllm_* fields; raise 400 naming any other field we do not implement."""
    extra = dict(req.model_extra or {})
    overrides = {k: v for k, v in extra.items() if k.startswith(DLLM_PREFIX)}
    bad = sorted(k for k, v in extra.items()
                 if k not in overrides and not (k in NEUTRAL and _is_neutral(v, NEUTRAL[k])))
    if bad:
        raise APIError(400, f"Unsupported field(s): {', '.join(bad)}. dllm-serve does not "
                       f"implement them; remove them from the request.", param=bad[0])
    return overrides


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(_same(value, n) for n in neutral)


def _same(value: Any, neutral: Any) -> bool:
    """Equality that keeps booleans apart from numbers (False is not a penalty of 0)."""
    if neutral is None or isinstance(neutral, bool):
        return value is neutral
    return not isinstance(value, bool) and value == neutral


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
    if prompt == []:
        raise APIError(400, "Prompt cannot be empty.", param="prompt")
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a "
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
        raise APIError(400, f"Unsupported content part type(s): {', '.join(kinds)}; only "
                       f"text is supported.", param="messages")
    return "".join(p.text or "" for p in content)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
