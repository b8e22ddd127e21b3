"""train_gspo on the embedded default, through DVC: GSPO must really clip, LoRA must really
train, and an interrupted run must resume instead of starting over."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from conftest import (
    TEST_PARAMS,
    dvc_repro,
    kill_repro_when,
    make_project_repo,
    run,
    stage_command,
    update_params,
)

from vlmrl.models.loading import language_model_targets
from vlmrl.params import ModelParams, Params, ParamsError, TrainParams
from vlmrl.training.gspo import build_grpo_config, vllm_installed
from vlmrl.training.trainer.logs import step_log_rows


def read_log(path: Path) -> list[dict]:
    """A train log: a JSON list of rows, which `dvc plots` reads."""
    return json.loads(path.read_text())


def lora_b_norms(adapter: Path) -> dict[str, float]:
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    return {name: float(t.abs().sum()) for name, t in tensors.items() if "lora_B" in name}


@pytest.mark.slow
def test_train_gspo_through_dvc(pipeline_repo: Path) -> None:
    dvc_repro(pipeline_repo, "train_gspo")  # earlier tests may have reproduced it already

    adapter = pipeline_repo / "data/models/adapter"
    norms = lora_b_norms(adapter)
    assert norms and all(value > 0 for value in norms.values()), norms
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert not any("visual" in name for name in config["target_modules"])
    assert (adapter / "preprocessor_config.json").is_file()

    log = read_log(pipeline_repo / "data/metrics/train_log.json")
    assert [row["step"] for row in log] == [1, 2, 3, 4]
    assert any(row.get("clip_ratio_region_mean", 0) > 0 for row in log), "GSPO never clipped"
    assert not any("step_time" in row for row in log)  # wall clock: in the timings file
    timings = json.loads((pipeline_repo / "data/reports/timings/train_gspo.json").read_text())
    assert len(timings["step_seconds"]) == 4 and all(t > 0 for t in timings["step_seconds"])
    summary = json.loads((pipeline_repo / "data/metrics/train.json").read_text())
    assert summary["steps"] == 4 and summary["max_clip_ratio"] > 0
    assert list((pipeline_repo / "data/reports/train_completions").glob("*.parquet"))
    assert (pipeline_repo / "data/reports/train_curves.png").stat().st_size > 1000


@pytest.mark.slow
def test_interrupted_training_resumes(tmp_path: Path) -> None:
    repo = make_project_repo(tmp_path / "repo", {**TEST_PARAMS, "train.grpo.max_steps": 6})
    dvc_repro(repo, "prepare_data")
    kill_repro_when(repo, repo / "data/checkpoints/train_gspo/checkpoint-2/trainer_state.json")
    assert not (repo / "data/models/adapter").exists(), "adapter written before training finished"

    result = dvc_repro(repo, "train_gspo")
    assert "resuming from" in result.stdout + result.stderr
    summary = json.loads((repo / "data/reports/details/train_gspo.json").read_text())
    assert summary["steps"] == 6
    assert summary["resumed_from"].endswith("checkpoint-2") or summary["resumed_from"].endswith(
        "checkpoint-4")
    steps = [row["step"] for row in read_log(repo / "data/metrics/train_log.json")]
    assert steps[-1] == 6


def test_unknown_grpo_key_names_it() -> None:
    with pytest.raises(ParamsError, match=r"train\.grpo\.max_prompt_length"):
        build_grpo_config({"max_prompt_length": 512}, output_dir=Path("/tmp/x"), save_steps=2,
                          reward_weights=[1.0], model_settings=ModelParams(name="x"))


def test_pipeline_managed_key_is_refused() -> None:
    with pytest.raises(ParamsError, match=r"train\.grpo\.output_dir"):
        build_grpo_config({"output_dir": "elsewhere"}, output_dir=Path("/tmp/x"), save_steps=2,
                          reward_weights=[1.0], model_settings=ModelParams(name="x"))


def test_on_policy_gspo_warns() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_grpo_config({"importance_sampling_level": "sequence", "num_iterations": 1,
                           "steps_per_generation": 1, "gradient_accumulation_steps": 1,
                           "per_device_train_batch_size": 4, "num_generations": 4},
                          output_dir=Path("/tmp/x"), save_steps=2, reward_weights=[1.0],
                          model_settings=ModelParams(name="x"))
    assert any("GSPO has no effect" in str(w.message) for w in caught)


def test_gspo_defaults_move_the_ratio() -> None:
    import yaml
    from conftest import ROOT

    grpo = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["grpo"]
    assert grpo["importance_sampling_level"] == "sequence"
    assert grpo["beta"] == 0 and grpo["loss_type"] == "grpo"
    assert (grpo["steps_per_generation"] > grpo["gradient_accumulation_steps"]
            or grpo["num_iterations"] > 1)


def test_bad_reward_name_fails_the_stage(fresh_repo: Path) -> None:
    update_params(fresh_repo, {"rewards.weights": {"format_reward": 0.3, "no_such_reward": 1.0}})
    dvc_repro(fresh_repo, "prepare_data")
    result = run(stage_command("train_gspo"), fresh_repo, check=False)
    assert result.returncode != 0
    assert "no_such_reward" in result.stderr and "correctness_reward" in result.stderr
    assert not (fresh_repo / "data/models/adapter").exists()
    assert not (fresh_repo / "data/metrics/train.json").exists()


def test_unknown_grpo_key_fails_the_stage(fresh_repo: Path) -> None:
    update_params(fresh_repo, {"train.grpo.warmup_ratio": 0.1})
    dvc_repro(fresh_repo, "prepare_data")
    result = run(stage_command("train_gspo"), fresh_repo, check=False)
    assert result.returncode != 0 and "train.grpo.warmup_ratio" in result.stderr


def test_lora_targets_skip_the_vision_tower() -> None:
    import torch

    class Tower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(2, 2)

    model = torch.nn.Module()
    model.visual = Tower()
    model.language_model = Tower()
    assert language_model_targets(model, ["q_proj"]) == ["q_proj"]
    with pytest.raises(ParamsError, match="gate_proj"):
        language_model_targets(model, ["q_proj", "gate_proj"])


def test_step_log_rows_flatten_trainer_keys() -> None:
    rows = step_log_rows([{"step": 1, "reward": 0.5, "clip_ratio/region_mean": 0.25,
                           "completions/mean_length": 32.0},
                          {"step": 1, "train_runtime": 3.0}])
    assert rows == [{"step": 1, "reward": 0.5, "clip_ratio_region_mean": 0.25,
                     "completions_mean_length": 32.0}]


def test_generation_rows_must_divide_the_generation_batch() -> None:
    from vlmrl.training.gspo import generation_rows

    config = build_grpo_config({"per_device_train_batch_size": 4, "steps_per_generation": 2,
                                "num_generations": 4}, output_dir=Path("/tmp/x"), save_steps=2,
                               reward_weights=[1.0], model_settings=ModelParams(name="x"))
    assert generation_rows(None, config) is None
    assert generation_rows(4, config) == 4
    with pytest.raises(ParamsError, match=r"max_generation_rows.*\(3\) must divide.*= 8"):
        generation_rows(3, config)
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"]}
    with pytest.raises(ParamsError, match="positive integer"):
        TrainParams.from_params({"save_steps": 2, "lora": lora, "max_generation_rows": 0})


def tiny_processor():
    from vlmrl.models.embedded import resolve_model_path
    from vlmrl.models.processor import load_processor

    return load_processor(resolve_model_path(ModelParams(name="embedded:tiny-qwen3-vl")))


def test_generation_chunks_hold_exactly_their_prompts_images() -> None:
    """Each chunk's fields must be what the processor gives for that chunk's prompts alone,
    called as TRL's GRPOTrainer calls it."""
    import numpy as np
    from PIL import Image

    from vlmrl.training.trainer.chunked_generation import split_generation_inputs

    processor = tiny_processor()
    sizes = [(64, 64), (128, 96), (96, 160), (64, 128), (160, 64)]
    images = [[Image.new("RGB", size, (40 * i, 90, 200))] for i, size in enumerate(sizes)]
    prompts = [[{"role": "user", "content": [{"type": "image", "image": found[0]},
                                             {"type": "text", "text": f"question {i}"}]}]
               for i, found in enumerate(images)]

    def tokenized(first: int, last: int) -> dict:
        return dict(processor.apply_chat_template(
            conversation=prompts[first:last], add_generation_prompt=True, tokenize=True,
            return_dict=True))

    whole = tokenized(0, 5)
    fields = {k: v for k, v in whole.items() if k not in ("input_ids", "attention_mask")}
    assert {"pixel_values", "image_grid_thw"} <= set(fields)
    chunks = list(split_generation_inputs(whole["input_ids"], images, fields, rows=2))

    assert [len(ids) for ids, _, _ in chunks] == [2, 2, 1]
    for index, (ids, chunk_images, chunk_fields) in enumerate(chunks):
        first, last = 2 * index, min(2 * index + 2, 5)
        expected = tokenized(first, last)
        assert ids == expected["input_ids"] and chunk_images == images[first:last]
        assert set(chunk_fields) == set(fields)
        for key in fields:
            if isinstance(expected[key], list):  # per-prompt, ragged
                assert chunk_fields[key] == expected[key], key
            else:
                assert np.array_equal(chunk_fields[key], expected[key]), key


