"""Every bad params value is one ParamsError line, raised where `load_params`' typed sections
are read (so before any model loads, in every stage and in `vlmrl recipe --check`): it names the
file, the key path, the value and what is allowed. One test per check: the trainer configs'
ranges (learning rate, warm-up, counts, probabilities), GRPO's batch arithmetic, the embedded
model and data set names, unknown sections, and the file a message names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT

from vlmrl.errors import run_stage
from vlmrl.params import Params, ParamsError, load_params
from vlmrl.params_checks import (
    EMBEDDED_MODELS,
    check_generation_batch,
    check_trainer_args,
    check_trainer_fields,
)

SHIPPED = yaml.safe_load((ROOT / "params.yaml").read_text())


def with_value(key: str, value: Any) -> Params:
    """The shipped params with one dotted key set."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return Params(raw)


def refused(key: str, value: Any) -> str:
    """The message the section holding `key` refuses `value` with."""
    section = key.split(".")[0]
    with pytest.raises(ParamsError) as caught:
        getattr(with_value(key, value), section)
    return str(caught.value)


def test_the_shipped_params_pass_every_check() -> None:
    Params(SHIPPED).check()
    check_trainer_fields(SHIPPED["sft"]["args"], SHIPPED["train"]["grpo"])


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("train.grpo.learning_rate", -3e-4, "a number > 0"),
    ("train.grpo.learning_rate", 0, "a number > 0"),
    ("sft.args.learning_rate", -1, "a number > 0"),
    ("train.grpo.learning_rate", "fast", "a number > 0"),
    ("train.grpo.learning_rate", True, "a number > 0"),
    ("train.grpo.weight_decay", -0.1, "a number >= 0"),
    ("train.grpo.max_grad_norm", -1.0, r"a number >= 0 \(0: no clipping\)"),
    ("train.grpo.max_steps", 0, r"an integer >= 1 or -1 \(-1: by num_train_epochs\)"),
    ("sft.args.max_steps", -2,
     r"an integer >= 0 or -1 \(0: no cold start; -1: by num_train_epochs\)"),
    ("train.grpo.per_device_train_batch_size", 0, "an integer >= 1"),
    ("train.grpo.per_device_train_batch_size", 32.0, "an integer >= 1"),
    ("sft.args.gradient_accumulation_steps", 0, "an integer >= 1"),
    ("train.grpo.steps_per_generation", 0, "an integer >= 1"),
    ("train.grpo.num_iterations", 0, "an integer >= 1"),
    ("train.grpo.max_completion_length", 0, "an integer >= 1"),
    ("train.grpo.num_generations", 1,
     r"an integer >= 2 \(GRPO compares the completions of a group\)"),
    ("train.grpo.temperature", 0, "a number > 0"),
    ("train.grpo.top_p", 0, r"a number in \(0, 1\] \(1: no cut\)"),
    ("train.grpo.top_p", 1.5, r"a number in \(0, 1\] \(1: no cut\)"),
    ("train.grpo.top_k", -1, r"an integer >= 0 \(0: no cut\)"),
    ("train.grpo.min_p", 2, r"a number in \[0, 1\]"),
    ("train.grpo.epsilon", -0.1, "a number >= 0"),
    ("train.grpo.epsilon_high", -0.1, "a number >= 0"),
    ("train.grpo.beta", -1.0, "a number >= 0"),
    ("train.grpo.warmup_ratio", 1.5, r"a number in \[0, 1\]"),
])
def test_a_trainer_value_out_of_range_is_one_line(key: str, value: Any, allowed: str) -> None:
    message = refused(key, value)
    assert re.fullmatch(rf"params\.yaml {re.escape(key)}: must be {allowed}, got "
                        rf"{re.escape(repr(value))}", message), message


@pytest.mark.parametrize(("key", "value"), [
    ("train.grpo.learning_rate", "5e-06"),  # DVC's `-S train.grpo.learning_rate=5e-6`
    ("train.grpo.max_steps", -1),           # by epochs
    ("sft.args.max_steps", 0),              # no cold start
    ("train.grpo.top_k", 0),
    ("train.grpo.epsilon_high", None),      # TRL: epsilon
])
def test_values_in_range_pass(key: str, value: Any) -> None:
    assert getattr(with_value(key, value), key.split(".")[0])


@pytest.mark.parametrize(("value", "problem"), [
    (-1, "a step count"), (1.5, "a step count"), ("soon", "a step count"),
    (20, r"a step count of at most max_steps \(12\)"),
])
def test_warmup_is_a_step_count_within_the_run_or_a_fraction(value: Any, problem: str) -> None:
    assert re.match(rf"params\.yaml train\.grpo\.warmup_steps: must be {problem}.*, got "
                    rf"{re.escape(repr(value))}$", refused("train.grpo.warmup_steps", value))


