"""A step whose loss or gradient is not finite is skipped, counted, and never reaches the weights;
too many in a row stop the stage with one line and nothing recorded as done (vlmrl.training.trainer.nonfinite)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import dvc_repro, make_project_repo, run
from safetensors.torch import load_file

from vlmrl.models.loading import load_policy
from vlmrl.params import Params
from vlmrl.training.gspo import build_grpo_config, make_trainer
from vlmrl.training.rollout.generation import rollout_class
from vlmrl.training.trainer.nonfinite import NonFiniteTrainingError

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
PARAMS = Params({"model": {"name": "embedded:tiny-qwen3-vl"},
                 "train": {"save_steps": 100, "lora": LORA}})
GRPO = {"learning_rate": 1.0e-2, "lr_scheduler_type": "linear", "max_steps": 4,
        "per_device_train_batch_size": 4, "steps_per_generation": 1, "num_generations": 4,
        "max_completion_length": 6, "importance_sampling_level": "sequence", "beta": 0.0,
        "logging_steps": 1, "seed": 3, "report_to": "none"}


def length_reward(completions, **columns) -> list[float]:
    return [float(len(str(c))) for c in completions]


def poison_gradient_at(model, steps: set[int], counter: list[int]) -> None:
    """A gradient hook on one LoRA weight that turns its gradient into NaN on the given
    optimizer steps (1-based; one micro-batch per step here)."""
    weight = next(p for n, p in model.named_parameters() if "lora_B" in n)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return grad * math.nan if counter[0] in steps else grad

    weight.register_hook(hook)


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_poisoned(train_set, tmp_path: Path, steps: set[int], limit: int = 3):
    model, processor, _ = load_policy(PARAMS.model, PARAMS.train.lora, GRPO["seed"],
                                      model_class=rollout_class)
    poison_gradient_at(model, steps, [0])
    config = build_grpo_config(GRPO, output_dir=tmp_path / "run", save_steps=100,
                               reward_weights=[1.0], model_settings=PARAMS.model)
    trainer = make_trainer(model.train(), processor, config, train_set, [length_reward],
                           generation_rows=None, callbacks=[], max_nonfinite_steps=limit)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = lora_weights(model)

    trainer.add_callback(Snapshot())
    return trainer, snapshots


def test_a_nonfinite_gradient_skips_its_step_and_training_finishes(train_set, tmp_path) -> None:
    trainer, snapshots = run_poisoned(train_set, tmp_path, steps={2})
    trainer.train()
    assert trainer.state.global_step == 4
    for name, weight in snapshots[4].items():
        assert torch.isfinite(weight).all(), name
    # step 2 changed nothing: no optimizer step, and the schedule did not move on
    for name, weight in snapshots[2].items():
        assert torch.equal(weight, snapshots[1][name]), name
    assert any(not torch.equal(w, snapshots[2][n]) for n, w in snapshots[3].items())
    assert trainer.lr_scheduler.scheduler.last_epoch == 3
    rows = [row for row in trainer.state.log_history if "nonfinite_steps" in row]
    assert [row["nonfinite_steps"] for row in rows] == [0, 1, 1, 1]


def test_too_many_nonfinite_steps_in_a_row_stop_training(train_set, tmp_path) -> None:
    trainer, snapshots = run_poisoned(train_set, tmp_path, steps={2, 3, 4}, limit=2)
    with pytest.raises(NonFiniteTrainingError,
                       match=r"step 3: the gradient norm was not finite on 2 steps in a "
                             r"row \(train.max_nonfinite_steps = 2\); look at the learning rate"):
        trainer.train()
    assert all(torch.isfinite(w).all() for w in snapshots[2].values())


# Loaded by every Python process of a stage run through PYTHONPATH (the standard `site` hook): the
# language model's output becomes NaN in the training forward passes (grad enabled) numbered in
# VLMRL_TEST_POISON (1-based), so the loss and the gradient of those steps are not finite.
POISON = """
import os

import torch

_poisoned = {int(n) for n in os.environ["VLMRL_TEST_POISON"].split(",")}
_count = [0]


def _poison(module, args, output):
    if type(module).__name__ != "Qwen3VLTextModel" or not torch.is_grad_enabled():
        return None
    _count[0] += 1
    if _count[0] in _poisoned:
        output.last_hidden_state = output.last_hidden_state * float("nan")
    return output