def test_unsplittable_field_is_a_clear_error() -> None:
    import torch

    from vlmrl.training.trainer.chunked_generation import split_generation_inputs

    with pytest.raises(ValueError, match=r"max_generation_rows.*`pixel_attention_mask`"):
        list(split_generation_inputs([[1], [2], [3]], None,
                                     {"pixel_attention_mask": torch.ones(3, 4)}, rows=2))


def test_generation_in_chunks_keeps_the_row_order() -> None:
    from vlmrl.training.trainer.mixins import ChunkedGeneration

    class Generator:  # GRPOTrainer's `_generate_single_turn` contract
        def __init__(self) -> None:
            self.calls: list[int] = []

        def _generate_single_turn(self, prompt_ids, images, fields, num_generations,
                                  has_tool_images=False):
            self.calls.append(len(prompt_ids))
            return [ids + [100] for ids in prompt_ids], None

    class Trainer(ChunkedGeneration, Generator):
        pass

    trainer = Trainer(generation_rows=4)
    prompts = [[row] for row in range(12)]
    completions, logprobs = trainer._generate_single_turn(prompts, None, {}, 4)
    assert trainer.calls == [4, 4, 4]
    assert completions == [[row, 100] for row in range(12)] and logprobs is None
    trainer._generate_single_turn(prompts[:4], None, {}, 4)
    assert trainer.calls[-1] == 4


