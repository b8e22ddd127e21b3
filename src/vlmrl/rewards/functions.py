"""GRPO/GSPO reward functions in TRL's signature, and the registry that builds them.

Each reward is `f(completions, **columns) -> list[float | None]`, the form TRL's
trainers call with one completion and one value per dataset column. The
correctness reward goes through `vlmrl.rewards.scoring.score`, and `score_completion`
runs the same functions on a single text, so training, evaluation and the web
UI agree on every number. params.yaml's `rewards` section is split into the
weights and per-reward options `build_rewards` takes by `vlmrl.params.RewardsParams`.

Deliberate choices:
- `format_reward` is the reference notebook's: +1 for exactly one reasoning
  block, +1 for exactly one solution block, and 2.0 subtracted from those
  points for degenerate text, so a run of `addCriterion` holding both tags
  scores 0, never more than an honest answer without tags.
- `correctness_reward` returns None when the gold answer cannot be read: TRL
  treats None as "no signal" instead of punishing the policy for bad data.
- In `score_completion`'s weighted total a None reward counts as 0, as TRL's
  nan-sum does.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

from vlmrl.errors import ParamsError
from vlmrl.rewards import scoring
from vlmrl.rewards import text as text_rewards
from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat

__all__ = [
    "MODEL_REWARDS",
    "REWARD_FUNCS",
    "build_rewards",
    "completion_text",
    "correctness_reward",
    "format_reward",
    "length_penalty",
    "reward_label",
    "rouge_reward",
    "score_completion",
]

RECORD_COLUMNS = ("answer", "question_type", "answer_type", "choices", "precision", "unit")
DEGENERATE_TOKEN = "addCriterion"

Completion = str | Sequence[Mapping[str, Any]]
RewardFunc = Callable[..., list[float | None]]


# ----------------------------------------------------------------- completions


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable):
        return "".join(
            part.get("text") or ""
            for part in content
            if isinstance(part, Mapping) and part.get("type", "text") == "text"
        )
    return ""


def completion_text(completion: Completion) -> str:
    """The assistant text of a plain or conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (bytes, bytearray)):
        return bytes(completion).decode("utf-8", errors="replace")
    messages = (
        [m for m in completion if isinstance(m, Mapping)]
        if isinstance(completion, Iterable)
        else []
    )
    return "\n".join(
        _content_text(m.get("content"))
        for m in messages
        if m.get("role", "assistant") == "assistant"
    )


