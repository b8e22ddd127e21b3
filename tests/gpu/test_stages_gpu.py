"""The real stage scripts on a random-init model with Qwen3-VL-2B's shapes, on a GPU, with each
training backend: Unsloth 4-bit, transformers bf16 and transformers + bitsandbytes 4-bit.

No DVC and no hub: each configuration gets a temporary copy of the project (stages/, src/,
dvc.yaml, params.yaml with the overrides below), and every stage runs as `dvc repro` would run
it: the `cmd` of dvc.yaml with its `${paths.*}` filled in, `python stages/<stage>.py ...` in the
copy's root. The model (`embedded:qwen3-vl-2b-shape`, built once on the GPU through
vlmrl.models.embedded, the same builder as the tiny default) is shared through $VLMRL_CACHE.

Order matters and is kept by pytest's file order: `test_train_gspo` runs sft_cold_start and then
train_gspo for every configuration first (the priority), then `test_downstream` runs
baseline_eval, post_eval, verify_lora, export and upload on each trained copy. Stage logs go to
$VLMRL_GPU_LOGS (default: a temporary directory).

Training must act, not only run: every optimizer step has grad_norm > 0, the clip
ratio of every off-policy step is strictly between 0 and 1, and every `lora_B` of the trained
adapter is non-zero and differs from the cold-start adapter it continued.

Run on the device machine with tests/gpu/run_on_device.sh (see tests/gpu/README.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("VLMRL_GPU_TEST_MODEL", "embedded:qwen3-vl-2b-shape")
STAGE_TIMEOUT_S = int(os.environ.get("VLMRL_GPU_STAGE_TIMEOUT", "900"))

CONFIGS = {
    "unsloth-4bit": {"model.backend": "unsloth", "model.load_in_4bit": True},
    "transformers-bf16": {"model.backend": "transformers", "model.load_in_4bit": False},
    "transformers-4bit": {"model.backend": "transformers", "model.load_in_4bit": True},
    # rollouts with the decode step in one CUDA graph; training only (test_downstream
    # does not depend on how the rollouts were generated)
    "transformers-bf16-graph": {"model.backend": "transformers", "model.load_in_4bit": False,
                                "train.graph_decoding": "merged"},
    "transformers-4bit-graph": {"model.backend": "transformers", "model.load_in_4bit": True,
                                "train.graph_decoding": "graph",
                                "train.grpo.generation_kwargs.disable_compile": False},
}
# the fastest profile: the graph profile over a float8 cache (vlmrl.training.rollout.decode_attention)
CONFIGS["transformers-4bit-graph-fp8"] = {**CONFIGS["transformers-4bit-graph"],
                                          "train.kv_cache_dtype": "fp8"}
# the recipes' profile: the float8 cache, and the text decoder layers compiled for training
# (vlmrl.training.trainer.compiled_layers)
CONFIGS["transformers-4bit-graph-fp8-compiled"] = {**CONFIGS["transformers-4bit-graph-fp8"],
                                                   "train.compile_layers": True}
# the same with the training forward's rows rolled (vlmrl.training.trainer.attention), traced whole in the
# compiled layers
CONFIGS["transformers-4bit-graph-fp8-rolled-compiled"] = {
    **CONFIGS["transformers-4bit-graph-fp8-compiled"], "train.training_attention": "rolled"}
# the recipes' profile with each image through the vision tower once a generation
# (vlmrl.models.image_features); named apart, so that `-k fp8-rolled-compiled` runs the recipes'
CONFIGS["transformers-4bit-graph-fp8-kept-images"] = {
    **CONFIGS["transformers-4bit-graph-fp8-rolled-compiled"], "train.keep_image_features": True}
# the same with the compiled layers' NF4 projections in their graphs (vlmrl.training.trainer.nf4_linear)
CONFIGS["transformers-4bit-graph-fp8-nf4-linears"] = {
    **CONFIGS["transformers-4bit-graph-fp8-rolled-compiled"], "train.nf4_linears": True}
DOWNSTREAM_CONFIGS = [name for name in CONFIGS if "-graph" not in name]
# The cold start is the shipped one (params.yaml sft.args: 40 steps, cosine decay from 2e-3) at
# batch 8. On an H100 (transformers bf16) it took the SFT loss from 12.2 to 0.18, and GSPO's first
# generation then had a format reward of 1.59, no group with reward std 0 and grad norms of 0.38
# and 0.50. 12 steps at a constant 2e-3 are not enough once the reasoning block is one fixed
# sentence (sft.reasoning): on two GPUs, with one process and with two, every completion
# repeated "I read the image.</REASONING>" to the 32-token limit, and every reward was 0.
SFT = {
    "sft.enabled": True,
    "sft.args.max_steps": 40,
    "sft.args.learning_rate": 2.0e-3,
    "sft.args.lr_scheduler_type": "cosine",
    "sft.args.per_device_train_batch_size": 8,
    "sft.args.seed": 42,
}
# 2 prompts x 8 generations per optimizer step; one generation serves two steps
# (steps_per_generation 2 > gradient_accumulation_steps 1), so step 2 is off-policy. One
# generation only: on this random model one update at lr 5e-4 moves a sequence's log-likelihood
# by 1-4 nats, so step 2 clips exactly the negative-advantage rows (0.56-0.69 in 5 of 5
# runs, whatever the epsilon pair from 3e-4 to 0.2), and the next generation lost the format in
# 3 of 5 runs (every reward 0, grad_norm 0).
GSPO = {
    "train.grpo.max_steps": 2,
    "train.grpo.per_device_train_batch_size": 16,
    "train.grpo.gradient_accumulation_steps": 1,
    "train.grpo.steps_per_generation": 2,
    "train.grpo.num_iterations": 1,
    "train.grpo.num_generations": 8,
    "train.grpo.max_completion_length": 32,  # the SFT format is 22-30 tokens with <|im_end|>
    "train.grpo.temperature": 0.7,
    "train.grpo.top_p": 0.8,  # as measured on the device; the CPU default has no top-p cut
    "train.grpo.importance_sampling_level": "sequence",
    "train.grpo.learning_rate": 5.0e-4,
    "train.grpo.lr_scheduler_type": "constant",
    "train.grpo.epsilon": 3.0e-3,
    "train.grpo.epsilon_high": 4.0e-3,
    "train.grpo.beta": 0.0,
    "train.grpo.seed": 42,
}
# Small enough for minutes per configuration; every stage still does its real work.
SMALL = {
    "model.name": MODEL,
    "model.dtype": "auto",
    "data.synthetic_size": 24,
    "data.synthetic_read_size": 40,  # the set these settings were measured on
    "data.eval_size": 4,
    "data.image_size": 512,
    "rewards.weights": {"format_reward": 1.0, "correctness_reward": 1.0},
    "eval.max_new_tokens": 32,
    "eval.batch_size": 4,
    "eval.temperature": 0.7,
    "eval.top_p": 0.8,
    "train.save_steps": 2,
    "train.lora.r": 16,
    "train.lora.alpha": 16,
    **SFT,
    **GSPO,
    "export.gguf_outtypes": ["f16"],
    "export.quantize": [],
    "upload.bucket": "",
}
DOWNSTREAM = ("baseline_eval", "post_eval", "verify_lora", "export", "upload")

_ORDER = {name: i for i, name in enumerate(CONFIGS)}


# ------------------------------------------------------------------ helpers

def log_dir() -> Path:
    path = Path(os.environ.get("VLMRL_GPU_LOGS") or Path(os.environ.get("TMPDIR", "/tmp"))
                / "vlmrl-gpu-logs")
    path.mkdir(parents=True, exist_ok=True)
    return path


def set_params(params: dict, dotted: str, value) -> None:
    node = params
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def make_copy(target: Path, overrides: dict) -> Path:
    """The project's pipeline files in `target`, params.yaml overridden; no git, no DVC."""
    target.mkdir(parents=True)
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, target / name)
    for name in ("stages", "src"):
        shutil.copytree(ROOT / name, target / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    params = yaml.safe_load((target / "params.yaml").read_text())
    for dotted, value in overrides.items():
        set_params(params, dotted, value)
    (target / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (target / "data").mkdir()
    return target


def stage_commands(repo: Path) -> dict[str, str]:
    """dvc.yaml's stage commands with `${paths.*}` substituted, as DVC runs them."""
    dvc = yaml.safe_load((repo / "dvc.yaml").read_text())
    variables: dict[str, str] = {}
    for entry in dvc.get("vars", []):
        if isinstance(entry, dict):
            for group, values in entry.items():
                for key, value in (values or {}).items():
                    variables[f"{group}.{key}"] = str(value)

    def fill(match: re.Match) -> str:
        return variables[match.group(1)]

    return {name: re.sub(r"\$\{([\w.]+)\}", fill, stage["cmd"])
            for name, stage in dvc["stages"].items()}


def run_stage(repo: Path, name: str, tag: str,
              python_path: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """dvc.yaml's command of stage `name` in `repo`; `python_path`: more PYTHONPATH entries."""
    command = stage_commands(repo)[name]
    argv = [sys.executable, *command.split()[1:]]  # `python` -> this interpreter
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*python_path, str(repo / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    result = subprocess.run(argv, cwd=repo, env=env, text=True, capture_output=True,
                            timeout=STAGE_TIMEOUT_S, check=False)
    seconds = time.perf_counter() - started
    log = log_dir() / f"{tag}-{name}.log"
    log.write_text(f"$ {' '.join(argv)}\n# rc={result.returncode} {seconds:.1f} s\n"
                   f"{result.stdout}\n--- stderr ---\n{result.stderr}")
    print(f"{tag} {name}: rc={result.returncode} in {seconds:.1f} s (log {log})")
    with (log_dir() / "timings.jsonl").open("a") as handle:
        handle.write(json.dumps({"config": tag, "stage": name, "rc": result.returncode,
                                 "seconds": round(seconds, 1)}) + "\n")
    if result.returncode != 0:
        pytest.fail(f"{tag}: stage {name} failed (rc {result.returncode}, {seconds:.0f} s):\n"
                    f"{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def selected_stages(selection: str | None, repo: Path) -> list[str]:
    """DOWNSTREAM, or the stages named in `selection` plus baseline_eval where post_eval is
    named and the baseline's records are missing (post_eval compares against them)."""
    if not selection:
        return list(DOWNSTREAM)
    names = set(selection.split(","))
    unknown = names - set(DOWNSTREAM)
    if unknown:
        raise ValueError(f"VLMRL_GPU_DOWNSTREAM names {sorted(unknown)}; known: {DOWNSTREAM}")
    if "post_eval" in names and not (repo / "data/eval/baseline/records.jsonl").is_file():
        names.add("baseline_eval")
    return [stage for stage in DOWNSTREAM if stage in names]


def read_json(path: Path) -> dict:
    assert path.is_file(), f"{path} is missing"
    return json.loads(path.read_text())


def optimizer_steps(repo: Path) -> list[dict]:
    """The train log's rows of optimizer steps (TRL logs `loss` on each), in order."""
    return [row for row in read_json(repo / "data/metrics/train_log.json") if "loss" in row]


def off_policy_steps(max_steps: int, accumulation: int, steps_per_generation: int) -> list[int]:
    """Optimizer steps (from 1) that start on a generation made before an earlier update: TRL
    generates once every `steps_per_generation` micro-batches, and `accumulation` micro-batches
    make one optimizer step. TRL logs clip ratio 0 on the other (on-policy) steps."""
    return [step for step in range(1, max_steps + 1)
            if (step - 1) * accumulation % steps_per_generation != 0]


def lora_b_tensors(adapter: Path) -> dict:
    from safetensors.torch import load_file

    weights = adapter / "adapter_model.safetensors"
    assert weights.is_file(), f"{weights} is missing"
    found = {name: tensor for name, tensor in load_file(str(weights)).items() if "lora_B" in name}
    assert found, f"{weights} holds no lora_B tensor"
    return found


def print_steps(tag: str, rows: list[dict]) -> None:
    keys = ("reward", "reward_std", "frac_reward_zero_std", "grad_norm",
            "clip_ratio_region_mean", "clip_ratio_low_mean", "clip_ratio_high_mean",
            "completions_mean_length")
    for row in rows:
        print(f"{tag} step {row['step']}: " + ", ".join(
            f"{key} {row[key]:.4g}" for key in keys if isinstance(row.get(key), (int, float))))


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def gpu_cache(tmp_path_factory) -> Path:
    """$VLMRL_CACHE with the 2B-shaped model built once, on the GPU (seconds instead of minutes
    of random init on the CPU)."""
    import torch

    from vlmrl.models.embedded import ensure_embedded_model

    cache = Path(os.environ.get("VLMRL_CACHE") or tmp_path_factory.mktemp("vlmrl-cache"))
    os.environ["VLMRL_CACHE"] = str(cache)
    started = time.perf_counter()
    path = ensure_embedded_model(MODEL, seed=0,
                                 device="cuda" if torch.cuda.is_available() else "cpu")
    print(f"model {path} ready in {time.perf_counter() - started:.0f} s")
    return cache


@pytest.fixture(scope="session")
def copies(tmp_path_factory, gpu_cache) -> dict[str, Path]:
    """One project copy per configuration, with the data prepared once and shared."""
    root = tmp_path_factory.mktemp("gpu-stages")
    made: dict[str, Path] = {}
    first = None
    for name, overrides in CONFIGS.items():
        repo = make_copy(root / name, {**SMALL, **overrides})
        if first is None:
            run_stage(repo, "prepare_data", name)
            first = repo
        else:
            shutil.copytree(first / "data", repo / "data", dirs_exist_ok=True)
        made[name] = repo
    return made


# ------------------------------------------------------------------ tests

def test_model_has_qwen3_vl_2b_shapes(gpu_cache):
    from transformers import AutoConfig

    from vlmrl.models.embedded import ensure_embedded_model

    config = AutoConfig.from_pretrained(ensure_embedded_model(MODEL, seed=0))
    if MODEL != "embedded:qwen3-vl-2b-shape":
        pytest.skip(f"VLMRL_GPU_TEST_MODEL={MODEL}")
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.head_dim, text.intermediate_size) == (
        2048, 28, 16, 8, 128, 6144)
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size,
            list(vision.deepstack_visual_indexes)) == (24, 1024, 2048, [5, 11, 17])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_train_gspo(copies, config):
    """sft_cold_start, then train_gspo continuing its adapter; GSPO must act on every step."""
    import torch

    repo = copies[config]
    run_stage(repo, "sft_cold_start", config)
    assert read_json(repo / "data/models/sft/vlmrl_sft.json")["adapter"] is True
    run_stage(repo, "train_gspo", config)
    max_steps = GSPO["train.grpo.max_steps"]
    assert read_json(repo / "data/metrics/train.json")["steps"] == max_steps
    adapter = repo / "data/models/adapter"
    assert read_json(adapter / "adapter_config.json")["r"] == SMALL["train.lora.r"]

    rows = optimizer_steps(repo)
    print_steps(config, rows)
    assert [row["step"] for row in rows] == list(range(1, max_steps + 1))
    grad_norms = {row["step"]: row.get("grad_norm") for row in rows}
    assert all(isinstance(g, float) and g > 0 for g in grad_norms.values()), (
        f"every optimizer step must have grad_norm > 0: {grad_norms}")
    off_policy = off_policy_steps(max_steps, GSPO["train.grpo.gradient_accumulation_steps"],
                                  GSPO["train.grpo.steps_per_generation"])
    assert off_policy == [2]
    clips = {row["step"]: row.get("clip_ratio_region_mean") for row in rows
             if row["step"] in off_policy}
    assert all(isinstance(c, float) and 0 < c < 1 for c in clips.values()), (
        f"the clip ratio of every off-policy step must be strictly in (0, 1): {clips}")

    start, trained = lora_b_tensors(repo / "data/models/sft"), lora_b_tensors(adapter)
    assert trained.keys() == start.keys()
    zero = sorted(name for name, tensor in trained.items() if not tensor.any())
    unchanged = sorted(name for name, tensor in trained.items()
                       if torch.equal(tensor, start[name]))
    assert not zero, f"{len(zero)} of {len(trained)} lora_B tensors are all zero: {zero[:3]}"
    assert not unchanged, (f"{len(unchanged)} of {len(trained)} lora_B tensors equal the "
                           f"cold-start adapter's: {unchanged[:3]}")


@pytest.mark.parametrize("config", DOWNSTREAM_CONFIGS)
def test_downstream(copies, config):
    """baseline_eval, post_eval, verify_lora, export (Unsloth's merged 16-bit save on the Unsloth
    path, transformers' merge otherwise; GGUF on both) and upload (local manifest only); or the
    stages VLMRL_GPU_DOWNSTREAM names. Each selected stage must leave its outputs."""
    repo = copies[config]
    assert (repo / "data/models/adapter/adapter_config.json").is_file(), (
        f"no trained adapter for {config}: run test_train_gspo[{config}] in the same session "
        f"(pytest -k {config})")
    stages = selected_stages(os.environ.get("VLMRL_GPU_DOWNSTREAM"), repo)
    for stage in stages:
        run_stage(repo, stage, config)
    metrics = repo / "data/metrics"
    for stage in {"baseline_eval", "post_eval"} & set(stages):
        assert read_json(metrics / f"{stage}.json")["n"] == SMALL["data.eval_size"]
    if "verify_lora" in stages:
        assert read_json(metrics / "verify_lora.json")["checks_failed"] == 0
    if "export" in stages:
        assert read_json(metrics / "export.json")
        merged = repo / "data/models/merged"
        assert (merged / "config.json").is_file()
        assert list(merged.glob("*.safetensors"))
        ggufs = sorted(p.name for p in (repo / "data/models/gguf").glob("*.gguf"))
        assert any(name.startswith("model-f16") for name in ggufs), ggufs
        assert any(name.startswith("mmproj") for name in ggufs), ggufs
    if "upload" in stages:
        assert read_json(metrics / "upload.json")
        assert read_json(repo / "data/reports/upload_manifest.json")