@pytest.mark.slow
@pytest.mark.parametrize(("setting", "printed"), [
    ({"train.max_generation_rows": 4}, "generating 8 rows per generation batch in chunks of 4"),
    ({"train.training_attention": "rolled"}, "training attention: rows rolled"),
    ({"train.compile_layers": True}, "text decoder layers compiled for training"),
    ({"train.keep_image_features": True}, "image features kept through a generation's passes"),
], ids=["generation_in_chunks", "rolled_training_attention", "compiled_layers",
        "kept_image_features"])
def test_train_gspo_trains_with(fresh_repo: Path, setting: dict, printed: str) -> None:
    update_params(fresh_repo, {"train.grpo.max_steps": 2, **setting})
    dvc_repro(fresh_repo, "sft_cold_start")
    result = run(stage_command("train_gspo"), fresh_repo)
    assert printed in result.stdout
    if "train.keep_image_features" in setting:
        encoded, asked = map(int, re.search(r"vision tower encoded (\d+) of the (\d+) images",
                                            result.stdout).groups())
        assert 0 < encoded < asked
    summary = json.loads((fresh_repo / "data/metrics/train.json").read_text())
    assert summary["steps"] == 2
    assert all(value > 0 for value in lora_b_norms(fresh_repo / "data/models/adapter").values())


