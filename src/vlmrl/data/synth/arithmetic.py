"""GSM8K-style arithmetic word problems, generated offline: the text-only default of the pipeline
(`data.source: embedded:arithmetic`, the offline text recipe). Each row is laid out as GSM8K's
are, a `question` and an `answer` holding a worked solution that ends in `#### n`, with no id,
so prepare_data takes the gold answer out with `data.answer_pattern: after_hashes` and derives
the ids, exactly as it does for `openai/gsm8k`.

Row i depends only on (seed, i), like the visual set. Answers are non-negative integers whose
solution is one or two operations on small numbers, so a tiny model has something to learn."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

NAMES = ("Ava", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "June")
THINGS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "cards")


def _more(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return (f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
            f"{name} has {a} + {b} = {a + b} {thing}.", a + b)


def _fewer(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(10, 40)
    b = rng.randint(1, a - 1)
    return (f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?",
            f"{a} - {b} = {a - b} {thing} are left.", a - b)


def _groups(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    boxes, each = rng.randint(2, 9), rng.randint(2, 12)
    return (f"{name} fills {boxes} boxes with {each} {thing} each. How many {thing} is that?",
            f"{boxes} x {each} = {boxes * each} {thing}.", boxes * each)


def _share(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    friends, each = rng.randint(2, 8), rng.randint(2, 9)
    total = friends * each
    question = (f"{name} shares {total} {thing} equally among {friends} friends. How many does "
                "each friend get?")
    return question, f"{total} / {friends} = {each} {thing} each.", each


def _two_steps(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    packs, each, extra = rng.randint(2, 6), rng.randint(3, 10), rng.randint(1, 15)
    total = packs * each + extra
    question = (f"{name} buys {packs} packs of {each} {thing} and finds {extra} more. How many "
                f"{thing} does {name} have?")
    return (question,
            f"{packs} x {each} = {packs * each}, and {packs * each} + {extra} = {total}.", total)


KINDS: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (
    _more, _fewer, _groups, _share, _two_steps)


def generate_arithmetic(count: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """`count` GSM8K-layout rows: question, and a worked answer ending in `#### n`."""
    for index in range(count):
        rng = random.Random(f"arithmetic-{seed}-{index}")
        question, working, value = KINDS[index % len(KINDS)](rng)
        yield {"question": question, "answer": f"{working}\n#### {value}"}
