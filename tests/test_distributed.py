"""train_gspo and the evaluations on several processes through `accelerate launch`, on
the CPU (gloo): one DVC command either way, rank 0 alone writes to data/, the global batch is what
params say, the processes train on different rows, a killed run resumes with the same number of
processes, and a 2-process evaluation gives the very records of one process."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    ROOT,
    TEST_PARAMS,
    dvc_env,
    dvc_repro,
    kill_repro_when,
    make_project_repo,
    run,
    stage_command,
)

from vlmrl.distributed.launch import (
    ACCELERATE_CONFIGS,
    NO_MULTICAST_ENV,
    DistributedParams,
    Launch,
    distributed_settings,
    evaluation_launch,
    evaluation_plan,
    evaluation_processes,
    launch_command,
    resolve,
    training_launch,
    training_plan,
    visible_gpus,
    worker_env,
)
from vlmrl.distributed.nodes import Nodes
from vlmrl.distributed.settings import machines
from vlmrl.params import ModelParams, ParamsError, TrainParams
from vlmrl.training.gspo import rows_report, split_batch

AUDIT_SITE = Path(__file__).parent / "write_audit"
TWO_PROCESSES = {"train.distributed.num_processes": 2, "train.distributed.strategy": "ddp"}


# ------------------------------------------------------------------ unit


def train_params(**distributed) -> TrainParams:
    return TrainParams.from_params({"save_steps": 2, "distributed": distributed,
                                    "lora": {"r": 8, "alpha": 16, "dropout": 0.0,
                                             "target_modules": ["q_proj"]}})


def settings(**distributed) -> DistributedParams:
    return distributed_settings(train_params(**distributed))


def test_the_four_strategies_have_checked_in_configs() -> None:
    for strategy in ("ddp", "zero2", "zero3", "fsdp"):
        launch = training_launch(settings(strategy=strategy, num_processes=2), "bf16")
        config = yaml.safe_load(launch.config_file.read_text())
        assert launch.config_file.parent == ACCELERATE_CONFIGS
        assert config["compute_environment"] == "LOCAL_MACHINE"
        assert launch.num_processes == 2 and launch.mixed_precision == "bf16"


def test_strategy_none_runs_in_this_process() -> None:
    assert training_launch(settings(strategy="none"), "no") is None
    assert evaluation_launch(1) is None
    assert evaluation_launch(3).config_file.name == "ddp.yaml"


def test_several_processes_need_a_strategy() -> None:
    with pytest.raises(ParamsError, match=r"train\.distributed: num_processes 2 needs a strategy"):
        settings(num_processes=2, strategy="none")
    with pytest.raises(ParamsError, match=r"train\.distributed\.strategy: 'ddp2' is not one of"):
        DistributedParams.from_params({"strategy": "ddp2"})


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "mine.yaml"
    with pytest.raises(ParamsError, match=r"train\.distributed\.config_file: .*mine\.yaml"):
        training_launch(settings(strategy="ddp", config_file=str(missing)), "no")


def test_launch_command_and_environment() -> None:
    launch = Launch(ACCELERATE_CONFIGS / "ddp.yaml", 4, "bf16")
    command = launch_command(launch, "stages/train_gspo.py", ["--out", "x"])
    assert command[1:3] == ["-m", "accelerate.commands.launch"]
    flags = dict(zip(command[3:-3:2], command[4:-3:2], strict=True))
    assert flags == {"--config_file": str(ACCELERATE_CONFIGS / "ddp.yaml"), "--num_processes": "4",
                     "--num_machines": "1", "--mixed_precision": "bf16",
                     "--main_process_port": "0"}
    assert command[-3:] == ["stages/train_gspo.py", "--out", "x"]
    env = worker_env()
    assert {key: env[key] for key in NO_MULTICAST_ENV} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1"}
    assert env["VLMRL_LAUNCHED"] == "1"


MACHINE_VARIABLES = ("NNODES", "WORLD_SIZE", "NODE_RANK", "MACHINE_RANK", "MASTER_ADDR",
                     "MASTER_PORT")


def test_one_machine_is_the_default_and_ignores_the_node_variables() -> None:
    """`num_machines: 1` launches as it always has, whatever MASTER_* or NODE_RANK say."""
    defaults = DistributedParams.from_params({})
    assert (defaults.num_machines, defaults.machine_rank, defaults.main_process_ip,
            defaults.main_process_port, defaults.rdzv_timeout) == (1, 0, None, 29500, 600)
    found = machines(defaults, {"NODE_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"})
    assert not found.several_machines
    launch = training_launch(resolve(found, 0), "no")
    assert launch is None  # one process on a CPU, in this process, as before


def test_the_node_variables_set_the_machine_keys() -> None:
    params = DistributedParams.from_params({"num_machines": 2, "main_process_ip": "10.0.0.1"})
    assert machines(params, {}).nodes() == Nodes(2, 0, "10.0.0.1", 29500, 600.0)
    slurm = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "gpu-001", "MASTER_PORT": "29400",
             "WORLD_SIZE": "99"}  # NNODES first
    assert machines(DistributedParams.from_params({}), slurm).nodes() == Nodes(
        4, 3, "gpu-001", 29400, 600.0)
    kubeflow = {"WORLD_SIZE": "2", "MACHINE_RANK": "1", "MASTER_ADDR": "main"}
    assert machines(params, kubeflow).nodes() == Nodes(2, 1, "main", 29500, 600.0)


@pytest.mark.parametrize(("params", "environ", "message"), [
    ({}, {"NNODES": "two"}, ("environment variable NNODES (train.distributed.num_machines): "
                            "must be an integer >= 1, got 'two'")),
    ({}, {"NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "65535"},
     ("environment variable MASTER_PORT (train.distributed.main_process_port): must be an "
     "integer in [1, 65534], got '65535'")),
    ({}, {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"},
     ("params.yaml train.distributed.machine_rank 2 (NODE_RANK=2) must be below num_machines 2 "
     "(NNODES=2)")),
    ({"num_machines": 2}, {}, ("params.yaml train.distributed.main_process_ip is needed with "
                              "num_machines 2 (train.distributed.num_machines): the main "
                              "machine's address, or MASTER_ADDR")),
    ({"strategy": "none"}, {"NNODES": "2", "MASTER_ADDR": "h"},
     ("params.yaml train.distributed.strategy none runs one process on one machine; "
     "num_machines 2 (NNODES=2) needs auto, ddp, zero2, zero3 or fsdp")),
])
def test_bad_machine_settings_are_one_line_naming_the_key(params, environ, message) -> None:
    with pytest.raises(ParamsError) as raised:
        machines(DistributedParams.from_params(params), environ)
    assert str(raised.value) == message


def test_bad_machine_params_are_named() -> None:
    with pytest.raises(ParamsError, match=r"train\.distributed\.machine_rank: input should be "
                                          r"greater than or equal to 0"):
        DistributedParams.from_params({"machine_rank": -1})
    with pytest.raises(ParamsError, match=r"train\.distributed\.num_machines: must be a positive "
                                          r"integer, got 0"):
        DistributedParams.from_params({"num_machines": 0})


def test_processes_count_every_machine_and_divide_among_them() -> None:
    two = machines(DistributedParams.from_params({}), {"NNODES": "2", "MASTER_ADDR": "h"})
    assert [(r.strategy, r.num_processes) for r in (resolve(two, 0), resolve(two, 8))] == [
        ("ddp", 2), ("ddp", 16)]  # auto: one per machine on CPUs, one per GPU on each
    odd = two.model_copy(update={"num_processes": 3})
    with pytest.raises(ParamsError, match=r"num_processes \(3\) counts the processes of all 2 "
                                          r"machines and must divide among them"):
        resolve(odd, 0)
    many = two.model_copy(update={"num_processes": 16})
    with pytest.raises(ParamsError, match=r"num_processes \(16\) over 2 machines is 8 each, "
                                          r"more than the 4 GPUs visible here"):
        resolve(many, 4)


def test_launch_command_on_several_machines() -> None:
    settings = machines(DistributedParams.from_params({"rdzv_timeout": 90}),
                        {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                         "MASTER_PORT": "29400"})
    launch = training_launch(resolve(settings, 8), "bf16")
    command = launch_command(launch, "stages/train_gspo.py", ["--out", "x"])
    flags = dict(zip(command[3:-3:2], command[4:-3:2], strict=True))
    assert flags == {"--config_file": str(ACCELERATE_CONFIGS / "ddp.yaml"),
                     "--num_processes": "16", "--num_machines": "2", "--machine_rank": "1",
                     "--main_process_ip": "10.0.0.1", "--main_process_port": "29400",
                     "--rdzv_backend": "static", "--rdzv_conf": "timeout=90",
                     "--mixed_precision": "bf16"}
    assert command[-3:] == ["stages/train_gspo.py", "--out", "x"]


def test_unsloth_on_several_machines_is_refused(tmp_path: Path, monkeypatch,
                                                no_launch_env) -> None:
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", 2)["PATH"])
    for name, value in {"NNODES": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    unsloth = ModelParams(name="embedded:tiny-qwen3-vl", backend="unsloth")
    with pytest.raises(ParamsError, match=r"strategy ddp: Unsloth trains on one GPU"):
        training_plan(train_params(), unsloth, "train_gspo")


def test_the_global_batch_is_split_among_processes() -> None:
    grpo = {"per_device_train_batch_size": 32, "num_generations": 16}
    assert split_batch(grpo, 1) == grpo
    assert split_batch(grpo, 4) == {"per_device_train_batch_size": 8, "num_generations": 16}
    with pytest.raises(ParamsError, match=r"per_device_train_batch_size \(32\).*num_processes \(3\)"):
        split_batch(grpo, 3)


def test_micro_batches_are_merged_where_the_processes_outnumber_their_rows() -> None:
    """The 8B recipe's micro-batch of 4 on 8 processes: two accumulation steps become one
    micro-batch of 8, one row per process; the optimizer and generation batches stay 16 and 32."""
    grpo = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
            "steps_per_generation": 8, "num_generations": 4}
    assert split_batch(grpo, 4) == {**grpo, "per_device_train_batch_size": 1}
    split = split_batch(grpo, 8)
    assert split == {**grpo, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
                     "steps_per_generation": 4}
    rows = split["per_device_train_batch_size"] * 8
    assert rows * split["gradient_accumulation_steps"] == 4 * 4  # the optimizer batch
    assert rows * split["steps_per_generation"] == 4 * 8  # the generation batch
    with pytest.raises(ParamsError, match=r"gradient_accumulation_steps and "
                                          r"steps_per_generation by 2"):
        split_batch({**grpo, "gradient_accumulation_steps": 3}, 8)


def test_rows_report_counts_prompts_two_processes_share() -> None:
    report = rows_report([["a", "a", "b", "b"], ["b", "b", "c", "c"]])
    assert report == {"rows_per_process": [4, 4], "prompts_per_process": [2, 2],
                      "prompts_in_several_processes": 1}


def fake_nvidia_smi(folder: Path, gpus: int, path: str | None = None) -> dict[str, str]:
    """A PATH (before `path`, default this process's) that finds an `nvidia-smi` listing `gpus`
    GPUs (for `-L` only, as the real one prints them; anything else fails): the GPU count of a
    host this one is not. The processes still run on the CPU (torch finds no CUDA)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})'\n"
                    for i in range(gpus))
    script.write_text(f'#!/bin/sh\n[ "$1" = "-L" ] || exit 9\n{lines}')
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{path or os.environ['PATH']}"}


