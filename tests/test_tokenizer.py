"""Tokenizer wrapper over tokenizer.json + tokenizer_config.json (no transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dllm_serve.tokenizer import TemplateError, Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir)


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("text", [
    "Janet's ducks lay 16 eggs per day. 12 + 35 = 47",
    "  leading spaces,\ttabs\nand newlines  ",
    "héllo wörld, 日本語 and emoji 🦆",
    "",
])
def test_round_trip(tok, text) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_ids_match_config(tok, tiny_model_dir) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert tok.eos_token_id == cfg["eos_token_id"] == cfg["pad_token_id"]
    assert tok.mask_token_id == cfg["mask_token_id"]
    assert tok.token_to_id("<|mask|>") == cfg["mask_token_id"]
    assert tok.token_to_id("<|endoftext|>") == cfg["eos_token_id"]
    assert tok.token_to_id("no such token") is None
    assert tok.vocab_size <= cfg["vocab_size"]
    assert tok.extra_stop_token_ids == [tok.token_to_id("<|role_end|>"), tok.eos_token_id]
    assert tok.bos_token_id == tok.token_to_id("<|startoftext|>")


def test_special_tokens_encode_as_one_id_and_skip_on_decode(tok) -> None:
    ids = tok.encode("<role>HUMAN</role>hi<|role_end|><|mask|>")
    assert ids[0] == tok.token_to_id("<role>")
    assert ids[-2:] == [tok.token_to_id("<|role_end|>"), tok.mask_token_id]
    assert tok.decode(ids) == "HUMANhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<role>HUMAN</role>hi<|role_end|><|mask|>"


def test_no_bos_by_default_and_bos_when_configured(tok, tiny_model_dir, tmp_path) -> None:
    assert tok.encode("hi")[0] != tok.bos_token_id
    bos_tok = Tokenizer.load(_with_config(tiny_model_dir, tmp_path / "t", add_bos_token=True))
    assert bos_tok.encode("hi") == [tok.bos_token_id, *tok.encode("hi")]


def test_encode_batch_is_encode_of_each(tok, tiny_model_dir, tmp_path) -> None:
    texts = ["Ducks 🦆 lay 16 eggs.", "<role>HUMAN</role>hi<|role_end|>", "x" * 300, "héllo"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    bos_tok = Tokenizer.load(_with_config(tiny_model_dir, tmp_path / "t", add_bos_token=True))
    assert bos_tok.encode_batch(texts) == [bos_tok.encode(t) for t in texts]
    assert bos_tok.encode_batch(texts, add_special_tokens=False) == [
        bos_tok.encode(t, add_special_tokens=False) for t in texts]


def test_decode_batch_is_decode_of_each(tok) -> None:
    lists = [tok.encode(t) for t in ("Ducks 🦆 lay 16 eggs.", "<role>HUMAN</role>hi<|role_end|>",
                                     "x" * 300, "héllo")] + [[], [tok.mask_token_id]]
    for skip in (True, False):
        assert tok.decode_batch(lists, skip) == [tok.decode(ids, skip) for ids in lists]


def test_incremental_decode_grows_a_prefix(tok) -> None:
    text = "Ducks 🦆 lay 16 eggs, héllo."
    ids = tok.encode(text)
    previous = ""
    for n in range(1, len(ids) + 1):
        current = tok.decode(ids[:n]).rstrip("\ufffd")
        assert current.startswith(previous)
        previous = current
    assert previous == text


def test_chat_template_exact(tok) -> None:
    messages = [{"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": "5"},
                {"role": "user", "content": "And 4+4?"}]
    assert tok.apply_chat_template(messages) == (
        "<role>SYSTEM</role>detailed thinking off<|role_end|>"
        "<role>HUMAN</role>What is 2+3?<|role_end|>"
        "<role>ASSISTANT</role>5<|role_end|>"
        "<role>HUMAN</role>And 4+4?<|role_end|>"
        "<role>ASSISTANT</role>")
    with_system = [{"role": "system", "content": "Be brief."}, messages[0]]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>What is 2+3?<|role_end|>")


def test_chat_template_errors(tok, tiny_model_dir, tmp_path) -> None:
    with pytest.raises(TemplateError, match="unsupported role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    plain = Tokenizer.load(_with_config(tiny_model_dir, tmp_path / "t", chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_chat_template_jinja_file_is_the_template(tok, tiny_model_dir, tmp_path) -> None:
    """Regression: a template saved as chat_template.jinja (recent transformers do) was
    ignored. Like Hugging Face's loader, the file comes before tokenizer_config's."""
    moved = _with_config(tiny_model_dir, tmp_path / "moved", chat_template=None)
    (moved / "chat_template.jinja").write_text(tok.chat_template)
    messages = [{"role": "user", "content": "hi"}]
    assert Tokenizer.load(moved).apply_chat_template(messages) == tok.apply_chat_template(messages)
    both = _with_config(tiny_model_dir, tmp_path / "both")
    (both / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert Tokenizer.load(both).apply_chat_template(messages) == "hi!"


def test_template_helpers_and_sandbox(tiny_model_dir, tmp_path) -> None:
    template = ("{{ messages[0] | tojson }}{% for m in messages %}{% if loop.index > 1 %}"
                "{% break %}{% endif %}|{{ m.content }}{% endfor %}{{ bos_token }}")
    t = Tokenizer.load(_with_config(tiny_model_dir, tmp_path / "t", chat_template=template))
    messages = [{"role": "user", "content": "é"}, {"role": "user", "content": "ignored"}]
    assert t.apply_chat_template(messages) == '{"role": "user", "content": "é"}|é<|startoftext|>'
    evil = "{{ messages.append(1) }}"
    t = Tokenizer.load(_with_config(tiny_model_dir, tmp_path / "u", chat_template=evil))
    with pytest.raises(Exception, match="unsafe|immutable|not safely"):
        t.apply_chat_template(messages)