def readme_gpu_overrides() -> dict[str, object]:
    """The params of the recipe the README's GPU command applies (`vlmrl recipe NAME`), as
    dotted keys (`train.grpo.steps_per_generation`), the form `dvc exp run -S` takes."""
    import re

    from conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Real model and MathVista on a GPU"):]
    command = section[section.index("```bash"):section.index("```", section.index("```bash") + 3)]
    return recipe_overrides(re.search(r"^vlmrl recipe (\S+)", command, re.MULTILINE).group(1))


def recipe_overrides(name: str) -> dict[str, object]:
    """Every param recipe NAME runs with (merged onto params.yaml), as dotted keys."""
    from conftest import ROOT

    from vlmrl.pipeline.recipes import recipe_params

    recipe = recipe_params(name, ROOT)

    def dotted(node: dict, prefix: str = "") -> dict[str, object]:
        flat: dict[str, object] = {}
        for key, value in node.items():
            if isinstance(value, dict) and value and key != "generation_kwargs":
                flat.update(dotted(value, f"{prefix}{key}."))
            else:
                flat[f"{prefix}{key}"] = value
        return flat

    return dotted(recipe)


@pytest.fixture(scope="module")
def gspo_step():
    """benchmarks/gspo_step.py, imported as the benchmark runs it (a script beside its peers)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gspo_step

    return gspo_step


def assert_recipe_is_profile(overrides: dict[str, object], profile: dict[str, object]) -> None:
    """The recipe's training knobs are the benchmark configuration's."""
    assert overrides["model.backend"] == profile["backend"]
    assert overrides["model.load_in_4bit"] is profile["load_in_4bit"]
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps",
                "steps_per_generation"):
        assert overrides[f"train.grpo.{key}"] == profile[key], key
    assert overrides["train.max_generation_rows"] == profile["max_generation_rows"]
    assert overrides["train.graph_decoding"] == profile["graph"]
    assert overrides["train.kv_cache_dtype"] == profile["kv_cache_dtype"]
    assert overrides["train.expandable_segments"] is profile["expandable_segments"]
    assert (overrides.get("train.training_attention", "sdpa")
            == profile.get("training_attention", "sdpa"))
    assert overrides["train.compile_layers"] is profile["compile_layers"]
    assert (overrides.get("train.keep_image_features", False)
            is profile.get("keep_image_features", False))
    assert overrides.get("train.nf4_linears", False) is profile.get("nf4_linears", False)


@pytest.mark.parametrize(("recipe", "profile"), [
    ("mathvista-qwen3-vl-2b", "RECIPE_2B_PROFILE"), ("mathvista-qwen3-vl-8b", "RECIPE_8B_PROFILE")])
def test_each_gpu_recipe_is_its_benchmarked_profile(gspo_step, recipe: str, profile: str) -> None:
    """A GPU recipe's training knobs are the configuration benchmarks/gspo_step.py measured as
    its profile (docs/benchmarks.md), so a knob turned in one is turned in the other."""
    assert_recipe_is_profile(recipe_overrides(recipe),
                             gspo_step.CONFIGS[getattr(gspo_step, profile)])


def test_readme_gpu_profile_is_the_benchmarked_one_and_valid(gspo_step) -> None:
    """The recipe the README's GPU command applies must be the configuration
    benchmarks/gspo_step.py measured as the 8B recipe's profile (RECIPE_8B_PROFILE), and must
    pass the stage's own params checks."""
    import yaml
    from conftest import ROOT

    from vlmrl.training.gspo import generation_rows

    overrides = readme_gpu_overrides()
    assert_recipe_is_profile(overrides, gspo_step.CONFIGS[gspo_step.RECIPE_8B_PROFILE])
    assert overrides["train.grpo.cache_implementation"] == "static"
    # the profile's memory figures were measured with it; the tiny default turns it off
    assert overrides["train.grpo.gradient_checkpointing"] is True
    generation = overrides["train.grpo.generation_kwargs"]
    assert generation["disable_compile"] is False
    # the benchmark's longest prompt with its image is 374 tokens
    assert generation["max_cache_len"] >= 374 + overrides["train.grpo.max_completion_length"]

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = params
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    train = Params(params).train
    config = build_grpo_config(train.grpo, output_dir=Path("/tmp/x"), save_steps=50,
                               reward_weights=[1.0], model_settings=ModelParams(name="x"))
    assert generation_rows(train.max_generation_rows, config) == 32  # the generation in one call
    assert config.generation_batch_size == 2 * 16  # one generation for two optimizer steps