@pytest.fixture
def no_launch_env(monkeypatch) -> None:
    """This process as a stage's own (no torchrun variables), with no GPU narrowing set. Each
    variable is set before it is removed, so that monkeypatch restores its absence even where
    the code under test sets it (keep_one_gpu sets CUDA_VISIBLE_DEVICES in this process)."""
    for name in ("RANK", "LOCAL_RANK", "VLMRL_LAUNCHED", "CUDA_VISIBLE_DEVICES",
                 *MACHINE_VARIABLES):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_auto_is_one_process_per_gpu_where_there_are_several() -> None:
    auto = DistributedParams.from_params({})
    assert (auto.strategy, auto.num_processes, auto.multi_gpu_strategy) == ("auto", "auto", "ddp")
    resolved = {gpus: resolve(auto, gpus) for gpus in (0, 1, 2, 8)}
    assert {gpus: (r.strategy, r.num_processes) for gpus, r in resolved.items()} == {
        0: ("none", 1), 1: ("none", 1), 2: ("ddp", 2), 8: ("ddp", 8)}
    sharded = DistributedParams.from_params({"multi_gpu_strategy": "fsdp"})
    assert (resolve(sharded, 2).strategy, resolve(sharded, 1).strategy) == ("fsdp", "none")
    # an explicit count picks the strategy without GPUs: the CPU's gloo processes
    two = DistributedParams.from_params({"num_processes": 2})
    assert (resolve(two, 0).strategy, resolve(two, 0).num_processes) == ("ddp", 2)
    # none and an explicit strategy: one process, or one per GPU
    none = DistributedParams.from_params({"strategy": "none"})
    assert (resolve(none, 4).strategy, resolve(none, 4).num_processes) == ("none", 1)
    ddp = DistributedParams.from_params({"strategy": "ddp"})
    assert [resolve(ddp, gpus).num_processes for gpus in (0, 1, 4)] == [1, 1, 4]