def _records(count: int, columns: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "answer" not in columns:
        raise ValueError("correctness_reward needs an 'answer' column")
    present = {name: columns[name] for name in RECORD_COLUMNS if name in columns}
    for name, values in present.items():
        if len(values) != count:
            raise ValueError(f"column {name!r} has {len(values)} values for {count} completions")
    return [{name: values[i] for name, values in present.items()} for i in range(count)]


# --------------------------------------------------------------------- rewards


def is_degenerate(text: str) -> bool:
    """Whether `addCriterion` tokens and newlines make up half the text or more."""
    junk = text.count(DEGENERATE_TOKEN) * len(DEGENERATE_TOKEN) + text.count("\n")
    return bool(text) and 2 * junk >= len(text)


DEGENERATE_PENALTY = 2.0


def _format_value(text: str, fmt: AnswerFormat) -> float:
    reasoning = scoring.single_block(text, fmt.reasoning_open, fmt.reasoning_close)
    solution = scoring.single_block(text, fmt.solution_open, fmt.solution_close)
    earned = fmt.format_bonus * ((reasoning is not None) + (solution is not None))
    return earned - DEGENERATE_PENALTY if is_degenerate(text) else earned


def format_reward(completions: Sequence[Completion], *, answer_format: AnswerFormat = DEFAULT_FORMAT,
                  **columns: Any) -> list[float | None]:
    """The format bonus (1 by default) for one reasoning block and again for one solution block,
    minus 2 for degenerate text."""
    return [_format_value(completion_text(c), answer_format) for c in completions]


def _correctness_value(text: str, record: Mapping[str, Any], fmt: AnswerFormat) -> float | None:
    if not scoring.gold_parseable(record):
        return None
    result = scoring.score(text, record, fmt)
    if result.correct and result.extracted == str(record["answer"]).strip():
        return 2.0
    return 1.5 if result.correct else 0.0


def correctness_reward(completions: Sequence[Completion], *,
                       answer_format: AnswerFormat = DEFAULT_FORMAT,
                       **columns: Any) -> list[float | None]:
    """2.0 for the gold answer verbatim, 1.5 after normalisation, else 0; None for bad gold."""
    records = _records(len(completions), columns)
    return [_correctness_value(completion_text(c), r, answer_format)
            for c, r in zip(completions, records, strict=True)]


def length_penalty(
    completions: Sequence[Completion], *, min_chars: int = 50, max_chars: int = 2000, **columns: Any
) -> list[float | None]:
    """-1.0 below `min_chars` characters, -0.5 above `max_chars`, else 0."""
    if min_chars > max_chars:
        raise ValueError(f"length_penalty: min_chars ({min_chars}) exceeds max_chars ({max_chars})")
    lengths = [len(completion_text(c)) for c in completions]
    return [-1.0 if n < min_chars else -0.5 if n > max_chars else 0.0 for n in lengths]


def rouge_reward(completions: Sequence[Completion], *, rouge_type: str = "rouge1",
                 use_stemmer: bool = True, answer_format: AnswerFormat = DEFAULT_FORMAT,
                 **columns: Any) -> list[float | None]:
    """ROUGE F1 (`rouge1`, `rouge2`, `rougeL`, `rougeLsum`) of the SOLUTION block against the gold
    answer: 0 without a SOLUTION block, None without a gold text (`vlmrl.rewards.text`)."""
    return text_rewards.rouge_values([completion_text(c) for c in completions],
                                     columns.get("answer"), rouge_type, use_stemmer,
                                     answer_format)


REWARD_FUNCS: dict[str, RewardFunc] = {
    "format_reward": format_reward,
    "correctness_reward": correctness_reward,
    "length_penalty": length_penalty,
    "rouge_reward": rouge_reward,
}
# Built-in rewards that need a model, registered by import path: importing them here would pull
# torch into every user of this module (the CLI, the reward playground).
MODEL_REWARDS: dict[str, str] = {"bertscore_reward": "vlmrl.models.similarity:bertscore_reward"}


# -------------------------------------------------------------------- registry


def is_import_path(name: str) -> bool:
    return ":" in name


def reward_label(name: str) -> str:
    """What logs, metrics and eval records call a reward: its registry name, or the function
    name of an import path (`my_rewards:brevity` -> `brevity`)."""
    return name.rsplit(":", 1)[1] if is_import_path(name) else name


def _lookup(name: str) -> RewardFunc:
    if is_import_path(name):
        return _import_reward(name)
    if name in MODEL_REWARDS:
        return _import_reward(MODEL_REWARDS[name])
    if name not in REWARD_FUNCS:
        raise ValueError(
            f"unknown reward {name!r}; known rewards: "
            f"{', '.join(sorted([*REWARD_FUNCS, *MODEL_REWARDS]))}, "
            "or an import path `package.module:function`"
        )
    return REWARD_FUNCS[name]


def _import_reward(path: str) -> RewardFunc:
    """`package.module:function`, importable from the installed packages or the project root
    (the directory the stage runs in), with TRL's signature `f(completions, **columns)`."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute.isidentifier():
        raise ValueError(f"reward {path!r}: an import path is `package.module:function`")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(f"reward {path!r}: cannot import {module_name!r} "
                         f"({type(error).__name__}: {error})") from error
    func = getattr(module, attribute, None)
    if func is None:
        raise ValueError(f"reward {path!r}: module {module_name!r} has no {attribute!r}")
    _check_signature(path, func)
    return func


def _check_signature(path: str, func: Any) -> None:
    if not callable(func):
        raise ValueError(f"reward {path!r} is a {type(func).__name__}, not a function")
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as error:
        raise ValueError(f"reward {path!r}: no inspectable signature ({error})") from error
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    takes_columns = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    required = [p.name for p in positional[1:] if p.default is inspect.Parameter.empty]
    if not positional or not takes_columns or required:
        raise ValueError(
            f"reward {path!r} must have TRL's signature `f(completions, **columns) -> "
            f"list[float | None]` (the dataset's columns arrive as keyword arguments); it has "
            f"`{func.__name__}{inspect.signature(func)}`")


# A reward that takes this keyword gets the run's answer format (params.yaml `answer_format`)
FORMAT_KEYWORD = "answer_format"


def _keyword_names(func: RewardFunc) -> set[str]:
    params = inspect.signature(func).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _option_names(func: RewardFunc) -> set[str]:
    return _keyword_names(func) - {FORMAT_KEYWORD}


def _bind(name: str, options: Mapping[str, Any], fmt: AnswerFormat | None = None) -> RewardFunc:
    func = _lookup(name)
    if not isinstance(options, Mapping):
        raise ValueError(
            f"options for reward {name!r} must be a mapping, got {type(options).__name__}"
        )
    if FORMAT_KEYWORD in options:
        raise ValueError(f"reward {name!r}: the answer format is set in params.yaml's "
                         "answer_format section, not in a reward's options")
    unknown = sorted(set(options) - _option_names(func))
    if unknown:
        known = ", ".join(sorted(_option_names(func))) or "none"
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for reward {name!r}; known: {known}"
        )
    bound = dict(options)
    if fmt is not None and FORMAT_KEYWORD in _keyword_names(func):
        bound[FORMAT_KEYWORD] = fmt
    return _named(functools.partial(func, **bound) if bound else func, reward_label(name))


def _named(func: RewardFunc, label: str) -> RewardFunc:
    """TRL logs each reward under its `__name__` (which a bare partial lacks); metrics and eval
    records use the same label."""
    if getattr(func, "__name__", None) == label and not isinstance(func, functools.partial):
        return func

    @functools.wraps(func.func if isinstance(func, functools.partial) else func)
    def reward(completions, **columns):
        return func(completions, **columns)

    reward.__name__ = label
    return reward


def _weight(name: str, weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight):
        raise ValueError(f"weight for reward {name!r} must be a finite number, got {weight!r}")
    return float(weight)


def _weights(spec: Mapping[str, Any] | Sequence[str]) -> dict[str, float]:
    if isinstance(spec, Mapping):
        return {str(name): _weight(str(name), w) for name, w in spec.items()}
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        raise ValueError(
            f"reward weights must be a mapping or a list of names, got {type(spec).__name__}"
        )
    return {str(name): 1.0 for name in spec}


def build_rewards(
    weights: Mapping[str, float] | Sequence[str],
    options: Mapping[str, Mapping[str, Any]] | None = None,
    answer_format: AnswerFormat | None = None,
) -> tuple[list[RewardFunc], list[float]]:
    """TRL's `reward_funcs` and `reward_weights` from `{name: weight}` (a list means weight 1 each).

    `options` maps a reward name to keyword arguments bound into it; options
    for a known reward that carries no weight are checked and then unused.
    `answer_format` goes to every reward with an `answer_format` keyword (the
    built-in ones, and any of yours that declares it).
    """
    try:
        return _build(weights, options or {}, answer_format)
    except ParamsError:
        raise
    except ValueError as error:  # a params error: the rewards section names the reward
        raise ParamsError(f"params.yaml rewards: {error}") from None


def _build(weights: Mapping[str, float] | Sequence[str], options: Any,
           answer_format: AnswerFormat | None) -> tuple[list[RewardFunc], list[float]]:
    if not isinstance(options, Mapping):
        raise ValueError(f"reward options must be a mapping, got {type(options).__name__}")
    bound = {name: _bind(name, opts, answer_format) for name, opts in options.items()}
    table = _weights(weights)
    labels = [reward_label(name) for name in table]
    clashing = sorted({label for label in labels if labels.count(label) > 1})
    if clashing:
        raise ValueError(f"two rewards would both be called {clashing[0]!r} in logs and "
                         "metrics; rename one of the functions")
    funcs = [bound.get(name) or _bind(name, {}, answer_format) for name in table]
    return funcs, list(table.values())


# --------------------------------------------------------------------- single


def score_completion(
    text: Completion,
    record: Mapping[str, Any],
    weights: Mapping[str, float] | Sequence[str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    answer_format: AnswerFormat = DEFAULT_FORMAT,
) -> dict[str, Any]:
    """Every weighted reward, their weighted total and the scorer's verdict for one completion.

    `weights` defaults to every registered reward at weight 1.
    """
    funcs, factors = build_rewards(list(REWARD_FUNCS) if weights is None else weights, options,
                                   answer_format)
    columns = {name: [record.get(name)] for name in RECORD_COLUMNS}
    rewards = {func.__name__: func([text], **columns)[0] for func in funcs}
    total = sum(w * v for w, v in zip(factors, rewards.values(), strict=True) if v is not None)
    result = scoring.score(completion_text(text), record, answer_format)
    return {
        "rewards": rewards,
        "weights": dict(zip(rewards, factors, strict=True)),
        "total": total,
        "extracted": result.extracted,
        "normalized": result.normalized,
        "gold": result.gold,
        "correct": result.correct,
        "format_ok": result.format_ok,
    }
