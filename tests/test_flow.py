"""The Prefect flow over the DVC pipeline, with real Prefect and real DVC: stages run once and are
cached the second time (DVC decides), a failing stage fails the flow run and stops the pipeline,
overrides become a DVC experiment, and a real `prefect server` sees runs, tasks, artifacts and
the cron schedule through its REST API. One full pipeline run is shared by the module."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from conftest import ROOT, make_project_repo, run
from prefect_server import (
    Api,
    background,
    daily_cron_soon,
    first_scheduled_run,
    offline_prefect,  # noqa: F401 (an autouse fixture)
    prefect_env,
    prefect_server,
    task_names,
    wait_for,
    wait_for_final_state,
)

from vlmrl.pipeline.dvc_records import DvcRecords, Outcome, stage_outcomes, stage_seconds
from vlmrl.pipeline.orchestration import (
    StageFailed,
    register_deployment,
    run_stage,
    select_stages,
    stream_command,
    unchanged_prefix,
)

CRON = "0 3 * * *"
STAGES = ("prepare_data", "sft_cold_start", "baseline_eval", "train_gspo", "post_eval",
          "verify_lora", "export", "upload")
METRICS_ARTIFACTS = ("eval-before-after", "lora-verification", "published-version")
# The embedded default with fewer eval items, tokens and steps: this module tests the orchestration,
# the stages' own tests cover their results; it keeps the one full pipeline run short.
QUICK_PARAMS = {"data.eval_size": 4, "eval.max_new_tokens": 16, "train.grpo.max_steps": 2,
                "sft.args.max_steps": 2}


def load_flow_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vlmrl_flow_under_test",
                                                  ROOT / "flows" / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drain_logs() -> None:
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()


# --- unit: what DVC did, from its records ---------------------------------------------------------

LOCK_1 = {"cmd": "python toy.py", "params": {"params.yaml": {"toy": {"value": 1}}},
          "outs": [{"path": "out.txt", "hash": "md5", "md5": "9dd4e461268c8034f5c8564e155c67a6",
                    "size": 1}]}
LOCK_2 = {**LOCK_1, "params": {"params.yaml": {"toy": {"value": 2}}}}


def run_cache_entry(directory: Path, name: str, entry: dict) -> Path:
    path = directory / "runs" / name[:2] / name / "entry"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(entry))
    return path


def records(locks: dict, stale: tuple[str, ...] = (), run_cache: tuple[Path, ...] = ()
            ) -> DvcRecords:
    return DvcRecords(frozenset(stale), locks, frozenset(run_cache))


def test_unchanged_lock_of_a_stage_dvc_called_fresh_is_cached():
    before = records({"toy": LOCK_1})
    assert stage_outcomes(before, records({"toy": LOCK_1}), ["toy"]) == {"toy": Outcome.CACHED}


def test_new_lock_entry_is_ran_unless_the_run_cache_held_it(tmp_path: Path):
    held = run_cache_entry(tmp_path, "aa11", LOCK_1)
    written = run_cache_entry(tmp_path, "bb22", LOCK_2)
    before = records({"toy": LOCK_1}, stale=("toy",), run_cache=(held,))
    after = records({"toy": LOCK_2}, run_cache=(held, written))
    assert stage_outcomes(before, after, ["toy"]) == {"toy": Outcome.RAN}
    back = records({"toy": LOCK_1}, run_cache=(held, written))
    assert stage_outcomes(after, back, ["toy"]) == {"toy": Outcome.RESTORED}


def test_stale_stage_with_an_unchanged_lock_was_reproduced():
    before = records({"toy": LOCK_1}, stale=("toy",))  # e.g. its outputs were deleted
    assert stage_outcomes(before, records({"toy": LOCK_1}), ["toy"]) == {"toy": Outcome.RAN}
    first = records({}, stale=("toy",))
    assert stage_outcomes(first, records({"toy": LOCK_1}), ["toy"]) == {"toy": Outcome.RAN}


def test_stage_seconds_run_from_one_lock_write_to_the_next():
    seconds = stage_seconds(["a", "b", "c", "d"], 10.0, {"c": 19.0, "a": 12.5})
    assert seconds == {"a": 2.5, "b": 0.0, "c": 6.5, "d": 0.0}


# --- DVC on a toy repo, no Prefect ----------------------------------------------------------------

TOY_DVC_YAML = {"stages": {
    "toy": {"cmd": "python -c \"import yaml; print('toy says', yaml.safe_load(open('params.yaml')))"
                   "; open('out.txt', 'w').write('x')\"",
            "params": ["toy"], "outs": ["out.txt"]},
    "broken": {"cmd": "python -c \"import sys; sys.exit('broken stage: no_such_key is not a param')"
                      "\""},
}}


@pytest.fixture
def toy_repo(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(TOY_DVC_YAML))
    (tmp_path / "params.yaml").write_text("toy:\n  value: 1\n")
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@vlmrl.invalid"],
                ["git", "config", "user.name", "t"], ["dvc", "init", "-q"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "toy"]):
        run(cmd, tmp_path)
    return tmp_path


def test_ran_cached_restored_detected_on_real_dvc_output(toy_repo: Path):
    lines: list[str] = []
    outcomes = []
    for value in (1, 1, 2, 1):  # run, unchanged, run, back to a run DVC's run-cache holds
        (toy_repo / "params.yaml").write_text(f"toy:\n  value: {value}\n")
        outcomes.append(run_stage("toy", toy_repo, lines.append).outcome)
    assert outcomes == [Outcome.RAN, Outcome.CACHED, Outcome.RAN, Outcome.RESTORED]
    assert "toy says {'toy': {'value': 2}}" in lines  # the stage's own stdout, streamed


def test_vlmrl_run_on_an_up_to_date_pipeline_starts_no_prefect_server(tmp_path: Path):
    """With nothing stale and no PREFECT_API_URL, `vlmrl run` reports every stage cached from
    DVC's records and returns before Prefect is even imported."""
    repo = tmp_path / "repo"
    repo.mkdir()
    toy = {"stages": {"toy": TOY_DVC_YAML["stages"]["toy"]}}
    (repo / "dvc.yaml").write_text(yaml.safe_dump(toy))
    (repo / "params.yaml").write_text("toy:\n  value: 1\n")
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q", "--no-scm"], ["dvc", "repro"]):
        run(cmd, repo)
    script = ("import sys; from vlmrl.cli import main; code = main(['run', '--repo', sys.argv[1]]);"
              " print('prefect imported:', 'prefect' in sys.modules); sys.exit(code)")
    env = prefect_env(tmp_path / "prefect-home")
    result = run([sys.executable, "-c", script, str(repo)], repo, env=env)
    assert result.stdout.splitlines() == [
        "toy            cached        0.0 s",
        "every stage is up to date; no Prefect server was started",
        "prefect imported: False"]


