"""Answer scoring for MathVista-style records.

Evaluation, the RL correctness reward and the web UI all call `score`, so a
number reported on the benchmark and the reward the policy was trained on can
never disagree about what counts as right.

The rules are MathVista's official ones (evaluation/calculate_score.py):
multiple-choice letters map to the choice at that index, otherwise the nearest
choice by edit distance; integers are `str(int(float(x)))`; floats are
`str(round(float(x), precision))`; lists are compared as strings. On top of
that the scorer reads answers the way a human grader would: `\\boxed{}`, `$..$`,
"Answer:", units, thousands separators, simple fractions, percentages.

Deliberate choices:
- No `<SOLUTION>` block means no answer: the response is wrong. We do not go
  hunting for a number elsewhere in the text, because that would reward the
  policy for ignoring the output format.
- An empty answer, or one longer than `MAX_ANSWER_CHARS`, is wrong (the
  official scorer would map "" to the nearest choice, i.e. a free guess).
- "45%" reads as 45: MathVista gold answers never carry the percent sign.
- Multiple choice tries, in order: the exact choice text, a letter ("B",
  "(B)", "b)"), a case-insensitive or numeric match to one choice ("145" for
  "145°"), and only then the official nearest choice by edit distance.
- A float record without a usable precision is rounded to as many decimals as
  its gold answer has.
- Model output is parsed, never evaluated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat

__all__ = [
    "MAX_ANSWER_CHARS",
    "Score",
    "clean_answer",
    "extract_solution",
    "format_ok",
    "gold_parseable",
    "levenshtein",
    "normalize_gold",
    "normalize_response",
    "parse_number",
    "score",
    "single_block",
]

# The default format's tags; a run's own come from params.yaml's `answer_format`.
OPEN_SOLUTION, CLOSE_SOLUTION = DEFAULT_FORMAT.solution_open, DEFAULT_FORMAT.solution_close
OPEN_REASONING, CLOSE_REASONING = DEFAULT_FORMAT.reasoning_open, DEFAULT_FORMAT.reasoning_close

MAX_ANSWER_CHARS = 300
_INT_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Score:
    correct: bool
    extracted: str | None  # raw content of the last SOLUTION block
    normalized: str | None  # the response after normalisation: what was compared
    gold: str | None  # the gold answer after normalisation
    format_ok: bool


# --------------------------------------------------------------------------- tags


def _as_text(text: object) -> str | None:
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray)):
        return bytes(text).decode("utf-8", errors="replace")
    return None


def extract_solution(text: str, fmt: AnswerFormat = DEFAULT_FORMAT) -> str | None:
    """Stripped content of the last solution block (<SOLUTION>...</SOLUTION>), else None."""
    text = _as_text(text)
    if text is None:
        return None
    # rfind instead of a regex: linear even on megabytes of unclosed tags.
    close = text.rfind(fmt.solution_close)
    if close < 0:
        return None
    start = text.rfind(fmt.solution_open, 0, close)
    if start < 0:
        return None
    return text[start + len(fmt.solution_open) : close].strip()


def single_block(text: str, open_tag: str, close_tag: str) -> tuple[int, int] | None:
    """(start, end) of the block when the text holds exactly one, else None."""
    if text.count(open_tag) != 1 or text.count(close_tag) != 1:
        return None
    start, end = text.find(open_tag), text.find(close_tag)
    return (start, end) if start < end else None


def format_ok(text: str, fmt: AnswerFormat = DEFAULT_FORMAT) -> bool:
    """One reasoning block, then one solution block, neither nested in the other."""
    text = _as_text(text)
    if text is None:
        return False
    reasoning = single_block(text, fmt.reasoning_open, fmt.reasoning_close)
    solution = single_block(text, fmt.solution_open, fmt.solution_close)
    return bool(reasoning and solution and reasoning[1] < solution[0])


# ---------------------------------------------------------------- text cleaning

_PREFIX = re.compile(
    r"^(?:(?:so|thus|therefore|hence),?\s+)?(?:the\s+)?(?:final\s+|correct\s+)?"
    r"(?:answer|option|choice)\b(?:\s+is)?\s*[:：]?\s*",
    re.IGNORECASE,
)
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree")
_LATEX_SPACING = re.compile(r"\\[,;:! ]|\\(?:left|right)\b|\\displaystyle")
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"))


def _last_braced(text: str, command: str) -> str | None:
    """Content of the last `command{...}`, honouring nested braces."""
    start = text.rfind(command + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(command)
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin + 1 : i]
    return None


def _unwrap(text: str) -> str:
    for left, right in _WRAPPERS:
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            return text[len(left) : -len(right)].strip()
    return text


def clean_answer(answer: str) -> str:
    """Strip the packaging around an answer: boxes, math delimiters, "Answer:"."""
    text = answer.strip()
    for command in ("\\boxed", "\\fbox"):
        boxed = _last_braced(text, command)
        if boxed is not None:
            text = boxed.strip()
    previous = None
    while previous != text:
        previous = text
        text = _unwrap(_PREFIX.sub("", text, count=1)).strip().rstrip(".;").strip()
    text = _LATEX_TEXT.sub(r"\1", text)
    text = _DEGREE.sub("°", text)
    text = _LATEX_SPACING.sub(" ", text).replace("\\%", "%").replace("−", "-")
    return " ".join(text.split())


def _fold(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".")


# -------------------------------------------------------------------- numbers

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_THOUSANDS = re.compile(r"([-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?)(?![\d,])")
_LATEX_FRAC = re.compile(
    r"^([-+]?)\\[dt]?frac\s*\{\s*(" + _NUMBER + r")\s*\}\s*\{\s*(" + _NUMBER + r")\s*\}"
)
_HEAD = re.compile(r"^(" + _NUMBER + r")(?:\s*/\s*(" + _NUMBER + r"))?")
# A unit is words: letters, °, %, "/" and exponents; a digit elsewhere means the
# tail is more maths ("12 or 13"), not a unit.
_UNIT = re.compile(r"[%°′″'\"]?\s*(?:[^\W\d_][\w°/^.²³ ]*)?")
_EXPONENT = re.compile(r"\^\{?\d+\}?")
_APPROX = re.compile(r"^(?:approximately|approx\.?|about|around|roughly|~|≈)\s*", re.IGNORECASE)
_CURRENCY = "$€£¥"


def _is_unit(tail: str) -> bool:
    tail = tail.strip()
    return not tail or (
        _UNIT.fullmatch(tail) is not None and not any(c.isdigit() for c in _EXPONENT.sub("", tail))
    )


def _number_head(text: str) -> tuple[float, str] | None:
    """Leading number (or fraction) and the rest of the text."""
    match = _LATEX_FRAC.match(text)
    if match:
        sign, num, den = match.groups()
        value = _divide(float(num), float(den))
        value = -value if value is not None and sign == "-" else value
    else:
        match = _HEAD.match(text)
        if not match:
            return None
        value = float(match.group(1))
        if match.group(2) is not None:
            value = _divide(value, float(match.group(2)))
    return None if value is None else (value, text[match.end() :])


def _divide(num: float, den: float) -> float | None:
    return num / den if den else None


def parse_number(answer: str, unit: str | None = None) -> float | None:
    """A finite number read from a cleaned answer, ignoring units; None if it is not one."""
    text = clean_answer(answer)
    for sign in "=≈":
        if sign in text:
            text = text.rsplit(sign, 1)[1].strip()
    text = _APPROX.sub("", text).lstrip(_CURRENCY).strip()
    if unit and text.casefold().endswith(unit.casefold()):
        text = text[: -len(unit)].strip()
    text = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), text)
    head = _number_head(text)
    if head is None or not _is_unit(head[1]):
        return None
    return head[0] + 0.0 if math.isfinite(head[0]) else None  # + 0.0 turns -0.0 into 0.0


def _format_number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


# -------------------------------------------------------------------- records


def _choices(record: Mapping) -> list[str]:
    choices = record.get("choices")
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        return []
    return [str(c) for c in choices]


def _question_type(record: Mapping) -> str:
    kind = record.get("question_type")
    if kind:
        return str(kind)
    return "multi_choice" if _choices(record) else "free_form"


def _precision(record: Mapping) -> int | None:
    value = record.get("precision")
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) and number >= 0 else None


def _decimals(answer: str) -> int:
    digits = answer.strip().partition(".")[2]
    return len(digits) if digits.isdigit() else 0


def _unit(record: Mapping) -> str | None:
    unit = record.get("unit")
    return (unit.strip() or None) if isinstance(unit, str) else None


# ------------------------------------------------------------- normalisation


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _nearest(answer: str, choices: list[str]) -> str:
    best, best_distance = choices[0], math.inf
    for choice in choices:
        if abs(len(choice) - len(answer)) >= best_distance:
            continue  # the length gap alone is a lower bound on the distance
        distance = levenshtein(answer, choice)
        if distance < best_distance:
            best, best_distance = choice, distance
    return best


_LETTER = re.compile(r"^(?:\(([A-Za-z])\)|([A-Za-z])(?:[.:)]|$))")


def _letter_choice(answer: str, choices: list[str]) -> str | None:
    match = _LETTER.match(answer)
    if not match:
        return None
    index = ord((match.group(1) or match.group(2)).upper()) - ord("A")
    return choices[index] if index < len(choices) else None


def _unique(matches: list[str]) -> str | None:
    return matches[0] if len(set(matches)) == 1 else None


def _exact_choice(answer: str, choices: list[str]) -> str | None:
    return next((c for c in choices if c.strip() == answer), None)


def _similar_choice(answer: str, choices: list[str], unit: str | None) -> str | None:
    folded = [c for c in choices if _fold(c) == _fold(answer)]
    if folded:
        return folded[0]
    value = parse_number(answer, unit)
    if value is None:
        return None
    return _unique([c for c in choices if _same_number(parse_number(c, unit), value)])


def _same_number(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _normalize_choice(answer: str, record: Mapping) -> str | None:
    choices, unit = _choices(record), _unit(record)
    if not choices:
        return None
    stripped = answer.strip()
    cleaned = clean_answer(stripped)
    if not cleaned:
        return None
    # Letters come before case-insensitive matches: with choices "(a)".."(e)" in
    # shuffled order, "(E)" is option E while "(e)" is that choice's text.
    return (
        _exact_choice(stripped, choices)
        or _exact_choice(cleaned, choices)
        or _letter_choice(cleaned, choices)
        or _similar_choice(cleaned, choices, unit)
        or _nearest(cleaned, choices)
    )


def _normalize_integer(answer: str, record: Mapping) -> str | None:
    value = parse_number(answer, _unit(record))
    if value is None:
        return None
    if abs(value - round(value)) <= _INT_TOLERANCE:
        return str(round(value))
    return str(int(value))  # the official truncation: "2.7" reads as "2"


def _normalize_float(answer: str, record: Mapping, precision: int) -> str | None:
    value = parse_number(answer, _unit(record))
    return None if value is None else str(round(value, precision) + 0.0)


def _list_items(answer: str) -> list[str] | None:
    text = clean_answer(answer)
    if len(text) >= 2 and text[0] + text[-1] in ("[]", "()", "{}"):
        text = text[1:-1]
    if not text.strip():
        return []
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        return None
    return [_list_item(item) for item in items]


def _list_item(item: str) -> str:
    value = parse_number(item)
    return _format_number(value) if value is not None else _fold(item.strip("'\""))


def _normalize_list(answer: str) -> str | None:
    items = _list_items(answer)
    return None if items is None else "[" + ", ".join(items) + "]"


def _normalize_text(answer: str, record: Mapping) -> str | None:
    cleaned = clean_answer(answer)
    value = parse_number(cleaned, _unit(record))
    if value is not None:
        return _format_number(value)
    return _fold(cleaned) or None


def _float_precision(record: Mapping) -> int:
    precision = _precision(record)
    return precision if precision is not None else _decimals(str(record.get("answer", "")))


def normalize_response(answer: str, record: Mapping) -> str | None:
    """The response as the record's answer type reads it; None if it cannot."""
    if not isinstance(answer, str) or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return None
    if _question_type(record) == "multi_choice":
        return _normalize_choice(answer, record)
    kind = record.get("answer_type")
    if kind == "integer":
        return _normalize_integer(answer, record)
    if kind == "float":
        return _normalize_float(answer, record, _float_precision(record))
    if kind == "list":
        return _normalize_list(answer)
    return _normalize_text(answer, record)


