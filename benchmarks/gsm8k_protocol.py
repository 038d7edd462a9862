"""SGLang's few-shot GSM8K protocol for dLLMs: prompts, stop strings, answer extraction.

    prompt = "".join(f"Question: {q}\\nAnswer: {a}\\n\\n" for q, a in shots)
             + f"Question: {q}\\nAnswer:"

Greedy (temperature 0), at most 512 new tokens, stop at any of `STOP`. The prediction is the last
integer in the completion once commas are removed; a completion without one is invalid. The label
is read from the gold answer the same way (its last number is the one after `####`).
"""

from __future__ import annotations

import re
from typing import Any

from benchmarks.common import DATA_DIR, read_jsonl

STOP = ["Question", "Assistant:", "<|separator|>"]
MAX_NEW_TOKENS = 512
NUM_SHOTS = 5
NUM_QUESTIONS = 200
TRAIN_PATH = DATA_DIR / "train.jsonl"

# A minus sign counts only where it cannot be a subtraction: "-10 degrees" is -10, "15-3" ends in 3.
_INTEGER = re.compile(r"(?<!\d)-?\d+")


def extract_answer(text: str) -> int | None:
    """The last integer in `text` with commas removed; None (invalid) if there is none."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def label(row: dict[str, Any]) -> int:
    value = extract_answer(row["answer"])
    if value is None:
        raise ValueError(f"GSM8K answer without a number: {row['answer']!r}")
    return value


def load_shots(source: str, k: int, test_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first k rows of the train split, or (SGLang's quirk) of the test rows being scored."""
    if source == "test":
        rows = test_rows
    elif source == "train":
        rows = read_jsonl(TRAIN_PATH)
    else:
        raise ValueError(f"--shots-from must be train or test, got {source!r}")
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
