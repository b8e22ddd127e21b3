"""Prefect work pools: the scheduler on one machine, the GPU stages on another. A real
`prefect server` and a real process worker on 127.0.0.1; `vlmrl schedule --pool` registers the
real flow (flows/pipeline.py) of a tiny project repo on the pool with a cron schedule, Prefect's
scheduler creates the run, and the worker, started in another directory, runs it in the repo:
DVC reproduces prepare_data there."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TEST_PARAMS, make_project_repo, run
from prefect_server import (
    Api,
    background,
    daily_cron_soon,
    first_scheduled_run,
    offline_prefect,  # noqa: F401 (an autouse fixture)
    prefect_command,
    prefect_env,
    prefect_server,
    task_names,
    wait_for_final_state,
)

POOL = "gpu-test"


def test_schedule_needs_a_cron_or_a_pool():
    result = run([sys.executable, "-m", "vlmrl.cli", "schedule"], ROOT, check=False)
    assert result.returncode == 2
    assert "--cron is required unless --pool is given" in result.stderr


def test_a_pool_deployment_runs_in_the_repo_it_was_registered_from():
    from vlmrl.pipeline.orchestration import pipeline_deployment

    deployment = pipeline_deployment("on-pool", None, ROOT, ["prepare_data"], work_pool=POOL)
    assert deployment.work_pool_name == POOL
    assert deployment.schedules == []
    assert deployment.entrypoint == "flows/pipeline.py:pipeline"
    assert deployment.storage.to_pull_step() == {
        "prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}
    assert deployment.parameters == {"repo": str(ROOT), "stages": ["prepare_data"]}


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> Iterator[str]:
    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as url:
        yield url


@pytest.mark.slow
def test_a_worker_runs_the_scheduled_pipeline_in_the_repo(server_url: str, tmp_path: Path):
    repo = make_project_repo(tmp_path / "repo", TEST_PARAMS)
    env = prefect_env(tmp_path / "client-home", server_url)
    cron = daily_cron_soon()
    registered = run([sys.executable, "-m", "vlmrl.cli", "schedule", "--pool", POOL,
                      "--cron", cron, "--name", "on-pool", "--stages", "prepare_data"],
                     repo, env=env, timeout=300)
    assert f"prefect worker start --pool {POOL}" in registered.stdout

    api = Api(server_url)
    deployment = api.deployment("on-pool")
    (pool,) = api.post("work_pools/filter", {"work_pools": {"name": {"any_": [POOL]}}})
    assert pool["type"] == "process"
    assert deployment["work_pool_name"] == POOL
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(repo)}}]
    assert [schedule["schedule"]["cron"] for schedule in deployment["schedules"]] == [cron]

    elsewhere = tmp_path / "worker"  # the worker's own directory: the pull step finds the repo
    elsewhere.mkdir()
    log_path = tmp_path / "worker.log"
    with background(prefect_command("worker", "start", "--pool", POOL), log_path,
                    env, cwd=elsewhere) as worker:
        flow_run = first_scheduled_run(api, deployment["id"], worker, log_path)
        assert flow_run["auto_scheduled"]  # created by Prefect's scheduler, not by this test
        state = wait_for_final_state(api, flow_run["id"], worker, log_path)
        assert state == "COMPLETED", log_path.read_text()

    finished = api.get(f"flow_runs/{flow_run['id']}")
    assert finished["work_pool_name"] == POOL
    assert task_names(api.task_runs(flow_run["id"])) == Counter(["prepare_data"])
    logs = api.logs(flow_run["id"])
    assert "Running stage 'prepare_data':" in logs  # DVC's own line, from the worker's run
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"prepare_data"}
    assert os.listdir(repo / "data" / "prepared" / "train")
    assert not os.listdir(elsewhere)  # nothing was copied to or written in the worker's directory
