"""The checks of params values, each telling a problem in one line that names the key path:
the value types the sections of vlmrl.params are built from; pydantic's validation errors of a
section (`describe`); the built-in reward and embedded model names (their registries, in
vlmrl.rewards.functions and vlmrl.models.embedded, cannot be imported here without an upward
import); the values of the trainer configs `sft.args` and `train.grpo`: their ranges and GRPO's
batch arithmetic (`check_trainer_args`, no TRL needed) and their keys and types against TRL's
config classes (`config_values`, which imports TRL when called). The sections in vlmrl.params,
the stages and `vlmrl recipe --check` all run these same functions."""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from vlmrl.errors import ParamsError

# vlmrl.rewards.functions' built-in rewards (tests/test_rewards.py keeps the two lists equal).
BUILTIN_REWARDS = ("format_reward", "correctness_reward", "length_penalty", "rouge_reward",
                   "bertscore_reward")
# vlmrl.models.embedded's models (tests/test_params_checks.py keeps the two lists equal).
EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODELS = ("embedded:tiny-qwen3-vl", "embedded:qwen3-vl-2b-shape",
                   "embedded:qwen3-vl-8b-shape", "embedded:tiny-qwen3")
# Trainer-config keys the pipeline sets itself, from dvc.yaml's paths and other params sections
# (vlmrl.training.trainer.config builds the configs with them), so params.yaml may not set them.
PIPELINE_KEYS: dict[str, frozenset[str]] = {
    "sft.args": frozenset({"output_dir", "use_cpu", "completion_only_loss", "max_length",
                           "remove_unused_columns", "save_strategy"}),
    "train.grpo": frozenset({"output_dir", "save_steps", "save_strategy", "reward_weights",
                             "resume_from_checkpoint", "use_cpu"}),
}


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


def check_embedded_model(name: str) -> str:
    """`model.name`: a name with the embedded prefix must be a model the project can build."""
    if name.startswith(EMBEDDED_PREFIX) and name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    return name


# ------------------------------------------------------------ value types
# Validators raise ValueError even for a wrong type: pydantic reports only ValueError (and
# AssertionError) as a validation error with the field's location.


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer, got {value!r}")  # noqa: TRY004
    return value


def _positive_integer(value: Any, auto: bool = False) -> int | str:
    """A positive integer; with `auto`, also the word auto (a process count: vlmrl.distributed.launch)."""
    if auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive integer{' or auto' * auto}, got {value!r}")
    return value


def _number(value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)):
        raise ValueError(f"must be a finite number, got {value!r}")
    return float(value)


def _real(value: Any) -> int | float:
    """A finite number, kept as written: an integer stays an integer."""
    _number(value)
    return value


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")  # noqa: TRY004
    return value


def _name_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"must be a non-empty list, got {value!r}")
    return tuple(value)


def _list(value: Any) -> Any:
    """None (an empty YAML value) is an empty list; a bare string is not a list."""
    if value is None:
        return ()
    if isinstance(value, str):
        raise ValueError(f"must be a list, got {value!r}")  # noqa: TRY004
    return value


def _trainer_args(key_path: str) -> Callable[[Any], Any]:
    """The check of a trainer config's args (`sft.args`, `train.grpo`): a mapping (None, an empty
    YAML value, is an empty one) without the keys the pipeline sets. Their types are checked
    against the config's fields when it is built (vlmrl.params_checks.config_values)."""

    def check(value: Any) -> Any:
        value = {} if value is None else value
        managed = sorted(set(value) & PIPELINE_KEYS[key_path]) if isinstance(value, Mapping) else []
        if managed:
            raise ValueError(f"{managed} are set by the pipeline; remove them")
        return value

    return check


# ------------------------------------------------------------- trainer args: ranges


@dataclass(frozen=True)
class Range:
    """The values a trainer-config key allows: a number (or an integer) between `low` and `high`,
    each bound included unless marked open, or one of `also`; `why` is told with a refused
    value."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    also: tuple[int, ...] = ()
    why: str = ""

    def holds(self, value: float) -> bool:
        if self.integer and not isinstance(value, int):
            return False
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            text = (f"{kind} in {'(' if self.low_open else '['}{self.low}, "
                    f"{self.high}{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {self.low}"
        else:
            text = kind
        text += "".join(f" or {value}" for value in self.also)
        return f"{text} ({self.why})" if self.why else text


POSITIVE, NON_NEGATIVE = Range(0, low_open=True), Range(0)
COUNT = Range(1, integer=True)
PROBABILITY = Range(0, 1)
TRAINER_RANGES: dict[str, Range] = {
    "learning_rate": POSITIVE, "weight_decay": NON_NEGATIVE,
    "max_grad_norm": Range(0, why="0: no clipping"), "num_train_epochs": POSITIVE,
    "per_device_train_batch_size": COUNT, "gradient_accumulation_steps": COUNT,
    "warmup_ratio": PROBABILITY,
}
SFT_RANGES = {**TRAINER_RANGES,
              "max_steps": Range(0, integer=True, also=(-1,),
                                 why="0: no cold start; -1: by num_train_epochs")}
GRPO_RANGES = {
    **TRAINER_RANGES,
    "max_steps": Range(1, integer=True, also=(-1,), why="-1: by num_train_epochs"),
    "steps_per_generation": COUNT, "generation_batch_size": COUNT, "num_iterations": COUNT,
    "max_completion_length": COUNT,
    "num_generations": Range(2, integer=True, why="GRPO compares the completions of a group"),
    "temperature": POSITIVE, "top_p": Range(0, 1, low_open=True, why="1: no cut"),
    "top_k": Range(0, integer=True, why="0: no cut"), "min_p": PROBABILITY,
    "repetition_penalty": POSITIVE, "epsilon": NON_NEGATIVE, "epsilon_high": NON_NEGATIVE,
    "beta": NON_NEGATIVE, "num_completions_to_print": Range(0, integer=True),
}
RANGES = {"sft.args": SFT_RANGES, "train.grpo": GRPO_RANGES}


def check_trainer_args(key_path: str, args: Any) -> None:
    """The values of `sft.args` or `train.grpo` in their ranges, the warm-up within the run and,
    for GRPO, whole groups in every generation batch: one ParamsError naming the key, the value
    and the range, before any model loads. Keys without a rule, and values of the wrong type, are
    left to `config_values`, which checks them against TRL's config."""
    if not isinstance(args, Mapping):
        return
    for key, rule in RANGES[key_path].items():
        value = number_value(args.get(key))
        if value is not None and (not isinstance(value, (int, float)) or not rule.holds(value)):
            raise ParamsError(f"params.yaml {key_path}.{key}: must be {rule.describe()}, "
                              f"got {args[key]!r}")
    check_warmup(key_path, args)
    if key_path == "train.grpo":
        check_generation_batch(args)