def test_benchmark_keeps_other_models_apart(gspo_step) -> None:
    """Runs on another model (the 8B shape's memory check) get their own keys and summary, so
    they never overwrite or mix with the 2B-shaped configurations the targets are judged on."""
    def run(config: str, model: str, seconds: float) -> dict:
        return {"config": config, "completion_length": 1024, "model": model,
                "seconds_per_step": seconds, "peak_allocated_gib": 1.0}

    big = "embedded:qwen3-vl-8b-shape"
    runs = {gspo_step.result_key("gpu_profile_bf16", 1024): run("gpu_profile_bf16",
                                                                gspo_step.MODEL, 11.0),
            gspo_step.result_key("gpu_profile_bf16", 1024, big): run("gpu_profile_bf16", big, 21.0)}
    assert len(runs) == 2
    assert gspo_step.result_key("gpu_profile_bf16", 1024) == "gpu_profile_bf16@1024"
    assert [e["seconds_per_step"] for e in gspo_step.summarize(runs)["gpu_profile_bf16"]] == [11.0]
    assert [e["seconds_per_step"]
            for e in gspo_step.summarize(runs, big)["gpu_profile_bf16"]] == [21.0]


def test_use_vllm_without_vllm_names_the_param() -> None:
    if vllm_installed():
        pytest.skip("vllm is installed here")
    with pytest.raises(ParamsError, match=r"train\.grpo\.use_vllm.*vllm is not installed"):
        build_grpo_config({"use_vllm": True, "vllm_mode": "colocate"}, output_dir=Path("/tmp/x"),
                          save_steps=50, reward_weights=[1.0],
                          model_settings=ModelParams(name="x"))


def test_use_vllm_colocate_reaches_grpo_config(monkeypatch) -> None:
    """Where vllm is installed the switches pass through to TRL as they are (vllm itself is
    faked as present: it cannot be installed here; TRL imports it only in the trainer)."""
    import vlmrl.training.gspo

    monkeypatch.setattr(vlmrl.training.gspo, "vllm_installed", lambda: True)
    config = build_grpo_config({"use_vllm": True, "vllm_mode": "colocate",
                                "vllm_gpu_memory_utilization": 0.3},
                               output_dir=Path("/tmp/x"), save_steps=50, reward_weights=[1.0],
                               model_settings=ModelParams(name="x"))
    assert (config.use_vllm, config.vllm_mode, config.vllm_gpu_memory_utilization) == (
        True, "colocate", 0.3)


def test_benchmark_vllm_profile_is_skipped_without_vllm(gspo_step, tmp_path) -> None:
    """The vLLM candidate is the profile's settings plus TRL's colocate switches; where vllm is
    missing (the offline test GPU, this machine) the run is recorded as skipped, not failed."""
    if vllm_installed():
        pytest.skip("vllm is installed here")
    knobs = gspo_step.CONFIGS["gpu_profile_vllm"]
    assert knobs["per_device_train_batch_size"] * knobs["gradient_accumulation_steps"] == 16
    assert set(gspo_step.VLLM_SETTINGS) <= set(__import__("trl").GRPOConfig.__dataclass_fields__)
    result = gspo_step.worker("gpu_profile_vllm", 256, 1, 1, tmp_path, gspo_step.MODEL, 0)
    assert result == {"config": "gpu_profile_vllm", "completion_length": 256,
                      "error": "skipped: vllm is not installed"}


