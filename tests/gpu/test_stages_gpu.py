"""The real stage scripts on a random-init model with Qwen3-VL-2B's shapes, on a GPU, with each
training backend: Unsloth 4-bit, transformers bf16 and transformers + bitsandbytes 4-bit.

No DVC and no hub: each configuration gets a temporary copy of the project (stages/, src/,
dvc.yaml, params.yaml with the overrides below), and every stage runs as `dvc repro` would run
it: the `cmd` of dvc.yaml with its `${paths.*}` filled in, `python stages/<stage>.py ...` in the
copy's root. The model (`embedded:qwen3-vl-2b-shape`, built once on the GPU through
vlmrl.models.embedded, the same builder as the tiny default) is shared through $VLMRL_CACHE.

Order matters and is kept by pytest's file order: `test_train_gspo` runs for every configuration
first (the priority), then `test_downstream` runs baseline_eval, post_eval, verify_lora, export and
upload on each trained copy. Stage logs go to $VLMRL_GPU_LOGS (default: a temporary directory).

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
}
# Small enough for minutes per configuration; every stage still does its real work.
SMALL = {
    "model.name": MODEL,
    "model.dtype": "auto",
    "data.synthetic_size": 24,
    "data.eval_size": 4,
    "data.image_size": 512,
    "eval.max_new_tokens": 16,
    "eval.batch_size": 4,
    "train.save_steps": 2,
    "train.lora.r": 16,
    "train.lora.alpha": 16,
    "train.grpo.max_steps": 4,
    "train.grpo.per_device_train_batch_size": 4,
    "train.grpo.gradient_accumulation_steps": 1,
    "train.grpo.steps_per_generation": 2,
    "train.grpo.num_generations": 4,
    # 32 tokens, as in params.yaml: about half the completions pass length_penalty's 150
    # characters, so groups have reward variance and the adapter really moves (verify_lora).
    "train.grpo.max_completion_length": 32,
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


def stage_exists(repo: Path, command: str) -> bool:
    script = next((part for part in command.split() if part.startswith("stages/")), None)
    return script is not None and (repo / script).is_file()


def run_stage(repo: Path, name: str, tag: str) -> subprocess.CompletedProcess:
    command = stage_commands(repo)[name]
    if not stage_exists(repo, command):
        pytest.skip(f"{name}: {command.split()[1]} does not exist yet")
    argv = [sys.executable, *command.split()[1:]]  # `python` -> this interpreter
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(repo / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
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
    return json.loads(path.read_text())


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
    repo = copies[config]
    run_stage(repo, "train_gspo", config)
    summary = read_json(repo / "data/metrics/train.json")
    assert summary["steps"] == SMALL["train.grpo.max_steps"]
    adapter = repo / "data/models/adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    adapter_config = read_json(adapter / "adapter_config.json")
    assert adapter_config["r"] == SMALL["train.lora.r"]
    rows = [json.loads(line) for line in
            (repo / "data/metrics/train_log.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows if "loss" in row][-1] == SMALL["train.grpo.max_steps"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_downstream(copies, config):
    """baseline_eval, post_eval, verify_lora, export (Unsloth's merged 16-bit save on the Unsloth
    path, transformers' merge otherwise; GGUF on both) and upload (local manifest only)."""
    repo = copies[config]
    if not (repo / "data/models/adapter/adapter_config.json").is_file():
        pytest.skip("train_gspo did not produce an adapter for this configuration")
    stages = selected_stages(os.environ.get("VLMRL_GPU_DOWNSTREAM"), repo)
    for stage in stages:
        run_stage(repo, stage, config)
    metrics = repo / "data/metrics"
    if "post_eval" in stages:
        post = read_json(metrics / "post_eval.json")
        assert post["n"] == SMALL["data.eval_size"]
    if "verify_lora" in stages and (metrics / "verify_lora.json").is_file():
        assert read_json(metrics / "verify_lora.json")
    if "export" in stages and (metrics / "export.json").is_file():
        merged = repo / "data/models/merged"
        assert (merged / "config.json").is_file()
        assert list(merged.glob("*.safetensors"))
        ggufs = sorted(p.name for p in (repo / "data/models/gguf").glob("*.gguf"))
        assert any(name.startswith("model-f16") for name in ggufs), ggufs
        assert any(name.startswith("mmproj") for name in ggufs), ggufs