def normalize_gold(record: Mapping) -> str | None:
    """The gold answer normalised like a response; None if it is unusable."""
    answer = record.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        return None
    if _question_type(record) == "multi_choice":
        choices = _choices(record)
        if not choices:
            return None
        gold = answer.strip()
        return (
            _exact_choice(gold, choices)
            or _similar_choice(gold, choices, _unit(record))
            or _letter_choice(gold, choices)
            or gold
        )
    kind = record.get("answer_type")
    if kind == "integer":
        value = parse_number(answer, _unit(record))
        if value is None or abs(value - round(value)) > _INT_TOLERANCE:
            return None
        return str(round(value))
    if kind == "list" and answer.strip()[:1] not in ("[", "("):
        return None
    if kind in ("float", "list", "text", None):
        return normalize_response(answer, record)
    return None


def gold_parseable(record: Mapping) -> bool:
    """Whether the record's gold answer can be read for its answer type."""
    return normalize_gold(record) is not None


# -------------------------------------------------------------------- scoring


def score(response: str, record: Mapping, fmt: AnswerFormat = DEFAULT_FORMAT) -> Score:
    """Score one model response against one MathVista-schema record."""
    text = _as_text(response) or ""
    extracted = extract_solution(text, fmt)
    normalized = normalize_response(extracted, record) if extracted is not None else None
    gold = normalize_gold(record)
    correct = normalized is not None and gold is not None and normalized == gold
    return Score(
        correct=correct,
        extracted=extracted,
        normalized=normalized,
        gold=gold,
        format_ok=format_ok(text, fmt),
    )