@pytest.mark.slow
def test_same_params_same_train_log(fresh_repo: Path) -> None:
    """Two runs of train_gspo with the same params on the same CPU, in separate
    processes, write the same train log and metrics. The LoRA init is seeded before PEFT draws
    lora_A, and wall-clock figures live in the timings file, not in the log."""
    # A fresh LoRA on the random model with a reward its samples differ in, so the gradient is
    # not zero and lora_A's init matters (the SFT is a pass-through here).
    update_params(fresh_repo, {"sft.enabled": False, "train.grpo.max_steps": 2,
                               "train.resume": False,
                               "rewards.weights": {"format_reward": 0.3, "correctness_reward": 1.0,
                                                   "length_penalty": 1.0}})
    dvc_repro(fresh_repo, "sft_cold_start")
    outputs = []
    for _ in range(2):
        run(stage_command("train_gspo"), fresh_repo)
        outputs.append((read_log(fresh_repo / "data/metrics/train_log.json"),
                        json.loads((fresh_repo / "data/metrics/train.json").read_text())))
    (first_log, first_summary), (second_log, second_summary) = outputs
    assert [row["step"] for row in first_log] == [1, 2]
    assert all(row["grad_norm"] > 0 for row in first_log), first_log
    assert first_log == second_log
    assert first_summary == second_summary


@pytest.mark.parametrize(("kernel", "cuda", "replaced"), [
    (None, False, True),         # no Triton: TRL has no kernel
    ("triton", False, True),     # a CUDA build of torch on a machine without a GPU
    ("triton", True, False),     # a GPU: TRL's kernel stays
])
def test_cpu_log_prob_fallback_where_the_kernel_cannot_run(monkeypatch, kernel, cuda,
                                                           replaced) -> None:
    import torch
    import trl.trainer.utils as trl_utils

    from vlmrl.training.trainer.logprob_fallback import TorchChunkedLogProb, kernel_cannot_run
    from vlmrl.training.trainer.mixins import log_prob_kernel_for_this_machine

    sentinel = object() if kernel else None
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", sentinel)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with log_prob_kernel_for_this_machine():
        assert trl_utils._ChunkedLogProbFunction is (TorchChunkedLogProb if replaced else sentinel)
    assert trl_utils._ChunkedLogProbFunction is sentinel  # only while the trainer trains
    assert kernel_cannot_run(TorchChunkedLogProb, cuda) is False  # in place: nothing to change


