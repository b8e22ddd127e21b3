"""The trainer configs of both training stages, built one way: `sft.args` becomes a
`trl.SFTConfig` and `train.grpo` a `trl.GRPOConfig`, each with the keys the pipeline sets itself
(`vlmrl.params_checks.PIPELINE_KEYS`). Before a config is built every value is checked against
its field's type with pydantic in strict mode (`vlmrl.params_checks.config_values`, which
`vlmrl recipe --check` runs too): TRL takes `learning_rate: abc` and fails only once training has
started, an hour into a run. No torch at import."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlmrl.params import ModelParams, ParamsError
from vlmrl.params_checks import PIPELINE_KEYS, check_report_to, config_values


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
                           f"vlmrl.params_checks.PIPELINE_KEYS[{key_path!r}]")
    args = config_values(config_class, args, key_path)
    kwargs = {**(defaults or {}), **args}
    check_report_to(kwargs.get("report_to", "none"), f"{key_path}.report_to")
    kwargs.update(pipeline, **precision_flags(args, model_settings))
    try:
        return config_class(**kwargs)
    except ValueError as error:  # TrainingArguments' and TRL's own checks of the values
        raise ParamsError(f"params.yaml {key_path}: {error}") from None