def chain_stage(name: str, dep: str | None, out: str) -> dict:
    write = f"open('{out}', 'w').write(str(yaml.safe_load(open('params.yaml'))['{name}']))"
    stage = {"cmd": f"python -c \"import yaml; {write}\"", "params": [name], "outs": [out]}
    return stage | ({"deps": [dep]} if dep else {})


def test_the_flow_skips_dvc_only_for_stages_before_the_first_stale_one(tmp_path: Path):
    """A stage after a stale one can go stale when that one runs, though `dvc status` does not
    call it stale yet: only the stages before the first stale one are reported without DVC."""
    chain = {"stages": {"first": chain_stage("first", None, "a.txt"),
                        "second": chain_stage("second", "a.txt", "b.txt"),
                        "third": chain_stage("third", "b.txt", "c.txt")}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(chain))
    params = {"first": 1, "second": 1, "third": 1}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q", "--no-scm"], ["dvc", "repro"]):
        run(cmd, tmp_path)
    stages = ["first", "second", "third"]
    assert unchanged_prefix(tmp_path, stages) == set(stages)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params | {"second": 2}))
    assert unchanged_prefix(tmp_path, stages) == {"first"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params | {"first": 2}))
    assert unchanged_prefix(tmp_path, stages) == set()
    assert unchanged_prefix(tmp_path, ["third"]) == {"third"}  # alone, nothing before it runs

    lines: list[str] = []
    report = run_stage("first", tmp_path, lines.append, known_up_to_date=True)
    assert (report.outcome, lines) == (Outcome.CACHED,
                                       ["first: up to date (dvc status at the start of the run)"])
    assert (tmp_path / "a.txt").read_text() == "1"  # no DVC ran, so the stale stage did not


