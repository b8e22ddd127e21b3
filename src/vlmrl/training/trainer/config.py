"""The trainer configs of both training stages, built one way: `sft.args` becomes a
`trl.SFTConfig` and `train.grpo` a `trl.GRPOConfig`, each with the keys the pipeline sets itself
(`vlmrl.params.PIPELINE_KEYS`). Before a config is built every value is checked against its
field's type with pydantic in strict mode: TRL takes `learning_rate: abc` and fails only once
training has started, an hour into a run. No torch at import."""

from __future__ import annotations

import importlib.util
import json
import math
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from vlmrl.params import PIPELINE_KEYS, ModelParams, ParamsError

REPORT_BACKENDS = {"tensorboard": "tensorboard", "trackio": "trackio"}  # report_to -> package
STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)
YAML_WORDS = {"a valid array": "a list", "an object": "a mapping"}  # values are checked as JSON


def build_trainer_config(config_class: type, args: Mapping[str, Any], key_path: str, *,
                         pipeline: Mapping[str, Any], model_settings: ModelParams,
                         defaults: Mapping[str, Any] | None = None):
    """`config_class(**kwargs)` from `defaults`, then `args` (params.yaml at `key_path`), then
    `pipeline` (the values the pipeline sets, which params may not) and the device and precision
    flags. Every problem with `args` is one ParamsError naming its key."""
    from vlmrl.models.backend import precision_flags  # torch: only once a config is built

    undeclared = set(pipeline) - PIPELINE_KEYS[key_path]
    if undeclared:
        raise RuntimeError(f"{sorted(undeclared)} are set by the pipeline but missing from "
                           f"vlmrl.params.PIPELINE_KEYS[{key_path!r}]")
    args = config_values(config_class, args, key_path)
    kwargs = {**(defaults or {}), **args}
    check_report_to(kwargs.get("report_to", "none"), f"{key_path}.report_to")
    kwargs.update(pipeline, **precision_flags(args, model_settings))
    try:
        return config_class(**kwargs)
    except ValueError as error:  # TrainingArguments' and TRL's own checks of the values
        raise ParamsError(f"params.yaml {key_path}: {error}") from None


def config_values(config_class: type, values: Mapping[str, Any], key_path: str) -> dict[str, Any]:
    """`values` checked against the fields of `config_class` (a TrainingArguments dataclass,
    looked up at call time: Unsloth, when chosen, replaces TRL's on import): a ParamsError names
    `key_path.<key>` for a key that is no field, one the pipeline sets, or a value of none of
    its field's types. A float written as text is read as the number: DVC writes
    `-S lr=5e-6` to params.yaml as `5e-06`, a float in YAML 1.2 but text to PyYAML."""
    hints = field_types(config_class)
    checked = {}
    for key, value in values.items():
        if key not in hints:
            raise ParamsError(f"params.yaml {key_path}.{key} is not a {config_name(config_class)} "
                              "field; see its documentation")
        if key in PIPELINE_KEYS.get(key_path, ()):
            raise ParamsError(f"params.yaml {key_path}.{key} is set by the pipeline (dvc.yaml "
                              "paths or other params sections); remove it")
        problem = type_problem(hints[key], value)
        number = float_text(value) if problem and isinstance(value, str) else value
        if number is not value and type_problem(hints[key], number) is None:
            value, problem = number, None  # a float the YAML reader left as text
        if problem:
            raise ParamsError(f"params.yaml {key_path}.{key}: must be {problem}, got {value!r}")
        checked[key] = value
    return checked


def config_name(config_class: type) -> str:
    """`trl.GRPOConfig (trl 1.15.0)`: the class as TRL's documentation names it (Unsloth's
    replacement, `UnslothGRPOConfig`, has TRL's fields)."""
    import trl

    return f"trl.{config_class.__name__.removeprefix('Unsloth')} (trl {trl.__version__})"


@cache
def field_types(config_class: type) -> dict[str, Any]:
    """The init fields of a config dataclass with their resolved type hints; `Any` (no check:
    the config checks them itself) where this Python cannot resolve the annotations, as in a
    generated subclass (Unsloth's) that names a type it does not import."""
    try:
        hints = typing.get_type_hints(config_class)
    except (NameError, TypeError):
        hints = {}
    return {name: hints.get(name, Any) for name, field in config_class.__dataclass_fields__.items()
            if field.init}


@cache
def _adapter(hint: Any) -> TypeAdapter:
    return TypeAdapter(hint, config=STRICT)


def type_problem(hint: Any, value: Any) -> str | None:
    """What `value` should have been, or None if it is of the type `hint`. Strict: no coercion
    (`"yes"` is no bool, 4.5 no int, true no int). Checked as the JSON the YAML value is, so an
    enum field takes its values and a dataclass field a mapping of its fields, as TRL does."""
    try:
        _adapter(hint).validate_json(json.dumps(value, default=str))
    except ValidationError as error:
        wanted = [item["msg"].removeprefix("Input should be ") for item in error.errors()]
        return " or ".join(dict.fromkeys(YAML_WORDS.get(text, text) for text in wanted))
    return None


def float_text(text: str) -> Any:
    """A finite number written as text, as that number; any other text as it is."""
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


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