def test_a_launched_worker_takes_its_world_size() -> None:
    auto = DistributedParams.from_params({})
    assert (resolve(auto, 0, world=3).strategy, resolve(auto, 0, world=3).num_processes) == (
        "ddp", 3)


def test_more_processes_than_gpus_is_named() -> None:
    with pytest.raises(ParamsError, match=r"train\.distributed\.num_processes \(4\) is more "
                                          r"than the 2 GPUs"):
        resolve(DistributedParams.from_params({"num_processes": 4}), 2)
    with pytest.raises(ParamsError, match=r"must be a positive integer or auto, got 'all'"):
        DistributedParams.from_params({"num_processes": "all"})


def test_visible_gpus_counts_nvidia_smi_as_cuda_visible_devices_narrows_it(
        tmp_path: Path, monkeypatch, no_launch_env) -> None:
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", 4)["PATH"])
    assert visible_gpus() == 4
    for chosen, count in (("1,3", 2), ("2", 1), ("", 0), ("-1", 0), ("0,7,1", 1),
                          ("GPU-00000002,GPU-00000003", 2)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", chosen)
        assert visible_gpus() == count, chosen
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: no GPU
    assert visible_gpus() == 0


def test_one_process_on_several_gpus_keeps_the_first_and_says_so(
        tmp_path: Path, monkeypatch, capsys, no_launch_env) -> None:
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", 2)["PATH"])
    model = ModelParams(name="embedded:tiny-qwen3-vl", backend="transformers")
    plan = training_plan(train_params(strategy="none"), model, "train_gspo")
    assert (plan.strategy, plan.num_processes) == ("none", 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    line = capsys.readouterr().out.strip()
    assert line == ("train_gspo: train.distributed.strategy none, num_processes auto: one "
                    "process on GPU 0 of the 2 visible (CUDA_VISIBLE_DEVICES=0)")
    assert visible_gpus() == 1  # what the trainer's process sees from here on
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    training_plan(train_params(num_processes=1), model, "sft_cold_start")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "sft_cold_start: train.distributed.strategy auto, num_processes 1" in (
        capsys.readouterr().out)


def test_auto_launches_on_several_gpus_and_keeps_one_for_unsloth(
        tmp_path: Path, monkeypatch, capsys, no_launch_env) -> None:
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", 2)["PATH"])
    transformers = ModelParams(name="embedded:tiny-qwen3-vl", backend="transformers")
    plan = training_plan(train_params(), transformers, "train_gspo")
    assert (plan.strategy, plan.num_processes) == ("ddp", 2)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and capsys.readouterr().out == ""
    unsloth = ModelParams(name="embedded:tiny-qwen3-vl", backend="unsloth")
    plan = training_plan(train_params(), unsloth, "train_gspo")
    assert (plan.strategy, plan.num_processes) == ("none", 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert "train_gspo: Unsloth trains on one GPU" in capsys.readouterr().out
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ParamsError, match=r"strategy ddp: Unsloth trains on one GPU"):
        training_plan(train_params(num_processes=2), unsloth, "train_gspo")  # before launching
    with pytest.raises(ParamsError, match=r"load_in_4bit with train.distributed.strategy fsdp"):
        training_plan(train_params(multi_gpu_strategy="fsdp"),
                      ModelParams(name="x", backend="transformers", load_in_4bit=True), "sft")


def test_eval_auto_is_one_process_per_gpu(tmp_path: Path, monkeypatch, capsys,
                                          no_launch_env) -> None:
    model = ModelParams(name="embedded:tiny-qwen3-vl", backend="transformers")
    assert evaluation_plan("auto", model, "baseline_eval") == 1  # no GPU here
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", 2)["PATH"])
    assert evaluation_plan("auto", model, "baseline_eval") == 2
    assert capsys.readouterr().out == ""
    with pytest.raises(ParamsError, match=r"eval\.num_processes \(3\) is more than the 2 GPUs"):
        evaluation_plan(3, model, "baseline_eval")
    unsloth = ModelParams(name="embedded:tiny-qwen3-vl", backend="unsloth")
    assert evaluation_plan("auto", unsloth, "baseline_eval") == 1
    assert capsys.readouterr().out.startswith("baseline_eval: Unsloth runs on one GPU")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert evaluation_plan(1, model, "post_eval") == 1
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert capsys.readouterr().out.startswith("post_eval: eval.num_processes 1: one process on GPU 0")
    assert evaluation_processes("auto") == 1  # evaluating in this process, GPUs or not
    monkeypatch.setenv("VLMRL_LAUNCHED", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert evaluation_processes("auto") == 2


@pytest.mark.parametrize("script", ["train_gspo.py", "sft.py", "evaluate.py"])
def test_stage_scripts_choose_their_gpus_before_torch_is_imported(script: str) -> None:
    """CUDA reads CUDA_VISIBLE_DEVICES once, when torch first initialises it: a stage that keeps
    one GPU must decide before anything imports torch (bitsandbytes initialises CUDA on import)."""
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('stage', 'stages/{script}'); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "print(sorted(m for m in ('torch', 'transformers', 'trl') if m in sys.modules))")
    result = run([sys.executable, "-c", code], ROOT)
    assert result.stdout.strip() == "[]", result.stdout


def test_gspo_step_benchmark_keeps_one_gpu_of_several(tmp_path: Path) -> None:
    """Each of its runs trains in one process: on a host with two GPUs it keeps the first (its
    --doc mode says so too, and measures nothing)."""
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- gspo_step roofline: start -->\n<!-- gspo_step roofline: end -->\n")
    env = {**os.environ, **fake_nvidia_smi(tmp_path / "bin", 2), "PYTHONPATH": str(ROOT / "src")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = run([sys.executable, "benchmarks/gspo_step.py", "--doc", str(doc),
                  "--out", str(tmp_path / "none.json")], ROOT, env=env)
    assert result.stdout.splitlines()[0] == (
        "benchmarks/gspo_step.py: one process on GPU 0 of the 2 visible (CUDA_VISIBLE_DEVICES=0)")


# ------------------------------------------------------------------ CPU, 2 processes


def audited_env(audit: Path) -> dict[str, str]:
    env = dvc_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(AUDIT_SITE), env.get("PYTHONPATH")]))
    env["VLMRL_WRITE_AUDIT"] = str(audit)
    return env