def test_failed_stage_raises_with_its_stderr(toy_repo: Path):
    streamed: list[tuple[str, str]] = []
    result = stream_command([sys.executable, "-m", "dvc", "repro", "-s", "broken"], toy_repo,
                            lambda stream, line: streamed.append((stream, line)))
    assert result.returncode != 0
    assert ("stderr", "broken stage: no_such_key is not a param") in streamed
    with pytest.raises(StageFailed, match="no_such_key is not a param"):
        run_stage("broken", toy_repo, lambda line: None)


def test_flow_tasks_follow_dvc_yaml_and_only_upload_retries():
    flow_module = load_flow_module()
    dvc_stages = tuple(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert flow_module.STAGE_NAMES == dvc_stages
    from prefect.cache_policies import NO_CACHE

    for stage_task in flow_module.PIPELINE:
        assert stage_task.cache_policy is NO_CACHE
        assert stage_task.retries == (2 if stage_task.name == "upload" else 0)


def test_select_stages_keeps_pipeline_order_and_rejects_unknown_names():
    assert select_stages(["upload", "prepare_data"], STAGES) == ["prepare_data", "upload"]
    assert select_stages(None, STAGES) == list(STAGES)
    with pytest.raises(ValueError, match="no_such_stage"):
        select_stages(["no_such_stage"], STAGES)


# --- the flow under prefect_test_harness -------------------------------------------------------


@pytest.fixture(scope="module")
def harness_api() -> Iterator[Api]:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield Api(PREFECT_API_URL.value())


@pytest.fixture(scope="module")
def flow_module() -> ModuleType:
    return load_flow_module()


@pytest.fixture(scope="module")
def two_runs(harness_api: Api, flow_module: ModuleType, tmp_path_factory) -> dict[str, Any]:
    """The whole pipeline in a fresh repo, then again: the module's only full pipeline run."""
    repo = make_project_repo(tmp_path_factory.mktemp("flow") / "repo", QUICK_PARAMS)
    runs: dict[str, Any] = {"repo": repo}
    for label in ("first", "second"):
        started = time.monotonic()
        state = flow_module.pipeline(repo=str(repo), return_state=True)
        runs[f"{label}_seconds"] = time.monotonic() - started
        assert state.is_completed(), state.message
        runs[label] = state.result()
        runs[f"{label}_id"] = str(state.state_details.flow_run_id)
    drain_logs()
    print(f"\nfull pipeline flow: first {runs['first_seconds']:.1f} s, "
          f"cached {runs['second_seconds']:.1f} s")
    return runs


@pytest.mark.slow
def test_first_run_runs_every_stage_in_order(two_runs: dict[str, Any]):
    assert list(two_runs["first"].outcomes.items()) == [(stage, "ran") for stage in STAGES]


@pytest.mark.slow
def test_second_run_is_all_cached_and_a_fraction_of_the_first(two_runs: dict[str, Any]):
    assert two_runs["second"].outcomes == {stage: "cached" for stage in STAGES}
    assert two_runs["second_seconds"] < two_runs["first_seconds"] / 4


@pytest.mark.slow
def test_one_task_per_stage_with_the_stage_output_in_its_log(two_runs, harness_api: Api):
    task_runs = harness_api.task_runs(two_runs["first_id"])
    assert task_names(task_runs) == Counter(STAGES)
    assert {task_run["state_type"] for task_run in task_runs} == {"COMPLETED"}
    logs = harness_api.logs(two_runs["first_id"])
    assert "Running stage 'train_gspo':" in logs  # DVC's line
    assert any(line.startswith("trained 2 steps") for line in logs)  # the stage's own print


@pytest.mark.slow
def test_artifacts_hold_metrics_verification_and_release(two_runs, harness_api: Api):
    artifacts = harness_api.artifacts(two_runs["first_id"])
    assert set(METRICS_ARTIFACTS) | {"pipeline-stages"} <= set(artifacts)
    repo = two_runs["repo"]
    baseline, post = (json.loads((repo / f"data/metrics/{name}.json").read_text())
                      for name in ("baseline_eval", "post_eval"))
    before, after = baseline["mean_reward"], post["mean_reward"]
    assert (f"| mean_reward | {before:.4g} | {after:.4g} | {after - before:.4g} |"
            in artifacts["eval-before-after"]["data"])
    assert artifacts["lora-verification"]["data"].startswith("# LoRA verification: passed")
    release = json.loads((repo / "data/reports/details/upload.json").read_text())
    assert f"`{release['version']}`" in artifacts["published-version"]["data"]


@pytest.mark.slow
def test_failing_stage_fails_the_run_and_stops_the_pipeline(harness_api, flow_module, tmp_path):
    repo = make_project_repo(tmp_path / "repo", {"data.eval_size": 0})
    state = flow_module.pipeline(repo=str(repo), return_state=True)
    assert state.is_failed()
    assert "data.eval_size: input should be greater than or equal to 1" in state.message  # the tail of stderr
    drain_logs()
    flow_run_id = str(state.state_details.flow_run_id)
    task_runs = harness_api.task_runs(flow_run_id)
    assert [(run_["task_key"].split("-")[0], run_["state_type"]) for run_ in task_runs] == [
        ("prepare_data", "FAILED")]
    logs = harness_api.logs(flow_run_id)
    assert any("data.eval_size: input should be greater than or equal to 1" in line for line in logs)


@pytest.mark.slow
def test_overrides_run_as_a_dvc_experiment(harness_api, flow_module, tmp_path):
    repo = make_project_repo(tmp_path / "repo")
    report = flow_module.pipeline(stages=["prepare_data"], repo=str(repo),
                                  overrides={"data.seed": 7})
    assert report.outcomes == {"prepare_data": "ran"}
    assert report.experiment in run(["dvc", "exp", "list", "--name-only"], repo).stdout.split()
    committed = yaml.safe_load(run(["git", "show", "HEAD:params.yaml"], repo).stdout)
    assert committed["data"]["seed"] == 42  # the override lives in the experiment only


# --- a real Prefect server, seen through its REST API -------------------------------------------


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> Iterator[str]:
    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as url:
        yield url


@pytest.mark.slow
def test_server_sees_run_tasks_artifacts_and_schedule(two_runs, server_url: str, tmp_path):
    repo = two_runs["repo"]  # already reproduced: every stage is cached, so this is quick
    env = prefect_env(tmp_path / "client-home", server_url)
    result = run([sys.executable, "-m", "vlmrl.cli", "run"], repo, env=env, timeout=600)
    printed = dict(line.split()[:2] for line in result.stdout.splitlines()
                   if line.split() and line.split()[0] in STAGES)
    assert printed == {stage: "cached" for stage in STAGES}

    api = Api(server_url)
    (flow_run,) = api.flow_runs("vlmrl-pipeline")
    assert flow_run["state_type"] == "COMPLETED"
    assert task_names(api.task_runs(flow_run["id"])) == Counter(STAGES)
    assert "eval-before-after" in api.artifacts(flow_run["id"])

    deployment_id = register_deployment_on(server_url, "nightly-test", repo)
    deployment = api.deployment("nightly-test")
    assert deployment["id"] == deployment_id
    assert [schedule["schedule"]["cron"] for schedule in deployment["schedules"]] == [CRON]
    assert deployment["parameters"] == {"repo": str(repo)}


def register_deployment_on(api_url: str, name: str, repo: Path) -> str:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        return str(register_deployment(name, CRON, repo))


@pytest.mark.slow
def test_vlmrl_schedule_serves_a_cron_deployment(server_url: str, tmp_path):
    """The cron fires and the serving process runs what Prefect's scheduler created; the test
    only reads the API (see tests/prefect_server.py for why it never writes)."""
    repo = make_project_repo(tmp_path / "repo", QUICK_PARAMS)
    env = prefect_env(tmp_path / "client-home", server_url)
    log_path = tmp_path / "serve.log"
    cron = daily_cron_soon()
    command = [sys.executable, "-m", "vlmrl.cli", "schedule", "--cron", cron,
               "--name", "served", "--stages", "prepare_data"]
    api = Api(server_url)
    with background(command, log_path, env, cwd=repo) as serving:
        (deployment,) = wait_for("the served deployment", lambda: api.deployments("served"),
                                 serving, log_path)
        assert deployment["schedules"][0]["schedule"]["cron"] == cron
        assert deployment["schedules"][0]["active"]
        assert deployment["parameters"]["stages"] == ["prepare_data"]
        flow_run = first_scheduled_run(api, deployment["id"], serving, log_path)
        assert flow_run["auto_scheduled"]  # created by the scheduler from the cron
        assert wait_for_final_state(api, flow_run["id"], serving, log_path) == "COMPLETED"
        assert task_names(api.task_runs(flow_run["id"])) == Counter(["prepare_data"])
    assert (repo / "data" / "metrics" / "prepare_data.json").is_file()  # DVC ran it in the repo
