"""Checks of the TRL config values params.yaml gives: `config_values` checks `sft.args` and
`train.grpo` against the config's field types (TRL takes `learning_rate: abc` and fails only once
training has started), and `check_report_to` the logging backends. The trainers' other
adaptations live by job: vlmrl.trainers (the trainer subclasses), vlmrl.logprob_fallback,
vlmrl.generation and vlmrl.train_logs."""

from __future__ import annotations

import enum
import importlib.util
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from vlmrl.params import ParamsError


def config_values(config_class: type, values: Mapping[str, Any], key_path: str) -> dict[str, Any]:
    """`values` checked against the field types of `config_class` (a TrainingArguments
    dataclass): a ParamsError names `key_path.<key>` for the first value of none of the types its
    field accepts. A float written as text is read as the number: DVC writes `-S lr=5e-6` to
    params.yaml as `5e-06`, a float in YAML 1.2 but text to PyYAML. Types it cannot check (a
    class of its own, a generic other than list or dict) pass; TRL checks those itself."""
    try:
        hints = typing.get_type_hints(config_class)
    except (NameError, TypeError):  # an annotation this Python cannot resolve: TRL checks it
        return dict(values)
    checked = {}
    for key, value in values.items():
        hint = hints.get(key)
        if hint is not None and float in _members(hint) and isinstance(value, str):
            value = _float_text(value, value)
        if hint is not None and not _accepts(hint, value):
            raise ParamsError(f"params.yaml {key_path}.{key}: must be {_type_name(hint)}, "
                              f"got {value!r}")
        checked[key] = value
    return checked


def _float_text(text: str, default: Any) -> Any:
    try:
        number = float(text)
    except ValueError:
        return default
    return number if math.isfinite(number) else default


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _accepts(hint: Any, value: Any) -> bool:
    return any(_accepts_one(member, value) for member in _members(hint))


def _accepts_one(member: Any, value: Any) -> bool:
    origin = typing.get_origin(member) or member
    if member is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(member)
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return value in {item.value for item in origin}
    simple = {bool: lambda v: isinstance(v, bool),
              int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              str: lambda v: isinstance(v, str),
              dict: lambda v: isinstance(v, Mapping),
              list: lambda v: isinstance(v, (list, tuple))}
    return simple[origin](value) if origin in simple else True


def _type_name(hint: Any) -> str:
    names = []
    for member in _members(hint):
        origin = typing.get_origin(member) or member
        if member is type(None):
            names.append("null")
        elif origin is typing.Literal:
            names.append(" or ".join(repr(arg) for arg in typing.get_args(member)))
        elif isinstance(origin, type) and issubclass(origin, enum.Enum):
            names.append("one of " + ", ".join(str(item.value) for item in origin))
        else:
            names.append(getattr(origin, "__name__", str(origin)))
    return " or ".join(dict.fromkeys(names))


# ---------------------------------------------------------------- live logs

REPORT_BACKENDS = {"tensorboard": "tensorboard", "trackio": "trackio"}  # report_to -> package


def check_report_to(value: Any, key: str) -> None:
    """`report_to` in params.yaml: "none", or backends of REPORT_BACKENDS that are installed;
    refused with the key path before a model is loaded, not by the trainer an hour later."""
    names = [value] if isinstance(value, str) else list(value or [])
    for name in names:
        if name == "none":
            continue
        if name not in REPORT_BACKENDS:
            raise ParamsError(f"params.yaml {key}: {name!r} is not one of none, "
                             + ", ".join(REPORT_BACKENDS))
        if importlib.util.find_spec(REPORT_BACKENDS[name]) is None:
            raise ParamsError(f"params.yaml {key}: {name} is not installed "
                             f"(pip install {REPORT_BACKENDS[name]}), or set it to none")