torch.nn.modules.module.register_module_forward_hook(_poison)
"""

SMALL = {"data.synthetic_size": 16, "data.synthetic_read_size": 4, "data.eval_size": 4,
         "data.image_size": 64, "sft.enabled": False, "train.save_steps": 1,
         "train.grpo.max_steps": 4, "train.grpo.per_device_train_batch_size": 4,
         "train.grpo.num_generations": 4, "train.grpo.max_completion_length": 6}


def poisoned_env(tmp_path: Path, forward_passes: str) -> dict[str, str]:
    from vlmrl.pipeline.dvc_env import dvc_env

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POISON)
    env = dvc_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return {**env, "VLMRL_TEST_POISON": forward_passes}


def test_stage_stops_in_one_line_and_records_nothing(tmp_path) -> None:
    repo = make_project_repo(tmp_path / "repo", {**SMALL, "train.max_nonfinite_steps": 2})
    dvc_repro(repo, "sft_cold_start")
    lock = (repo / "dvc.lock").read_text()
    result = run(["dvc", "repro", "train_gspo"], repo, check=False,
                 env=poisoned_env(tmp_path, "3,4"))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "train_gspo failed" in line]
    assert errors == [(
        "train_gspo failed: step 4: the loss was not finite on 2 steps in a row "
        "(train.max_nonfinite_steps = 2); look at the learning rate and model.dtype (bf16 "
        "overflows where float32 does not); the last checkpoint saved before it is kept"
    )], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert (repo / "dvc.lock").read_text() == lock
    assert not (repo / "data/models/adapter").exists()
    assert not (repo / "data/metrics/train.json").exists()
    # the checkpoints of the steps before are kept, with finite weights; step 4's was not written
    checkpoints = sorted((repo / "data/checkpoints/train_gspo").glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for checkpoint in checkpoints:
        for name, tensor in load_file(checkpoint / "adapter_model.safetensors").items():
            assert torch.isfinite(tensor).all(), (checkpoint.name, name)


def test_skipped_steps_are_counted_in_the_metrics(tmp_path) -> None:
    """A run with one poisoned step finishes, reports it and keeps a finite adapter."""
    repo = make_project_repo(tmp_path / "repo", SMALL)
    run(["dvc", "repro", "train_gspo"], repo, env=poisoned_env(tmp_path, "2"))
    metrics = json.loads((repo / "data/metrics/train.json").read_text())
    assert metrics["steps"] == 4 and metrics["nonfinite_steps"] == 1
    log = json.loads((repo / "data/metrics/train_log.json").read_text())
    assert [row["nonfinite_steps"] for row in log] == [0, 1, 1, 1]
    adapter = load_file(repo / "data/models/adapter/adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())


def test_a_nonfinite_weight_stops_training(train_set, tmp_path) -> None:
    """An update too large for float32 (learning rate 1e39) makes a weight infinite: the run
    stops at that step's end, before anything is saved from it."""
    model, processor, _ = load_policy(PARAMS.model, PARAMS.train.lora, GRPO["seed"],
                                      model_class=rollout_class)
    config = build_grpo_config({**GRPO, "learning_rate": 1e39, "max_grad_norm": 0.0},
                               output_dir=tmp_path / "run", save_steps=1,
                               reward_weights=[1.0], model_settings=PARAMS.model)
    trainer = make_trainer(model.train(), processor, config, train_set, [length_reward],
                           generation_rows=None, callbacks=[])
    with pytest.raises(NonFiniteTrainingError, match=r"step 1: the weight .*lora.* is not finite"):
        trainer.train()
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_sft_skips_a_nonfinite_step(train_set, tmp_path) -> None:
    from vlmrl.training.sft import build_sft_config, sft_dataset
    from vlmrl.training.trainer.trainers import sft_trainer

    params = Params({"model": {"name": "embedded:tiny-qwen3-vl"},
                     "sft": {"enabled": True, "args": {"max_steps": 3, "learning_rate": 1e-2,
                                                       "per_device_train_batch_size": 2}},
                     "train": {"save_steps": 100, "lora": LORA}})
    config = build_sft_config(params.sft, tmp_path / "sft", params.model)
    model, processor, _ = load_policy(params.model, params.train.lora, config.seed)
    poison_gradient_at(model, {2}, [0])
    trainer = sft_trainer(model=model, args=config, train_dataset=sft_dataset(train_set),
                          processing_class=processor, max_nonfinite_steps=2)
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.nonfinite.skipped == 1
    assert all(torch.isfinite(w).all() for w in lora_weights(trainer.model).values())
    assert [row["nonfinite_steps"] for row in trainer.state.log_history
            if "nonfinite_steps" in row] == [0, 1, 1]


def _check_shards(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from vlmrl.training.trainer.nonfinite import agree, all_finite, first_nonfinite

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        weight = distribute_tensor(torch.tensor([1.0, 2.0, 3.0, math.nan]), mesh, [Shard(0)])
        flag = all_finite([weight])
        results[rank] = (type(flag) is torch.Tensor, bool(flag), first_nonfinite([("w", weight)]),
                         agree(flag))
    finally:
        dist.destroy_process_group()


def test_sharded_tensors_are_checked_shard_by_shard(tmp_path) -> None:
    """FSDP2 keeps parameters and gradients as DTensors: each process checks its own shard (a
    reduction over the DTensor failed on two GPUs: Replicate to Partial(product)), and both
    processes agree that the step is not finite when one shard is not."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_check_shards, args=(str(tmp_path / "init"), results), nprocs=2)
        assert dict(results) == {0: (True, True, None, False), 1: (True, False, "w", False)}