@pytest.mark.parametrize("value", [0, 0.1, 0.99, 5, 12])
def test_warmup_within_the_run_passes(value: float) -> None:
    assert with_value("train.grpo.warmup_steps", value).train.grpo["warmup_steps"] == value


def test_a_generation_holds_whole_groups() -> None:
    """GRPOConfig's arithmetic on the global batch: 32 x 2 completions are 5.33 groups of 12."""
    assert refused("train.grpo.num_generations", 12) == (
        "params.yaml train.grpo.num_generations: must divide the generation batch "
        "(per_device_train_batch_size 32 x steps_per_generation 2 = 64) so that it holds whole "
        "groups, got 12")
    check_generation_batch({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                            "num_generations": 8})
    with pytest.raises(ParamsError, match=r"x steps_per_generation 1 = 4\) so that .* got 8$"):
        check_generation_batch({"per_device_train_batch_size": 4})  # TRL's num_generations: 8


def test_generation_batch_size_is_a_multiple_of_the_micro_batch() -> None:
    grpo = {"per_device_train_batch_size": 8, "num_generations": 4}
    check_generation_batch({**grpo, "generation_batch_size": 32})
    with pytest.raises(ParamsError, match=r"generation_batch_size: must be a multiple of "
                                          r"per_device_train_batch_size \(8\), got 12$"):
        check_generation_batch({**grpo, "generation_batch_size": 12})
    with pytest.raises(ParamsError, match=r"generation_batch_size: set it or steps_per_generation"):
        check_generation_batch({**grpo, "generation_batch_size": 32, "steps_per_generation": 4})


def test_keys_without_a_rule_are_left_to_trls_fields() -> None:
    check_trainer_args("train.grpo", {"optim": "adamw_8bit", "seed": 42})
    check_trainer_args("train.grpo", None)  # pydantic refuses a missing mapping itself
    with pytest.raises(ParamsError, match=r"^params\.yaml train\.grpo\.learnig_rate is not a "
                                          r"trl\.GRPOConfig \(trl [\d.]+\) field"):
        check_trainer_fields({}, {"learnig_rate": 1e-4})
    with pytest.raises(ParamsError, match=r"^params\.yaml sft\.args\.report_to: 'wandb' is not "):
        check_trainer_fields({"report_to": "wandb"}, {})


def test_embedded_names_are_the_ones_the_project_builds() -> None:
    from vlmrl.models.embedded import EMBEDDED_PREFIX, SHAPES, TEXT_SHAPES

    assert set(EMBEDDED_MODELS) == {EMBEDDED_PREFIX + name for name in [*SHAPES, *TEXT_SHAPES]}
    assert refused("model.name", "embedded:tiny-qwen9") == (
        "params.yaml model.name: unknown embedded model 'embedded:tiny-qwen9'; known: "
        + ", ".join(EMBEDDED_MODELS))
    hub = with_value("model.name", "Qwen/Qwen3-VL-2B-Instruct").model  # the hub's to check
    assert hub.name == "Qwen/Qwen3-VL-2B-Instruct"
    assert refused("data.source", "embedded:gsm8k") == (
        "params.yaml data.source: unknown embedded data set 'embedded:gsm8k'; known: "
        "embedded:synthetic, embedded:arithmetic")


def test_check_reads_every_section_and_refuses_an_unknown_one() -> None:
    with pytest.raises(ParamsError, match=r"^params\.yaml upload\.max_attempts: "):
        with_value("upload.max_attempts", 0).check()
    raw = {**SHIPPED, "trian": {"save_steps": 1}}
    with pytest.raises(ParamsError, match=r"^params\.yaml has unknown sections \['trian'\]; "
                                          r"known: model, data, "):
        Params(raw).check()


def test_a_message_names_the_file_it_read_once(tmp_path: Path) -> None:
    path = tmp_path / "other.yaml"
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["train"]["grpo"]["learning_rate"] = -1
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError) as caught:
        _ = load_params(path).train
    assert str(caught.value) == (f"{path} train.grpo.learning_rate: must be a number > 0, "
                                 "got -1")
    with pytest.raises(ParamsError, match=rf"^{re.escape(str(path))} has no `train` section$"):
        _ = Params({}, source=path).train


def test_a_stage_refuses_a_negative_learning_rate_in_one_line(tmp_path: Path, capsys,
                                                              monkeypatch) -> None:
    """As train_gspo's script starts: load_params, then the train section, before torch."""
    monkeypatch.delenv("VLMRL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "params.yaml").read_text()
    Path("params.yaml").write_text(text.replace("learning_rate: 3.0e-4 ", "learning_rate: -3e-4 "))

    def main() -> int:
        _ = load_params().train
        return 0

    assert run_stage("train_gspo", main) == 1
    assert capsys.readouterr().err == ("train_gspo failed: params.yaml train.grpo.learning_rate: "
                                       "must be a number > 0, got '-3e-4'\n")
