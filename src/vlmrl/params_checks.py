"""How params problems are told, in one line that names the key path: pydantic's validation
errors of a section (`describe`), and the checks of values whose rules live outside the section's
field types: the built-in reward names (vlmrl.rewards.functions' registry, which cannot be imported here
without an import circle) and GRPO's group size."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from vlmrl.errors import ParamsError

# vlmrl.rewards.functions' built-in rewards (tests/test_rewards.py keeps the two lists equal).
BUILTIN_REWARDS = ("format_reward", "correctness_reward", "length_penalty", "rouge_reward",
                   "bertscore_reward")


def check_reward_names(section: Mapping[str, Any]) -> None:
    """Every reward the `rewards` section weighs or gives options to is a built-in reward or an
    import path (`package.module:function`, imported by vlmrl.rewards.functions); a typo fails here."""
    weights = section.get("weights")
    named = [("rewards.weights", name) for name in
             (weights if isinstance(weights, (Mapping, list, tuple)) else ())]
    named += [("rewards", name) for name in section if name != "weights"]
    for key, name in named:
        if ":" not in str(name) and name not in BUILTIN_REWARDS:
            raise ParamsError(f"params.yaml {key}: unknown reward {name!r}; known rewards: "
                              f"{', '.join(sorted(BUILTIN_REWARDS))}, or an import path "
                              "`package.module:function`")


def check_group_size(grpo: Mapping[str, Any]) -> None:
    """GRPO compares the completions of one prompt with each other, so a group needs two or
    more; TRL divides by the group size before it checks that (0 is a ZeroDivisionError there).
    Other types are left to the check against GRPOConfig's field types (vlmrl.training.trainer.config)."""
    value = grpo.get("num_generations")
    if isinstance(value, int) and not isinstance(value, bool) and value < 2:
        raise ParamsError("params.yaml train.grpo.num_generations: must be an integer of at "
                          f"least 2 (GRPO compares completions within a group), got {value!r}")


def describe(section: Any, error: ValidationError) -> str:
    """One line: `params.yaml <key path>: <problem>` for every problem, unknown keys grouped."""
    unknown: dict[tuple[Any, ...], list[str]] = {}
    problems: list[str] = []
    for item in error.errors():
        loc = section.yaml_loc(tuple(item["loc"]))
        if item["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
        else:
            problems.append(f"{key_path(section.SECTION, loc)}: {problem(item)}")
    for parent, names in unknown.items():
        known = ", ".join(known_keys(section, parent))
        problems.insert(0, f"{key_path(section.SECTION, parent)} has unknown keys {names}; "
                           f"known: {known}")
    return "params.yaml " + "; ".join(problems)


def key_path(section: str, loc: tuple[Any, ...]) -> str:
    path = section
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def problem(item: Mapping[str, Any]) -> str:
    kind, message = item["type"], item["msg"]
    if kind == "missing":
        return "missing"
    if kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", item.get("ctx", {}).get("expected", ""))
        return f"{item['input']!r} is not one of {', '.join(allowed)}"
    if kind == "value_error":
        return message.removeprefix("Value error, ")
    return f"{message[:1].lower()}{message[1:]}, got {item['input']!r}"


def known_keys(section: type[BaseModel], parent: tuple[Any, ...]) -> list[str]:
    """Field names of the section (or of the nested section at `parent`), in params order."""
    model: Any = section
    for part in parent:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return list(model.model_fields)
