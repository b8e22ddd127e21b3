"""The cold-start SFT writes exactly the format the rewards score, switches off cheaply, and names
bad params by their key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmrl.models.loading import START_MARKER, starting_adapter
from vlmrl.params import Params, ParamsError, SftParams
from vlmrl.rewards.functions import score_completion
from vlmrl.rewards.scoring import format_ok
from vlmrl.training.sft import build_sft_config, run_sft, sft_completion

RECORD = {"answer": "12.35", "question_type": "free_form", "answer_type": "float",
          "precision": 2.0, "choices": None, "unit": None}


def test_completion_earns_full_format_and_correctness() -> None:
    text = sft_completion(RECORD["answer"])
    assert format_ok(text)
    scored = score_completion(text, RECORD, {"format_reward": 1.0, "correctness_reward": 1.0})
    assert scored["rewards"] == {"format_reward": 2.0, "correctness_reward": 2.0}


def test_disabled_or_zero_steps_is_a_pass_through(tmp_path: Path) -> None:
    for index, sft in enumerate(({"enabled": False, "args": {"max_steps": 5}},
                                 {"enabled": True, "args": {"max_steps": 0}})):
        out = tmp_path / str(index)
        summary = run_sft(train_set=tmp_path / "missing", params=Params({"sft": sft}), out=out)
        assert summary["adapter"] is False and summary["steps"] == 0
        assert json.loads((out / START_MARKER).read_text())["adapter"] is False
        assert starting_adapter(out) is None


def test_missing_sft_output_names_the_stage(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="sft_cold_start stage"):
        starting_adapter(tmp_path)
    assert starting_adapter(None) is None


@pytest.mark.parametrize(("sft", "key"), [({"epochs": 1}, "unknown keys"),
                                          ({"enabled": "yes"}, "sft.enabled"),
                                          ({"args": {"output_dir": "x"}}, "set by the pipeline"),
                                          ({"reasoning": "{question}"}, "sft.reasoning")])
def test_bad_sft_params_name_the_key(sft: dict, key: str) -> None:
    with pytest.raises(ParamsError, match=key):
        SftParams.from_params(sft)


def test_unknown_sft_config_field_names_the_key(tmp_path: Path) -> None:
    settings = SftParams.from_params({"enabled": True, "args": {"max_step": 3}})
    with pytest.raises(ParamsError, match="sft.args.max_step "):
        build_sft_config(settings, tmp_path, Params({"model": {"name": "x"}}).model)


def test_sft_rows_leave_the_prepared_set_untouched(tmp_path: Path) -> None:
    """A datasets cache file beside the prepared train set would change prepare_data's DVC output
    and rerun the whole pipeline on the next `dvc repro`."""
    from datasets import load_from_disk

    from vlmrl.data.prepare import load_raw_records, prepare, to_dataset
    from vlmrl.params import DataParams
    from vlmrl.training.sft import sft_dataset

    settings = DataParams(synthetic_size=8, eval_size=2, image_size=64)
    to_dataset(prepare(load_raw_records(settings), settings).train).save_to_disk(str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    rows = sft_dataset(load_from_disk(str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    assert rows.column_names == ["image", "prompt", "completion"]
    assert rows[0]["completion"][0]["content"][0]["text"] == sft_completion(
        load_from_disk(str(tmp_path))[0]["answer"])
