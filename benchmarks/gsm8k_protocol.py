"""GSM8K few-shot protocols: prompts, stop strings, answer extraction.

    prompt = "".join(f"Question: {q}\\nAnswer: {a}\\n\\n" for q, a in shots)
             + f"Question: {q}\\nAnswer:"

Greedy (temperature 0), at most 512 new tokens, stop at any of `STOP`. Two protocols share that:

- `sglang` (the default): exactly SGLang's `sglang.test.few_shot_gsm8k`, so the figures compare
  with SGLang's. The shots are the first k rows of the scored file (so the first k scored
  questions are also shots). The prediction is the last run of digits once commas are removed,
  read as a Python literal: no sign (-10 reads as 10), and a run with a leading zero ("05") is
  invalid, as Python refuses it. Labels are read the same way.
- `clean`: shots from the train split (never a scored question), and the last signed integer
  (a minus sign counts where it cannot be a subtraction: "-10 degrees" is -10, "15-3" ends in 3).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.common import DATA_DIR, read_jsonl

STOP = ["Question", "Assistant:", "<|separator|>"]
MAX_NEW_TOKENS = 512
NUM_SHOTS = 5
NUM_QUESTIONS = 200
TRAIN_PATH = DATA_DIR / "train.jsonl"

_DIGITS = re.compile(r"\d+")
_SIGNED = re.compile(r"(?<!\d)-?\d+")


def sglang_answer(text: str) -> int | None:
    """SGLang's reading: the last digit run without commas; a leading zero is invalid."""
    found = _DIGITS.findall(text.replace(",", ""))
    if not found or (len(found[-1]) > 1 and found[-1][0] == "0"):
        return None
    return int(found[-1])


def signed_answer(text: str) -> int | None:
    """The last integer with commas removed, its sign kept; None (invalid) if there is none."""
    found = _SIGNED.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


@dataclass(frozen=True)
class Protocol:
    name: str
    shots_from: str  # "test": the scored file's first rows (SGLang), "train": the train split
    extract: Callable[[str], int | None]

    def label(self, row: dict[str, Any]) -> int:
        value = self.extract(row["answer"])
        if value is None:
            raise ValueError(f"GSM8K answer without a number: {row['answer']!r}")
        return value

    def shots(self, k: int, test_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return load_shots(self.shots_from, k, test_rows)


PROTOCOLS = {"sglang": Protocol("sglang", "test", sglang_answer),
             "clean": Protocol("clean", "train", signed_answer)}


def load_shots(source: str, k: int, test_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first k rows of the train split, or (SGLang's way) of the test rows being scored."""
    if source == "test":
        rows = test_rows
    elif source == "train":
        rows = read_jsonl(TRAIN_PATH)
    else:
        raise ValueError(f"shots come from train or test, got {source!r}")
    if k > len(rows):
        raise ValueError(f"{k} shots asked for, but only {len(rows)} {source} rows are available")
    return rows[:k]


def few_shot_prefix(shots: list[dict[str, Any]]) -> str:
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in shots)


def question_prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def build_prompts(rows: list[dict[str, Any]], shots: list[dict[str, Any]]) -> list[str]:
    prefix = few_shot_prefix(shots)
    return [prefix + question_prompt(r["question"]) for r in rows]