def number_value(value: Any) -> Any:
    """A number written as text (DVC writes `-S lr=5e-6` as `5e-06`, text to PyYAML) as that
    number; a boolean, which Python counts as an integer, as itself (no number: refused)."""
    if isinstance(value, bool):
        return str(value)
    return float_text(value) if isinstance(value, str) else value


def check_warmup(key_path: str, args: Mapping[str, Any]) -> None:
    """transformers reads `warmup_steps` below 1 as a fraction of the run, from 1 on as steps
    (a whole number); a warm-up longer than `max_steps` never reaches the learning rate."""
    value = number_value(args.get("warmup_steps"))
    if value is None:
        return
    key, max_steps = f"params.yaml {key_path}.warmup_steps", number_value(args.get("max_steps"))
    allowed = "a step count (a whole number >= 1) or a fraction of max_steps in [0, 1)"
    if not isinstance(value, (int, float)) or value < 0 or (value >= 1 and value != int(value)):
        raise ParamsError(f"{key}: must be {allowed}, got {args['warmup_steps']!r}")
    if value >= 1 and isinstance(max_steps, int) and 0 < max_steps < value:
        raise ParamsError(f"{key}: must be a step count of at most max_steps ({max_steps}) or a "
                          f"fraction of max_steps in [0, 1), got {args['warmup_steps']!r}")


# TRL's and transformers' defaults of the keys the generation batch is made of.
GRPO_BATCH_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                       "num_generations": 8}


def check_generation_batch(grpo: Mapping[str, Any]) -> None:
    """GRPOConfig's arithmetic, on the global batch of params.yaml (vlmrl.training.gspo splits
    `per_device_train_batch_size` among the processes): one generation is
    `per_device_train_batch_size` x `steps_per_generation` completions (or
    `generation_batch_size`, a multiple of the former) and holds whole groups of
    `num_generations`."""
    size = {key: default if grpo.get(key) is None else grpo[key]
            for key, default in GRPO_BATCH_DEFAULTS.items()}
    given, steps = grpo.get("generation_batch_size"), grpo.get("steps_per_generation")
    if given is not None and steps is not None:
        raise ParamsError("params.yaml train.grpo.generation_batch_size: set it or "
                          "steps_per_generation, not both (TRL derives one from the other)")
    micro = size["per_device_train_batch_size"]
    if given is not None:
        if given % micro:
            raise ParamsError(f"params.yaml train.grpo.generation_batch_size: must be a multiple "
                              f"of per_device_train_batch_size ({micro}), got {given}")
        batch, made_of = given, f"generation_batch_size {given}"
    else:
        steps = size["gradient_accumulation_steps"] if steps is None else steps
        batch = micro * steps
        made_of = f"per_device_train_batch_size {micro} x steps_per_generation {steps} = {batch}"
    if batch % size["num_generations"]:
        raise ParamsError(f"params.yaml train.grpo.num_generations: must divide the generation "
                          f"batch ({made_of}) so that it holds whole groups, got "
                          f"{size['num_generations']}")


# ------------------------------------------------------- trainer args: TRL's fields

REPORT_BACKENDS = {"tensorboard": "tensorboard", "trackio": "trackio"}  # report_to -> package
STRICT = ConfigDict(strict=True, arbitrary_types_allowed=True)
YAML_WORDS = {"a valid array": "a list", "an object": "a mapping"}  # values are checked as JSON


def check_trainer_fields(sft_args: Mapping[str, Any], grpo: Mapping[str, Any]) -> None:
    """`sft.args` and `train.grpo` against the fields of TRL's SFTConfig and GRPOConfig, as the
    stages check them when they build the configs (imports TRL: seconds, not for the light
    paths)."""
    import trl

    for config_class, args, key_path in ((trl.SFTConfig, sft_args, "sft.args"),
                                         (trl.GRPOConfig, grpo, "train.grpo")):
        checked = config_values(config_class, args, key_path)
        check_report_to(checked.get("report_to", "none"), f"{key_path}.report_to")


def config_values(config_class: type, values: Mapping[str, Any], key_path: str) -> dict[str, Any]:
    """`values` checked against the fields of `config_class` (a TrainingArguments dataclass,
    looked up at call time: Unsloth, when chosen, replaces TRL's on import): a ParamsError names
    `key_path.<key>` for a key that is no field, one the pipeline sets, or a value of none of
    its field's types. A float written as text is
    read as the number: DVC writes `-S lr=5e-6` to params.yaml as `5e-06`, a float in YAML 1.2
    but text to PyYAML."""
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
    import importlib.util

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


# ------------------------------------------------------------------ messages


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
