"""What the pipeline does around a training run over several machines (vlmrl.pipeline.nodes),
without training: which inputs a node pulls and which command it runs (read from dvc.yaml), the
names the launcher reads, the node deployments, how a node's failure reads, and the one-line
refusals of `vlmrl run --nodes`, `vlmrl schedule --node` and `vlmrl node`. The training itself
over two nodes: tests/test_nodes_loopback.py."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, run, stage_command

from vlmrl.distributed import settings
from vlmrl.pipeline import nodes
from vlmrl.pipeline.commands import CommandResult


def vlmrl(*args: str, **env: str):
    return run([sys.executable, "-m", "vlmrl.cli", *args], ROOT, check=False,
               env={**__import__("os").environ, **env})


def test_a_node_pulls_the_inputs_other_stages_write_and_runs_the_stage_command():
    assert nodes.input_targets(ROOT, "train_gspo") == {
        "data/prepared/train": "prepare_data", "data/models/sft": "sft_cold_start"}
    assert nodes.input_targets(ROOT, "sft_cold_start") == {"data/prepared/train": "prepare_data"}
    assert nodes.stage_command(ROOT, "train_gspo") == stage_command("train_gspo")


def test_the_pipeline_sets_the_variables_the_launcher_reads():
    assert nodes.COUNT_ENV == settings.MACHINE_ENV["num_machines"][0]
    assert nodes.RANK_ENV == settings.MACHINE_ENV["machine_rank"][0]
    assert nodes.UP_TO_DATE_ENV == settings.UP_TO_DATE_ENV


def test_a_node_deployment_runs_in_its_clone_on_the_queue_of_its_rank():
    deployment = nodes.node_deployment("gpu-pool", 1, ROOT)
    assert (deployment.name, deployment.work_pool_name, deployment.work_queue_name) == (
        "gpu-pool-node-1", "gpu-pool", "node-1")
    assert deployment.entrypoint == "flows/pipeline.py:node"
    assert deployment.parameters == {"rank": 1, "repo": str(ROOT)}
    assert deployment.storage.to_pull_step() == {
        "prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}


def test_a_failed_step_reads_as_one_line():
    bar = " 12%|#         | 1/8 [00:05<00:41,  5.93s/it]"
    own = [f"{bar}train_gspo failed: node 1 of 2 left the run"[len(bar):]]
    with pytest.raises(nodes.NodeFailed, match=r"^train_gspo failed: node 1 of 2 left the run$"):
        nodes.check(CommandResult(255, ["ERROR: failed to reproduce"]), "train_gspo", own)
    with pytest.raises(nodes.NodeFailed, match=r"^train_gspo was killed \(signal 9\)$"):
        nodes.check(CommandResult(-9), "train_gspo")
    with pytest.raises(nodes.NodeFailed, match=r"^dvc pull ended with exit code 1: no remote$"):
        nodes.check(CommandResult(1, ["", "no remote"]), "dvc pull")
    assert nodes.state_line("Flow run encountered an exception: NodeFailed: train_gspo failed: "
                            "x\n y") == "train_gspo failed: x y"


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--nodes", "2", "--pool", "p"], {"PREFECT_API_URL": ""},
     "vlmrl run: --nodes needs the Prefect server the nodes' workers use: set PREFECT_API_URL"),
    (["--nodes", "2"], {}, "vlmrl run: --nodes needs --pool: the work pool of the nodes' workers"),
    (["--nodes", "1", "--pool", "p"], {},
     "vlmrl run: --nodes 1: a run over several machines takes 2 or more (--pool goes with it)"),
    (["--nodes", "2", "--pool", "p", "--stages", "post_eval"], {},
     ("vlmrl run: post_eval runs on one machine; the stages that train over several are "
     "sft_cold_start, train_gspo")),
    (["--nodes", "2", "--pool", "p", "--stages", "sft_cold_start,train_gspo"], {},
     ("vlmrl run: --nodes runs one training stage at a time, got sft_cold_start,train_gspo: the "
     "next one reads what this one records on node 0")),
    (["--nodes", "2", "--pool", "p", "--set", "train.grpo.max_steps=2"], {},
     ("vlmrl run: --set does not go with --nodes: every node must run the same params.yaml, so "
     "commit the change and check it out on every node")),
])
def test_vlmrl_run_nodes_refuses_bad_input_in_one_line(args, env, message):
    result = vlmrl("run", *args, **env)
    assert (result.returncode, result.stdout, result.stderr) == (1, "", message + "\n")


def test_vlmrl_schedule_node_and_vlmrl_node_refuse_bad_input_in_one_line():
    result = vlmrl("schedule", "--pool", "p", "--node", "1", "--cron", "0 3 * * *")
    assert (result.returncode, result.stderr) == (
        1, ("vlmrl schedule: --cron: not with --node (`vlmrl run --nodes` starts the node runs "
           "and picks the stage)\n"))
    result = vlmrl("node", "--rank", "2", "--nodes", "2")
    assert (result.returncode, result.stderr) == (
        1, "vlmrl node: --rank 2 must be in 0..1 (--nodes 2)\n")
