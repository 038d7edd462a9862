"""`Tokenizer`: an HF checkpoint's tokenizer.json + tokenizer_config.json, without transformers.

Encoding never runs tokenizer.json's post-processor: a BOS is prepended only when
tokenizer_config says `add_bos_token: true` (chat templates carry their own special tokens).
Decoding is plain byte-level decoding with no clean-up, so decoding a growing id list yields a
growing string (only a trailing incomplete UTF-8 character may render as U+FFFD until its last
byte arrives), which is what incremental detokenisation relies on.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from dllm_serve.utils.jsonfile import read_json_object

logger = logging.getLogger(__name__)

# Every character str.isspace() holds (Unicode's whitespace, U+3000 the last).
WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
# Tokens that end a chat turn: LLaDA2's and the Qwen / SDAR one.
TURN_END_TOKENS = ("<|role_end|>", "<|im_end|>")


class TemplateError(ValueError):
    """Raised by a chat template's `raise_exception(...)`."""


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tok
        self.config = config
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.mask_token = _token_str(config.get("mask_token"))
        self.chat_template: str | None = _template_str(config.get("chat_template"))
        if self.add_bos_token and self.bos_token_id is None:
            logger.warning("add_bos_token is set but bos_token %r is not in the vocabulary; "
                           "no BOS will be added", self.bos_token)

    @staticmethod
    def load(path: str | Path) -> Tokenizer:
        """Read `path/tokenizer.json` and (if present) `path/tokenizer_config.json`; a
        `chat_template.jinja` beside them is the chat template, before tokenizer_config's
        (as Hugging Face's tokenizers load it: recent transformers save it there)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {str(path)!r}")
        config = read_json_object(path / "tokenizer_config.json")
        template = path / "chat_template.jinja"
        if template.is_file():
            config = {**config, "chat_template": template.read_text()}
        return Tokenizer(HFTokenizer.from_file(str(file)), config)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def mask_token_id(self) -> int | None:
        return self._id_of(self.mask_token)

    @property
    def extra_stop_token_ids(self) -> list[int]:
        """Ids that end a turn (`TURN_END_TOKENS`) and the EOS, those the vocabulary has."""
        ids = [*(self.token_to_id(t) for t in TURN_END_TOKENS), self.eos_token_id]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; a BOS first only with add_bos_token and add_special_tokens. Encoded as a
        batch of one: `encode_batch` lets go of the GIL while it runs (`encode` holds it), so a
        long text tokenized in a worker thread does not stop the thread that called it off
        (the HTTP server's event loop: 30 MB of text took 31 s on a 2-core CPU)."""
        return self.encode_batch([text], add_special_tokens)[0]

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's length in characters (added tokens included): no token covers
        more of a text than this."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without encoding it: its characters other
        than whitespace (which some pipelines drop) over the longest token's, over 4 more (a
        normalizer may compose a few characters into one). Counting the whitespace reads the
        text once per whitespace character: `fits_at_most` skips it for texts too short to
        matter."""
        visible = len(text) - sum(map(text.count, WHITESPACE))
        return visible // (4 * self.max_token_chars)

    def fits_at_most(self, text: str, tokens: int) -> bool:
        """Whether `text` may encode to at most `tokens` tokens (False: certainly more), read
        only when its length alone leaves it in doubt."""
        return len(text) < 4 * self.max_token_chars * (tokens + 1) or \
            self.min_tokens(text) <= tokens

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, the texts spread over the tokenizer's threads."""
        return [self._with_bos(enc.ids, add_special_tokens)
                for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_batch(self, lists: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each list, letting go of the GIL while it decodes (a single `decode`
        holds it: 3M ids, 0.4 s on a 2-core CPU, stop every other thread)."""
        return self._tok.decode_batch([[int(i) for i in ids] for ids in lists],
                                      skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with tokenizer_config's jinja `chat_template` (HF semantics)."""
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


    @cached_property
    def _compiled_template(self) -> Template:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (chat_template.jinja, or "
                             "chat_template in tokenizer_config.json); "
                             "send a plain prompt instead of chat messages")
        return _jinja_env().from_string(self.chat_template)


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_str(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"}: take "default"."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