@pytest.mark.parametrize(("before", "enabled", "after"), [
    ({}, True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ({}, False, {}),
    # a user's own entries stay, and their own expandable_segments wins
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, True,
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True,
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
    # torch reads PYTORCH_ALLOC_CONF first where it is set: the entry goes there
    ({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"}, True,
     {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True"}),
])
def test_expandable_segments_go_to_the_allocator_environment(before, enabled, after) -> None:
    from vlmrl.distributed.launch import use_expandable_segments

    environ = dict(before)
    assert use_expandable_segments(enabled, environ) is (after != before)
    assert environ == after


def test_train_gspo_sets_the_allocator_before_torch(tmp_path: Path) -> None:
    """The stage script sets PYTORCH_CUDA_ALLOC_CONF before anything imports torch (the
    allocator reads it when CUDA initialises), only where train.expandable_segments asks; the
    probe stops the script where it would decide how many processes train."""
    import os
    import subprocess
    import sys

    import yaml
    from conftest import ROOT

    probe = ("import os, runpy, sys\n"
             "import vlmrl.distributed.launch\n"
             "def stop(*args, **kwargs):\n"
             "    print('torch' in sys.modules, os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
             "    raise SystemExit(0)\n"
             "vlmrl.distributed.launch.training_plan = stop\n"
             "sys.argv[0] = 'train_gspo.py'\n"
             f"runpy.run_path({str(ROOT / 'stages' / 'train_gspo.py')!r}, run_name='__main__')\n")
    flags = [part for name in ("train-set", "out", "checkpoints", "metrics", "details", "log",
                               "completions", "samples", "curves", "timings")
             for part in (f"--{name}", str(tmp_path / "outputs" / name))]
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for enabled, expected in ((True, "False expandable_segments:True"), (False, "False None")):
        raw["train"]["expandable_segments"] = enabled
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump(raw))
        result = subprocess.run([sys.executable, "-c", probe, *flags, "--params", str(params)],
                                cwd=tmp_path, env=env, capture_output=True, text=True,
                                check=False, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == expected


def test_train_params_take_expandable_segments_as_a_switch() -> None:
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}
    section = {"save_steps": 2, "lora": lora}
    assert TrainParams.from_params({**section}).expandable_segments is True
    assert TrainParams.from_params({**section, "expandable_segments": False}
                                   ).expandable_segments is False
    with pytest.raises(ParamsError, match="expandable_segments"):
        TrainParams.from_params({**section, "expandable_segments": "sometimes"})


def test_graph_decoding_needs_the_transformers_backend() -> None:
    """Unsloth loads its own model classes, which graph decoding cannot route: one line before
    anything loads instead of a TypeError from the rollout package."""
    from vlmrl.params import ParamsError
    from vlmrl.training.gspo import check_graph_backend

    check_graph_backend("eager", "unsloth")
    check_graph_backend("graph", "transformers")
    with pytest.raises(ParamsError, match=r"^params\.yaml train\.graph_decoding: merged needs "
                                          r"model\.backend transformers, not unsloth"):
        check_graph_backend("merged", "unsloth")


@pytest.mark.parametrize(("setting", "message"), [
    ({"training_attention": "rolled"},
     r"train\.training_attention: rolled needs model\.backend transformers, not unsloth"),
    ({"compile_layers": True},
     r"train\.compile_layers: true needs model\.backend transformers, not unsloth"),
    ({"keep_image_features": True},
     r"train\.keep_image_features: true needs model\.backend transformers, not unsloth"),
])
def test_training_switches_need_the_transformers_backend(setting: dict, message: str) -> None:
    import yaml
    from conftest import ROOT

    from vlmrl.training.gspo import check_training_switches

    section = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    check_training_switches(TrainParams.from_params(section), "unsloth")
    switched = TrainParams.from_params({**section, **setting})
    check_training_switches(switched, "transformers")
    with pytest.raises(ParamsError, match=r"^params\.yaml " + message):
        check_training_switches(switched, "unsloth")


def test_train_sets_the_allocator_before_building_the_config(tmp_path: Path, monkeypatch) -> None:
    """`train()` called in process (benchmarks, probes) sets PYTORCH_CUDA_ALLOC_CONF before the
    GRPO config is built: TrainingArguments picks the device there, which initialises CUDA, and
    the allocator reads the variable then."""
    import os

    import yaml
    from conftest import ROOT

    from vlmrl.params import Params
    from vlmrl.training import gspo as training

    seen: list[str | None] = []

    class Built(Exception):
        pass

    def config_probe(*args, **kwargs):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise Built

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(training, "build_grpo_config", config_probe)
    train_set = tmp_path / "train"
    train_set.mkdir()
    (train_set / "dataset_info.json").write_text("{}")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["train"]["expandable_segments"] = True
    params = Params(raw)
    with pytest.raises(Built):
        training.train(train_set=train_set, params=params, adapter_out=tmp_path / "adapter",
                       checkpoints=tmp_path / "checkpoints")
    assert seen == ["expandable_segments:True"]
