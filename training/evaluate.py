"""Held-out evaluation of a trained small model: exact match, forwards per block, T2T edits.

The held-out set is generated problems from a seed the training never used, minus any whose
question also occurs among the training run's generated problems (the small templates do
repeat). A completion is right when its last integer equals the answer (the GSM8K graders'
rule); `strict` also asks that it end with "The answer is N.". Per-block statistics come from
the engine's meta_info: `block_forwards` (forwards each committed block took) and, where the
engine reports it, `block_edits` (T2T token edits in each committed block).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from training.data import format_prompt
from training.problems import final_number, generate_problems


@dataclass(frozen=True)
class HeldOut:
    prompts: list[str]
    answers: list[int]


def held_out_problems(n: int, seed: int, train_seed: int | None = None,
                      train_count: int = 0) -> HeldOut:
    """n zero-shot prompts from `seed`, skipping questions among the first `train_count`
    problems of `train_seed` (the training pool's)."""
    seen = {p.question for p in generate_problems(train_count, train_seed)} \
        if train_seed is not None and train_count else set()
    fresh = [p for p in generate_problems(4 * n + 100, seed) if p.question not in seen][:n]
    if len(fresh) < n:
        raise ValueError(f"only {len(fresh)} unseen problems for seed {seed}; ask for fewer")
    answers = [final_number(p.answer) for p in fresh]
    assert None not in answers, "every generated answer ends in a number"
    return HeldOut([format_prompt([], p) for p in fresh], answers)  # type: ignore[arg-type]


def score(texts: list[str], answers: list[int]) -> dict[str, float]:
    """Fractions right by the last integer (`exact`) and by the closing sentence (`strict`)."""
    exact = [final_number(t) == a for t, a in zip(texts, answers, strict=True)]
    strict = [t.strip().endswith(f"The answer is {a}.") for t, a in
              zip(texts, answers, strict=True)]
    return {"exact_match": sum(exact) / len(exact), "strict_match": sum(strict) / len(strict)}


def forwards_summary(per_block: list[int]) -> dict[str, Any]:
    """Distribution of forwards per committed block."""
    if not per_block:
        return {"blocks": 0}
    ordered = sorted(per_block)
    return {"blocks": len(ordered), "mean": statistics.fmean(ordered),
            "p10": _pct(ordered, 10), "p50": _pct(ordered, 50), "p90": _pct(ordered, 90),
            "min": ordered[0], "max": ordered[-1],
            "histogram": dict(sorted(Counter(ordered).items()))}


def _pct(ordered: list[int], q: float) -> int:
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def edits_summary(metas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Share of committed blocks with at least one T2T edit; None if the engine does not
    report `block_edits`."""
    if not metas or any("block_edits" not in m for m in metas):
        return None
    edits = [e for m in metas for e in m["block_edits"]]
    if not edits:
        return {"blocks": 0}
    return {"blocks": len(edits), "blocks_with_edit": sum(e > 0 for e in edits) / len(edits),
            "edits_per_block": statistics.fmean(edits)}
