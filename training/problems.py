"""Generated arithmetic word problems with exact answers, deterministic by seed.

Families: one-step addition, subtraction, multiplication, prices, exact division, and
multi-step mixes of them, about people and everyday objects. Every answer is a short
step-by-step computation whose text ends in the result: "... 3 + 5 = 8 apples. The answer is 8."
The family "Tom has 3 apples and buys 5 more. How many apples does he have?" is included in
exactly that wording. `generate_problems(n, seed)` always returns the same list for the same
arguments (Python's `random.Random`, no global state).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class QA:
    """A question and its worked answer (GSM8K rows and generated problems alike)."""

    question: str
    answer: str


@dataclass(frozen=True)
class Person:
    name: str
    he: str  # subject pronoun
    him: str
    his: str

    @property
    def He(self) -> str:  # noqa: N802 (sentence-initial pronoun)
        return self.he.capitalize()


_BOYS = ("Tom Sam Ben Max Leo Jack Noah Liam Omar Ravi Carlos Ken Hugo Ivan Paul Eli Felix "
         "Marco Jamal Owen").split()
_GIRLS = ("Anna Mia Lily Emma Sara Nina Zoe Maya Rosa Aisha Lucy Grace Ella Priya Julia Hana "
          "Chloe Olivia Fatima Kate").split()
PEOPLE = tuple([Person(n, "he", "him", "his") for n in _BOYS]
               + [Person(n, "she", "her", "her") for n in _GIRLS])
OBJECTS = tuple(("apples oranges pencils stickers marbles cookies books cards coins eggs flowers "
                 "balloons toys shells stamps candies bananas crayons buttons blocks cupcakes "
                 "rocks beads muffins tickets erasers pens plums lemons peaches").split())
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("basket", "baskets"),
              ("jar", "jars"), ("tray", "trays"), ("crate", "crates"))
# A minus sign counts only where it cannot be a subtraction ("15-3" ends in 3).
_INTEGER = re.compile(r"(?<!\d)-?\d+")
TAKE_VERBS = (("gives", "gave", "giving"), ("sells", "sold", "selling"),
              ("loses", "lost", "losing"))


def generate_problems(n: int, seed: int) -> list[QA]:
    """n problems drawn from the families below with their weights; same (n, seed), same list."""
    rng = random.Random(seed)
    makers, weights = zip(*FAMILIES, strict=True)
    return [rng.choices(makers, weights)[0](rng) for _ in range(n)]


def _number(rng: random.Random, low: int = 1) -> int:
    """Mostly small numbers, sometimes two-digit ones."""
    top = rng.choices((12, 30, 99), (0.5, 0.35, 0.15))[0]
    return rng.randint(low, max(low, top))


def _two_people(rng: random.Random) -> tuple[Person, Person]:
    a, b = rng.sample(PEOPLE, 2)
    return a, b


def add_more(rng: random.Random) -> QA:
    p, obj = rng.choice(PEOPLE), rng.choice(OBJECTS)
    a, b = _number(rng), _number(rng)
    r = a + b
    return rng.choice((
        QA(f"{p.name} has {a} {obj} and buys {b} more. How many {obj} does {p.he} have?",
           f"{p.name} has {a} {obj} and buys {b} more, so {p.he} has {a} + {b} = {r} {obj}. "
           f"The answer is {r}."),
        QA(f"{p.name} has {a} {obj}. {p.He} finds {b} more. How many {obj} does {p.he} have now?",
           f"{p.name} has {a} {obj} and finds {b} more, so {p.he} has {a} + {b} = {r} {obj}. "
           f"The answer is {r}."),
        QA(f"{p.name} picks {a} {obj} in the morning and {b} {obj} in the afternoon. "
           f"How many {obj} does {p.he} pick in all?",
           f"{p.name} picks {a} + {b} = {r} {obj} in all. The answer is {r}."),
    ))


def take_away(rng: random.Random) -> QA:
    (p, other), obj = _two_people(rng), rng.choice(OBJECTS)
    b = _number(rng)
    a = b + _number(rng, 0)
    verb, past, _ = rng.choice(TAKE_VERBS)
    target = f" to {other.name}" if verb == "gives" else ""
    q = f"{p.name} has {a} {obj} and {verb} {b}{target}. How many {obj} does {p.he} have left?"
    return QA(q, f"{p.name} had {a} {obj} and {past} {b}, so {p.he} has {a} - {b} = {a - b} "
                 f"{obj} left. The answer is {a - b}.")


def containers(rng: random.Random) -> QA:
    p, obj = rng.choice(PEOPLE), rng.choice(OBJECTS)
    (box, boxes), a, b = rng.choice(CONTAINERS), rng.randint(2, 12), rng.randint(2, 12)
    q = (f"{p.name} buys {a} {boxes} of {obj}. Each {box} has {b} {obj}. "
         f"How many {obj} does {p.he} buy?")
    return QA(q, f"Each {box} has {b} {obj}, so {a} {boxes} have {a} * {b} = {a * b} {obj}. "
                 f"The answer is {a * b}.")


def price(rng: random.Random) -> QA:
    p, obj = rng.choice(PEOPLE), rng.choice(OBJECTS)
    a, b = rng.randint(2, 12), rng.randint(1, 20)
    q = f"{p.name} buys {a} {obj}. Each one costs ${b}. How much money does {p.he} spend?"
    return QA(q, f"{p.name} buys {a} {obj} at ${b} each, so {p.he} spends {a} * {b} = "
                 f"${a * b}. The answer is {a * b}.")


def share(rng: random.Random) -> QA:
    p, obj = rng.choice(PEOPLE), rng.choice(OBJECTS)
    b, r = rng.randint(2, 10), rng.randint(1, 12)
    q = (f"{p.name} has {b * r} {obj} and shares them equally among {b} friends. "
         f"How many {obj} does each friend get?")
    return QA(q, f"{p.name} shares {b * r} {obj} among {b} friends, so each friend gets "
                 f"{b * r} / {b} = {r} {obj}. The answer is {r}.")


def together(rng: random.Random) -> QA:
    (p, other), obj = _two_people(rng), rng.choice(OBJECTS)
    a, b = _number(rng), _number(rng)
    q = (f"{p.name} has {a} {obj} and {other.name} has {b} {obj}. "
         f"How many {obj} do they have in total?")
    return QA(q, f"Together they have {a} + {b} = {a + b} {obj}. The answer is {a + b}.")


def buy_then_take(rng: random.Random) -> QA:
    (p, other), obj = _two_people(rng), rng.choice(OBJECTS)
    a, b = _number(rng), _number(rng)
    c = rng.randint(1, a + b)
    verb, past, ing = rng.choice(TAKE_VERBS)
    q = (f"{p.name} has {a} {obj}. {p.He} buys {b} more and then {verb} {c} to {other.name}. "
         f"How many {obj} does {p.he} have now?") if verb == "gives" else (
        f"{p.name} has {a} {obj}. {p.He} buys {b} more and then {verb} {c}. "
        f"How many {obj} does {p.he} have now?")
    s = a + b
    return QA(q, f"{p.name} starts with {a} {obj}. After buying {b} more, {p.he} has {a} + {b} = "
                 f"{s} {obj}. After {ing} {c}, {p.he} has {s} - {c} = {s - c} {obj}. "
                 f"The answer is {s - c}.")


def boxes_plus(rng: random.Random) -> QA:
    p, obj = rng.choice(PEOPLE), rng.choice(OBJECTS)
    (box, boxes), a, b, c = rng.choice(CONTAINERS), rng.randint(2, 9), rng.randint(2, 9), \
        _number(rng)
    q = (f"{p.name} has {c} {obj}. {p.He} buys {a} {boxes} with {b} {obj} in each {box}. "
         f"How many {obj} does {p.he} have now?")
    m = a * b
    return QA(q, f"The {boxes} hold {a} * {b} = {m} {obj}. So {p.name} has {c} + {m} = {c + m} "
                 f"{obj}. The answer is {c + m}.")


def compare(rng: random.Random) -> QA:
    (p, other), obj = _two_people(rng), rng.choice(OBJECTS)
    b = _number(rng)
    more = rng.random() < 0.5
    a = _number(rng) + (0 if more else b)
    s = a + b if more else a - b
    word, sign = ("more", "+") if more else ("fewer", "-")
    q = (f"{p.name} has {a} {obj}. {other.name} has {b} {word} {obj} than {p.name}. "
         f"How many {obj} do they have together?")
    return QA(q, f"{other.name} has {a} {sign} {b} = {s} {obj}. Together they have {a} + {s} = "
                 f"{a + s} {obj}. The answer is {a + s}.")


def three_steps(rng: random.Random) -> QA:
    (p, other), obj = _two_people(rng), rng.choice(OBJECTS)
    (box, boxes), a, b, c = rng.choice(CONTAINERS), _number(rng), rng.randint(2, 6), \
        rng.randint(2, 9)
    m = b * c
    s = a + m
    d = rng.randint(1, s)
    q = (f"{p.name} has {a} {obj}. {p.He} buys {b} {boxes} of {obj} with {c} in each {box}, "
         f"then gives {d} {obj} to {other.name}. How many {obj} does {p.he} have left?")
    return QA(q, f"The {boxes} hold {b} * {c} = {m} {obj}. Then {p.name} has {a} + {m} = {s} "
                 f"{obj}. After giving {d} away, {p.he} has {s} - {d} = {s - d} {obj}. "
                 f"The answer is {s - d}.")


FAMILIES: tuple[tuple[Callable[[random.Random], QA], float], ...] = (
    (add_more, 0.2), (take_away, 0.14), (containers, 0.12), (price, 0.08), (share, 0.05),
    (together, 0.06), (buy_then_take, 0.12), (boxes_plus, 0.09), (compare, 0.08),
    (three_steps, 0.06),
)


def final_number(text: str) -> int | None:
    """The last integer in `text` once commas are removed (how GSM8K graders read answers)."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None
