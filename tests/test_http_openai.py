"""The OpenAI API through the official `openai` client, against the real server (tiny model)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from http_helpers import Server, pools_whole, shared_server

from dllm_serve.model.config import ModelConfig
from dllm_serve.tokenizer import Tokenizer

LONG = {"ignore_eos": True}  # the random tiny model may emit EOS at any time


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Server:
    return shared_server(tiny_model_dir)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="EMPTY", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir)


def chat_prompt_len(tok: Tokenizer, messages: list[dict[str, str]]) -> int:
    return len(tok.encode(tok.apply_chat_template(messages)))


def test_completion_usage_and_shape(client: openai.OpenAI, tok: Tokenizer) -> None:
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=40,
                                  extra_body=LONG)
    assert r.id.startswith("cmpl-") and isinstance(r.created, int) and r.model == "tiny"
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == len(tok.encode("Hello there"))
    assert r.usage.completion_tokens == 40
    assert r.usage.total_tokens == r.usage.prompt_tokens + 40


def test_batch_prompts_and_n_count_usage_exactly(client: openai.OpenAI, tok: Tokenizer) -> None:
    prompts = ["The capital of France is", "2 + 2 ="]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=12,
                                  extra_body=LONG)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # temperature 0: copies agree
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)  # once per prompt
    assert r.usage.completion_tokens == 4 * 12
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                    extra_body=LONG)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2
    one = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3,
                                    extra_body=LONG)
    assert one.usage.prompt_tokens == 3 and one.choices[0].text == ids.choices[0].text


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    args = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 70, "extra_body": LONG}
    full = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert len(chunks) <= 3  # one chunk per committed block: 70 tokens = 3 blocks of 32
    assert all(c.usage is None for c in chunks)


def test_stream_n2_include_usage(client: openai.OpenAI, tok: Tokenizer) -> None:
    chunks = list(client.completions.create(
        model="tiny", prompt="abc", max_tokens=40, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body=LONG))
    *body, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == len(tok.encode("abc"))
    assert last.usage.completion_tokens == 80
    for index in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == index]
        assert sum(c.finish_reason is not None for c in mine) == 1
        assert mine[-1].finish_reason == "length"


def test_chat_non_stream_and_stream_agree(client: openai.OpenAI, tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50,
                                       extra_body=LONG)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == chat_prompt_len(tok, messages)
    assert r.usage.completion_tokens == 50
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=50,
                                                 stream=True, n=2, extra_body=LONG))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert sum(c.finish_reason is not None for c in mine) == 1
        assert "".join(c.delta.content or "" for c in mine) == r.choices[0].message.content


def test_max_completion_tokens_and_text_parts(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", max_completion_tokens=5, extra_body=LONG,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert r.usage.completion_tokens == 5 and r.model == "tiny"


def test_stop_strings_truncate_in_stream_and_not(client: openai.OpenAI) -> None:
    args = {"model": "tiny", "prompt": "Tell me a story", "max_tokens": 64, "extra_body": LONG}
    text = client.completions.create(**args).choices[0].text
    start = next(i for i in range(5, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    cut = text[:text.find(stop)]
    r = client.completions.create(stop=[stop, "never-there"], **args)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["matched_stop"] == stop  # as SGLang's stream
    assert r.choices[0].model_extra["matched_stop"] == stop


def test_a_regex_stop_cuts_where_it_matched_in_stream_and_not(client: openai.OpenAI) -> None:
    """Regression: the non-streamed text was cut at the matched text's first occurrence, not
    where the regex matched (a lookbehind rules the first one out)."""
    import re

    args = {"model": "tiny", "prompt": "Tell me a story", "max_tokens": 96, "extra_body": LONG}
    text = client.completions.create(**args).choices[0].text
    case = next((text[j - 1], text[j:j + 2], j) for j in range(2, len(text) - 2)
                if "\ufffd" not in text[j - 1:j + 2] and (i := text.find(text[j:j + 2])) < j
                and text[j - 1] not in (text[i - 1:i] or "") and text[j - 1] != text[j]
                and re.search(f"(?<={re.escape(text[j - 1])}){re.escape(text[j:j + 2])}",
                              text).start() == j)
    before, match, j = case
    pattern = f"(?<={re.escape(before)}){re.escape(match)}"
    body = {**args, "extra_body": {**LONG, "stop_regex": [pattern]}}
    r = client.completions.create(**body)
    assert r.choices[0].text == text[:j] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks) == text[:j]


def test_seeded_sampling(client: openai.OpenAI) -> None:
    args = {"model": "tiny", "prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 7,
            "extra_body": LONG}
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(n=2, **args)
    assert two.choices[0].text == a.choices[0].text != two.choices[1].text


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_any_int64_seed_is_a_seed(client: openai.OpenAI, seed: int) -> None:
    """vLLM takes any int64 as a seed (-1 too): the same seed, the same text; copy i of n
    uses seed + i wrapped into int64, so the copies past 2**63 - 1 differ too."""
    args = {"model": "tiny", "prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": seed,
            "extra_body": LONG}
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(n=2, **args)
    assert two.choices[0].text == a.choices[0].text != two.choices[1].text


def test_dllm_override_is_applied_and_checked(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="x", max_tokens=8,
                                  extra_body={"dllm_threshold": 0.5, **LONG})
    assert r.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="dllm_edit_threshold"):
        client.completions.create(model="tiny", prompt="x", max_tokens=8,
                                  extra_body={"dllm_edit_threshold": 0.5})


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == 4096  # type: ignore[attr-defined]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-a-model")


def test_a_reply_appended_to_the_history_is_accepted(client: openai.OpenAI) -> None:
    """The usual multi-turn pattern: the reply's `message.model_dump()` (with OpenAI's null
    refusal, annotations, audio, function_call and tool_calls) goes back into messages."""
    history = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                           extra_body=LONG)
    history += [first.choices[0].message.model_dump(), {"role": "user", "content": "More"}]
    assert history[1]["refusal"] is None and "tool_calls" in history[1]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                            extra_body=LONG)
    assert second.usage.completion_tokens == 4
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="refusal"):
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "assistant", "content": "a", "refusal": "no"}])


def test_nullable_n_and_stream_mean_their_defaults(client: openai.OpenAI) -> None:
    """OpenAI's spec makes n and stream nullable (null: 1 choice, no stream), and its client
    sends stream_options.include_obfuscation."""
    args = {"model": "tiny", "prompt": "x", "max_tokens": 3, "extra_body": LONG}
    r = client.completions.create(n=None, stream=None, **args)
    assert len(r.choices) == 1 and r.usage.completion_tokens == 3
    chunks = list(client.completions.create(
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
        **args))
    assert chunks[-1].usage.completion_tokens == 3


def test_continuous_usage_stats_gives_the_usage_so_far_on_every_chunk(
        client: openai.OpenAI, tok: Tokenizer) -> None:
    """Regression: continuous_usage_stats was accepted and ignored. With include_usage (as
    vLLM) each chunk carries the usage so far; the last one the whole."""
    chunks = list(client.completions.create(
        model="tiny", prompt="abc", max_tokens=70, n=2, stream=True, extra_body=LONG,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    *body, last = chunks
    prompt = len(tok.encode("abc"))
    so_far = [c.usage.completion_tokens for c in body]
    assert all(c.usage.prompt_tokens == prompt for c in body)
    assert so_far == sorted(so_far) and 0 < so_far[0] and so_far[-1] == 140
    assert last.choices == [] and last.usage.completion_tokens == 140
    alone = list(client.completions.create(
        model="tiny", prompt="abc", max_tokens=8, stream=True, extra_body=LONG,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)  # without include_usage: no usage (as vLLM)


@pytest.mark.parametrize("field,value", [
    ("safety_identifier", "user-1"), ("prompt_cache_key", "k"),
    ("prompt_cache_retention", "24h"), ("prompt_cache_options", {"ttl": "30m"}),
    ("verbosity", None), ("verbosity", "medium"), ("moderation", None),
    ("reasoning_effort", "none"), ("logit_bias", {"5": 0, "6": 0.0}),
    ("response_format", {"type": "text", "json_schema": None})])
def test_current_openai_fields_at_off_values_are_accepted(client: openai.OpenAI, field: str,
                                                          value: object) -> None:
    """Regression: the OpenAI client's newer chat fields were a 400 even at null, and so were
    reasoning_effort "none", an all-zero logit_bias and a text response_format with a null
    member."""
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                       max_tokens=3, extra_body={**LONG, field: value})
    assert r.usage.completion_tokens == 3


@pytest.mark.parametrize("field,value", [
    ("verbosity", "high"), ("moderation", {"model": "m"}), ("reasoning_effort", "low"),
    ("logit_bias", {"5": 1}), ("logit_bias", {"5": False})])
def test_values_that_cannot_be_honoured_are_refused(client: openai.OpenAI, field: str,
                                                    value: object) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                       max_tokens=3, extra_body={field: value})
    assert e.value.body["param"] == field


def test_chat_errors_name_the_chat_fields(client: openai.OpenAI) -> None:
    """Regression: chat errors named `prompt` and `max_tokens`, fields a chat request has not."""
    user = [{"role": "user", "content": "a"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user, max_completion_tokens=5000)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=user, max_tokens=5000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "word " * 5000}])
    assert e.value.body["param"] == "messages"


def test_max_tokens_0_is_an_empty_completion_and_echo_is_named(client: openai.OpenAI) -> None:
    """OpenAI allows max_tokens 0 (scoring harnesses send it with echo): an empty completion,
    and with echo the 400 names echo, not max_tokens."""
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="abc", max_tokens=0, echo=True)
    assert e.value.body["param"] == "echo"


def test_a_prompt_holding_the_mask_token_is_refused(client: openai.OpenAI,
                                                    tiny_model_dir: Path) -> None:
    """Regression: a mask id in the prompt was rewritten by the denoiser (in its last block)
    or left as a hole (before it)."""
    mask = ModelConfig.load(tiny_model_dir).token_id("mask_token_id")
    for prompt in ([5, mask, 6], [mask] * 4):
        with pytest.raises(openai.BadRequestError, match="mask token") as e:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
        assert e.value.body["param"] == "prompt"


def test_pools_whole_after_everything(server: Server) -> None:
    pools_whole(server)