def audit_lines(audit: Path, rank: int) -> list[str]:
    return [line for path in sorted(audit.glob(f"rank{rank}-*.txt"))
            for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_process_training_on_cpu_writes_from_rank_0_and_resumes(tmp_path: Path) -> None:
    repo = make_project_repo(tmp_path / "repo", {**TEST_PARAMS, **TWO_PROCESSES})
    dvc_repro(repo, "sft_cold_start")
    audit = tmp_path / "audit"
    audit.mkdir()
    env = audited_env(audit)
    checkpoint = repo / "data/checkpoints/train_gspo/checkpoint-2"
    kill_repro_when(repo, checkpoint / "trainer_state.json", env)
    time.sleep(2)  # the workers die with their launcher: nothing may be written after the kill
    assert not (repo / "data/checkpoints/train_gspo/checkpoint-4").exists()
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == [
        "rng_state_0.pth", "rng_state_1.pth"]

    result = run(["dvc", "repro", "train_gspo"], repo, env=env)
    output = result.stdout + result.stderr
    assert "launching 2 process(es) with ddp.yaml" in output
    assert "resuming from" in output
    assert "global batch 4 (2 x 2 x 1 accumulation)" in output
    assert json.loads((repo / "data/metrics/train.json").read_text())["steps"] == 4
    summary = json.loads((repo / "data/reports/details/train_gspo.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("checkpoint-2")
    batch = summary["batch"]
    # TEST_PARAMS' per_device_train_batch_size 4 is the global batch, as in one process
    assert batch["global_batch_size"] == TEST_PARAMS["train.grpo.per_device_train_batch_size"]
    assert (batch["num_processes"], batch["per_device_train_batch_size"]) == (2, 2)
    # two resumed steps, one generation batch of 8 rows (2 groups of 4): 4 rows, 1 prompt each
    assert batch["rows_per_process"] == [4, 4] and batch["prompts_per_process"] == [1, 1]
    assert batch["prompts_in_several_processes"] == 0
    log = json.loads((repo / "data/metrics/train_log.json").read_text())
    assert [row["step"] for row in log][-1] == 4
    assert (repo / "data/models/adapter/adapter_model.safetensors").is_file()
    assert list((repo / "data/reports/train_completions").glob("*.parquet"))

    rank0, rank1 = audit_lines(audit, 0), audit_lines(audit, 1)
    assert any(line.endswith("data/metrics/train.json") for line in rank0), rank0
    assert any("rng_state_1.pth" in line for line in rank0)  # rank 0 writes rank 1's RNG state
    assert rank1 == [], rank1[:20]
    assert list(audit.glob("rank1-*.txt")), "rank 1 was never audited"


def eval_records(repo: Path, tmp_path: Path, name: str, update: dict) -> list[dict]:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for dotted, value in update.items():
        section, key = dotted.split(".")
        params[section][key] = value
    params_file = tmp_path / f"{name}.yaml"
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    out = tmp_path / name
    command = stage_command("baseline_eval")  # the base model: --start-adapter left out
    command = command[:command.index("--start-adapter")] + [
        "--out", str(out), "--metrics", str(out / "metrics.json"),
        "--details", str(out / "details.json"), "--by-category", str(out / "by_category.json"),
        "--timings", str(out / "timings.json"), "--params", str(params_file)]
    result = run(command, repo)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == TEST_PARAMS["data.eval_size"], result.stdout
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_two_process_evaluation_gives_the_records_of_one(pipeline_repo: Path, tmp_path: Path,
                                                         do_sample: bool) -> None:
    dvc_repro(pipeline_repo, "prepare_data")
    # 8 items in batches of 2: process 0 generates batches 0 and 2, process 1 batches 1 and 3
    settings = {"eval.batch_size": 2, "eval.do_sample": do_sample, "eval.max_new_tokens": 8}
    one = eval_records(pipeline_repo, tmp_path, "one", {**settings, "eval.num_processes": 1})
    two = eval_records(pipeline_repo, tmp_path, "two", {**settings, "eval.num_processes": 2})
    assert [r["pid"] for r in two] == [r["pid"] for r in one]
    assert two == one
    assert len({r["response"] for r in one}) > 1  # real, differing generations


@pytest.mark.slow
def test_defaults_on_two_gpus_train_and_evaluate_with_two_processes(tmp_path: Path) -> None:
    """The default `auto` on a host with two GPUs (nvidia-smi lists two; the processes run on
    the CPU with gloo): sft_cold_start, train_gspo and baseline_eval each launch one process per
    GPU, rank 1 writes nothing under data/, and verify_lora passes the adapter."""
    repo = make_project_repo(tmp_path / "repo", {**TEST_PARAMS, "train.grpo.max_steps": 2})
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["train"]["distributed"]["strategy"] == "auto"
    assert params["eval"]["num_processes"] == "auto"
    audit = tmp_path / "audit"
    audit.mkdir()
    env = audited_env(audit)
    env.update(fake_nvidia_smi(tmp_path / "bin", 2, env["PATH"]))
    result = run(["dvc", "repro", "verify_lora", "baseline_eval"], repo, env=env)
    output = result.stdout + result.stderr
    assert output.count("launching 2 process(es) with ddp.yaml") == 3, output[-3000:]
    assert "SFT: 2 steps on 2 process(es)" in output
    details = repo / "data/reports/details"
    sft = json.loads((details / "sft_cold_start.json").read_text())["batch"]
    assert (sft["num_processes"], sft["per_device_train_batch_size"], sft["strategy"]) == (
        2, 4, "ddp")  # params.yaml's global 8, split
    train = json.loads((details / "train_gspo.json").read_text())["batch"]
    assert (train["num_processes"], train["strategy"], train["rows_per_process"]) == (
        2, "ddp", [4, 4])
    assert json.loads((repo / "data/metrics/verify_lora.json").read_text())["checks_failed"] == 0
    baseline = json.loads((repo / "data/metrics/baseline_eval.json").read_text())
    assert baseline["n"] == TEST_PARAMS["data.eval_size"]
    rank0, rank1 = audit_lines(audit, 0), audit_lines(audit, 1)
    assert any(line.endswith("data/metrics/sft.json") for line in rank0), rank0[:20]
    assert rank1 == [], rank1[:20]
    assert len(list(audit.glob("rank1-*.txt"))) >= 3, "rank 1 of each stage must be audited"


@pytest.mark.slow
def test_strategy_none_on_two_gpus_trains_in_one_process(tmp_path: Path) -> None:
    """`strategy: none` on a host with two GPUs says in one line that it keeps the first, and
    trains in this process."""
    repo = make_project_repo(tmp_path / "repo", {
        **TEST_PARAMS, "train.grpo.max_steps": 2, "sft.enabled": False,
        "train.distributed.strategy": "none"})
    env = dvc_env()
    env.update(fake_nvidia_smi(tmp_path / "bin", 2, env["PATH"]))
    result = run(["dvc", "repro", "train_gspo"], repo, env=env)
    output = result.stdout + result.stderr
    assert ("train_gspo: train.distributed.strategy none, num_processes auto: one process on "
            "GPU 0 of the 2 visible (CUDA_VISIBLE_DEVICES=0)") in output
    assert "launching" not in output
    batch = json.loads((repo / "data/reports/details/train_gspo.json").read_text())["batch"]
    assert (batch["num_processes"], batch["strategy"]) == (1, "none")


def test_auto_backend_trains_on_every_gpu_with_unsloth_installed(
        tmp_path: Path, monkeypatch, capsys, no_launch_env) -> None:
    """`model.backend: auto` is transformers whether Unsloth is installed or not, so the
    multi-GPU default applies (a `pip install -e ".[gpu]"` installs Unsloth)."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "unsloth" else real_find_spec(name, *a))
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", 2)["PATH"])
    auto = ModelParams(name="embedded:tiny-qwen3-vl", backend="auto")
    plan = training_plan(train_params(), auto, "train_gspo")
    assert (plan.strategy, plan.num_processes) == ("ddp", 2)
    assert evaluation_plan("auto", auto, "baseline_eval") == 2


def test_one_process_keeps_the_first_gpu_the_user_chose(tmp_path: Path, monkeypatch, capsys,
                                                        no_launch_env) -> None:
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", 4)["PATH"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    model = ModelParams(name="embedded:tiny-qwen3-vl", backend="transformers")
    assert evaluation_plan(1, model, "post_eval") == 1
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    assert "one process on GPU 2 of the 2 visible" in capsys.readouterr().out
