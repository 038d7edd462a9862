"""Response bodies, as /openapi.json documents them (routes build plain dicts of this shape)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str  # a short message; a 5xx names the request id to find in the server log
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache held (each prompt's first copy)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class GenerateResponse(BaseModel):
    """One prompt's result (a batch, or n > 1, answers a list of these)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]  # id, finish_reason, prompt_tokens, completion_tokens, ...


class AbortResponse(BaseModel):
    success: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    served_model_name: str
    is_generation: bool
    context_length: int
    preferred_sampling_params: dict[str, Any] | None = None
    weight_version: str
    architectures: list[str]


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeResponse(BaseModel):
    text: str | list[str]  # SGLang's name
    prompt: str | list[str]  # vLLM's (and lm-eval's) name for the same text


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    mask_token: str | None
    add_bos_token: bool
    chat_template: str | None


class Load(BaseModel):
    dp_rank: int
    num_reqs: int  # running + waiting
    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int  # KV tokens held by requests


class Status(BaseModel):
    status: str


class ServerInfo(BaseModel):
    """The flags (ServerArgs, API key hidden), the scheduler's state (kv_pool, req_pool,
    num_running_reqs, num_waiting_reqs, stats), context_length, version, internal_states."""

    model_config = {"extra": "allow"}
    internal_states: list[dict[str, Any]]
    version: str
