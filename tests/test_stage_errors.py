"""Every stage refuses bad params or a corrupt input with one line on stderr
that names the key path or the file, and a non-zero exit; the traceback only with VLMRL_DEBUG=1.
Each stage script runs as DVC runs it (dvc.yaml's command) in a copy of the project whose data is
prepared; every case fails before a model is loaded."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import TEST_PARAMS
from project_repo import copy_project, run, stage_command, update_params

from vlmrl.errors import USER_ERROR_STATUS, json_source, one_line, run_stage
from vlmrl.params import ParamsError
from vlmrl.pipeline.dvc_env import dvc_env

SMALL_DATA = {**TEST_PARAMS, "data.synthetic_size": 16, "data.synthetic_read_size": 4}


@pytest.fixture(scope="module")
def prepared_project(tmp_path_factory) -> Path:
    project = copy_project(tmp_path_factory.mktemp("errors") / "project", SMALL_DATA)
    run(stage_command("prepare_data", project), project)
    return project


@pytest.fixture
def project(prepared_project: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared_project, tmp_path / "project"))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pass_through_sft(project: Path) -> None:
    write(project / "data/models/sft/vlmrl_sft.json", json.dumps({"adapter": False}))


def baseline_files(project: Path) -> None:
    write(project / "data/eval/baseline/records.jsonl", "")
    write(project / "data/metrics/baseline_eval.json", "{}")


def corrupt_adapter(project: Path) -> None:
    write(project / "data/models/adapter/adapter_config.json", '{"peft_type": "LORA",')
    write(project / "data/models/adapter/adapter_model.safetensors", "not weights")


def truncated_adapter(project: Path) -> None:
    """A real adapter's weights file cut short, as a failed copy or a full disk leaves it."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    adapter = project / "data/models/adapter"
    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"]).save_pretrained(str(adapter))
    weights = adapter / "adapter_model.safetensors"
    save_file({"base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.ones(8, 256)}, str(weights))
    weights.write_bytes(weights.read_bytes()[:-100])


def empty_local_file(project: Path) -> None:
    write(project / "data/local/train.jsonl", "")


def duplicate_local_records(project: Path) -> None:
    record = json.dumps({"id": "a1", "question": "What is 3 + 4?", "answer": "7"})
    write(project / "data/local/train.jsonl", f"{record}\n{record}\n")


def missing_baseline(project: Path) -> None:
    write(project / "data/models/adapter/adapter_config.json", "{}")
    shutil.rmtree(project / "data/eval/baseline", ignore_errors=True)
    (project / "data/metrics/baseline_eval.json").unlink(missing_ok=True)


def params(update: dict) -> Callable[[Path], None]:
    return lambda project: update_params(project, update)


def then(*steps: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(project: Path) -> None:
        for step in steps:
            step(project)
    return setup


# (stage, how its input is broken, what the one line must name)
CASES = [
    ("prepare_data", params({"data.eval_size": 0}), "data.eval_size"),
    ("sft_cold_start", params({"sft.args.learning_rate": "fast"}), "sft.args.learning_rate"),
    ("baseline_eval", then(pass_through_sft, params({"eval.temperature": 0})), "eval.temperature"),
    ("train_gspo", params({"train.grpo.max_steps": "ten"}), "train.grpo.max_steps"),
    ("post_eval", then(baseline_files, params({"eval.top_p": 1.5})), "eval.top_p"),
    ("verify_lora", corrupt_adapter, "data/models/adapter/adapter_config.json: not valid JSON"),
    ("export", params({"export.gguf_outtypes": ["q8_0"]}), "export.gguf_outtypes"),
    ("upload", params({"upload.max_attempts": 0}), "upload.max_attempts"),
    ("sft_cold_start", params({"model.name": "embedded:no-such-model"}),
     "model.name: unknown embedded model 'embedded:no-such-model'"),
    ("baseline_eval", then(pass_through_sft, params({"rewards.weights.bleu": 1.0})),
     "rewards.weights: unknown reward 'bleu'"),
    ("train_gspo", params({"train.grpo.num_generations": 0}), "train.grpo.num_generations"),
    ("verify_lora", truncated_adapter,
     "data/models/adapter/adapter_model.safetensors: not a readable safetensors file"),
    # params, checked before any model loads
    ("prepare_data", params({"data.image_size": 8}), "data.image_size"),
    ("prepare_data", params({"data.answer_pattern": "(unclosed"}), "data.answer_pattern"),
    ("sft_cold_start", params({"sft.args.learning_rate": -1e-3}), "sft.args.learning_rate"),
    ("sft_cold_start", params({"sft.args.max_steps": 4, "sft.args.warmup_steps": 9}),
     "sft.args.warmup_steps"),
    ("train_gspo", params({"train.grpo.learning_rate": -3e-4}), "train.grpo.learning_rate"),
    ("train_gspo", params({"train.grpo.per_device_train_batch_size": 3}),
     "train.grpo.num_generations"),
    ("train_gspo", params({"train.lora.dropout": 1.5}), "train.lora.dropout"),
    ("train_gspo", params({"train.grpo.no_such_key": 1}), "train.grpo.no_such_key"),
    ("baseline_eval", then(pass_through_sft, params({"eval.max_new_tokens": 0})),
     "eval.max_new_tokens"),
    ("verify_lora", params({"verify.logit_tolerance": -1}), "verify.logit_tolerance"),
    ("export", params({"export.dtype": "float64"}), "export.dtype"),
    # data files
    ("prepare_data", then(empty_local_file, params({"data.source": "local",
                                                     "data.path": "data/local/train.jsonl"})),
     "the file is empty"),
    ("prepare_data", then(duplicate_local_records,
                          params({"data.source": "local", "data.path": "data/local/train.jsonl",
                                  "data.strict": True, "data.columns": {"id": "id"}})),
     "duplicate id: data/local/train.jsonl:1 has the same id"),
    ("prepare_data", params({"data.source": "local", "data.path": "data/local/none.jsonl"}),
     "data/local/none.jsonl"),
    # model and data ids
    ("prepare_data", params({"data.source": "org/no-such-dataset"}),
     "data.source: the Hugging Face hub cannot be reached"),
    ("sft_cold_start", params({"model.name": "Qwen/Qwen3-VL-2B-Instrukt"}),
     "model.name: the Hugging Face hub cannot be reached"),
    ("baseline_eval", then(pass_through_sft, params({"model.name": "Qwen/Qwen3-VL-2B-Instrukt"})),
     "model.name: the Hugging Face hub cannot be reached"),
    # reward specs
    ("baseline_eval", then(pass_through_sft, params({"rewards.length_penalty.shortest": 3})),
     "rewards: "),
    ("train_gspo", params({"rewards.weights.my_rewards:brevity": 1.0}), "my_rewards:brevity"),
    # adapters and earlier stages' outputs
    ("post_eval", missing_baseline, "the baseline_eval stage makes it"),
    ("export", corrupt_adapter, "data/models/adapter/adapter_config.json: not valid JSON"),
    # S3 settings
    ("upload", params({"upload.version": "v1/../x"}), "upload.version"),
    ("upload", params({"upload.multipart_threshold_mb": 1}), "upload.multipart_threshold_mb"),
    ("upload", params({"upload.endpoint_url": "minio:9000"}), "upload.endpoint_url"),
]


def case_ids(cases: list[tuple]) -> list[str]:
    """The stage's name, numbered from its second case on."""
    seen: dict[str, int] = {}
    ids = []
    for stage, *_ in cases:
        seen[stage] = seen.get(stage, 0) + 1
        ids.append(stage if seen[stage] == 1 else f"{stage}-{seen[stage]}")
    return ids


def run_stage_script(project: Path, stage: str, debug: bool = False):
    env = dvc_env()
    env.pop("VLMRL_DEBUG", None)
    if debug:
        env["VLMRL_DEBUG"] = "1"
    return run(stage_command(stage, project), project, check=False, env=env)


def earlier_outputs(project: Path, stage: str) -> dict[Path, str]:
    """Files standing for the outputs of the stage's last good run: its metrics and details."""
    command = stage_command(stage, project)
    files = {}
    for flag in ("--metrics", "--details"):
        path = project / command[command.index(flag) + 1]
        write(path, json.dumps({"from": "the last good run", "flag": flag}))
        files[path] = path.read_text()
    return files


def test_there_are_many_cases_over_every_stage() -> None:
    assert len(CASES) >= 30
    assert {stage for stage, *_ in CASES} == {
        "prepare_data", "sft_cold_start", "baseline_eval", "train_gspo", "post_eval",
        "verify_lora", "export", "upload"}


@pytest.mark.parametrize(("stage", "setup", "named"), CASES, ids=case_ids(CASES))
def test_stage_refuses_bad_input_in_one_line(project: Path, stage, setup, named) -> None:
    setup(project)
    before = earlier_outputs(project, stage)
    result = run_stage_script(project, stage)
    assert result.returncode == USER_ERROR_STATUS, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr[-3000:]
    line = result.stderr.strip()
    assert line.startswith(f"{stage} failed: "), line
    assert named in line, line
    assert "Traceback" not in result.stdout + result.stderr
    assert {path: path.read_text() for path in before} == before  # the last good run's, as they were


def test_malformed_params_file_names_file_and_line(project: Path) -> None:
    params_file = project / "params.yaml"
    params_file.write_text(params_file.read_text().replace("seed: 0", "seed: [0", 1))
    result = run_stage_script(project, "train_gspo")
    assert result.returncode == USER_ERROR_STATUS
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("train_gspo failed: ") and '"params.yaml", line' in line, line


def test_debug_shows_the_traceback(project: Path) -> None:
    update_params(project, {"upload.max_attempts": 0})
    result = run_stage_script(project, "upload", debug=True)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ParamsError" in result.stderr
    assert "upload.max_attempts" in result.stderr


def test_a_bug_keeps_its_traceback() -> None:
    def buggy() -> int:
        return {}["missing"]

    with pytest.raises(KeyError):
        run_stage("some_stage", buggy)


def test_user_error_is_one_line_and_status(capsys, monkeypatch) -> None:
    monkeypatch.delenv("VLMRL_DEBUG", raising=False)

    def refuses() -> int:
        raise ParamsError("params.yaml eval.top_k: first\nsecond")

    assert run_stage("baseline_eval", refuses) == USER_ERROR_STATUS
    assert capsys.readouterr().err == "baseline_eval failed: params.yaml eval.top_k: first; second\n"
    monkeypatch.setenv("VLMRL_DEBUG", "1")
    with pytest.raises(ParamsError):
        run_stage("baseline_eval", refuses)


def test_missing_file_is_a_user_error(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("VLMRL_DEBUG", raising=False)
    missing = tmp_path / "records.jsonl"
    assert run_stage("post_eval", missing.read_text) == USER_ERROR_STATUS
    assert str(missing) in capsys.readouterr().err


def test_stage_exit_status_passes_through() -> None:
    assert run_stage("verify_lora", lambda: 3) == 3
    assert run_stage("prepare_data", lambda: None) == 0


def test_json_error_names_the_open_file(tmp_path) -> None:
    path = tmp_path / "dataset_info.json"
    path.write_text("{bad")
    with pytest.raises(json.JSONDecodeError) as caught, path.open() as handle:
        json.load(handle)
    assert json_source(caught.value.__traceback__) == str(path)
    assert one_line(caught.value).startswith(f"{path}: not valid JSON (")


def test_json_error_names_the_path_its_reader_held(tmp_path) -> None:
    marker = tmp_path / "vlmrl_sft.json"
    marker.write_text("{bad")
    with pytest.raises(json.JSONDecodeError) as caught:
        json.loads(marker.read_text())
    assert json_source(caught.value.__traceback__) == str(marker)


def test_trl_config_values_are_checked_against_the_field_types() -> None:
    import trl

    from vlmrl.training.trainer.config import config_values

    checked = config_values(trl.GRPOConfig, {"learning_rate": "5e-06", "max_steps": 4,
                                             "report_to": ["tensorboard"], "top_k": 20},
                            "train.grpo")
    assert checked["learning_rate"] == 5e-06  # DVC's `-S lr=5e-6` reads back as text
    assert checked["max_steps"] == 4
    # an enum field takes its values, a dataclass field a mapping of its fields, as TRL does
    assert config_values(trl.GRPOConfig, {"debug": ["underflow_overflow"],
                                          "parallelism_config": {"tp_size": 1}}, "train.grpo")
    for key, value in [("learning_rate", "fast"), ("max_steps", 4.5), ("seed", True),
                       ("gradient_checkpointing", "yes"), ("debug", ["everything"]),
                       ("report_to", 3)]:
        with pytest.raises(ParamsError, match=rf"^params\.yaml train\.grpo\.{key}: must be "):
            config_values(trl.GRPOConfig, {key: value}, "train.grpo")


def test_numeric_text_stays_text_where_the_field_is_text() -> None:
    """Only a value its field refuses is read as a float written as text: a run name "001" stays
    "001", and a refused value is named as written."""
    import trl

    from vlmrl.training.trainer.config import config_values

    assert config_values(trl.GRPOConfig, {"run_name": "001"}, "train.grpo") == {"run_name": "001"}
    with pytest.raises(ParamsError, match=r"^params\.yaml train\.grpo\.max_steps: must be a valid "
                                          r"integer, got '10'$"):
        config_values(trl.GRPOConfig, {"max_steps": "10"}, "train.grpo")


def test_stage_outputs_leave_no_stale_or_half_written_output(tmp_path: Path) -> None:
    """A run sees none of the earlier outputs; a failed one leaves them as they were and nothing
    of its own; a successful one leaves only its own."""
    from vlmrl.outputs import stage_outputs

    stale, folder = tmp_path / "metrics.json", tmp_path / "adapter"
    stale.write_text("{}")
    (folder / "sub").mkdir(parents=True)
    with pytest.raises(ParamsError), stage_outputs(stale, folder):
        assert not stale.exists() and not folder.exists()  # moved aside during the run
        folder.mkdir()
        stale.write_text('{"half":')
        raise ParamsError("params.yaml eval.top_k: bad")
    assert stale.read_text() == "{}" and (folder / "sub").is_dir()  # the earlier ones are back
    with stage_outputs(stale, folder):
        stale.write_text('{"new": 1}')
    assert stale.read_text() == '{"new": 1}' and not folder.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.json"]
    with pytest.raises(KeyError), stage_outputs(stale, owner=False):  # a worker rank's
        raise KeyError("x")
    assert stale.exists()


def test_outputs_a_killed_run_moved_aside_come_back_at_the_next_run(tmp_path: Path) -> None:
    from vlmrl.outputs import previous, recover_outputs, stage_outputs

    output = tmp_path / "metrics.json"
    previous(output).write_text("good")  # moved aside by a run that was then killed,
    output.write_text('{"half":')  # which had written this
    recover_outputs(output)
    assert output.read_text() == "good" and not previous(output).exists()
    previous(output).write_text("good")
    output.unlink()
    with pytest.raises(RuntimeError), stage_outputs(output):
        raise RuntimeError("failed again")
    assert output.read_text() == "good"
