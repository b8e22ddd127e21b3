"""The vlmrl pipeline as a Prefect flow: one task per DVC stage, in dvc.yaml's order.

Prefect schedules the pipeline and shows it (per-stage logs, metrics artifacts, retries); DVC
decides what is stale, so each task runs its stage through `dvc repro` and Prefect's own caching is
off; the stages before the first one that the run's opening `dvc status` calls stale are reported
cached without a DVC process each. Param overrides become one DVC experiment (`dvc exp run -S`)
instead of edits to params.yaml. Run once with `vlmrl run`, on a schedule with `vlmrl schedule
--cron "0 3 * * *"` (served there), or by a worker on the GPU machine with `vlmrl schedule --pool
gpu` (docs/prefect.md). A training stage over several machines is one `node` run per machine
(`vlmrl schedule --pool gpu --node RANK` in each machine's clone), started together by `nodes`
(`vlmrl run --nodes N --pool gpu`); those commands set the project's offline defaults for Prefect
(`vlmrl.pipeline.orchestration.set_offline_defaults`) before Prefect is imported. Importing this
file from Python imports Prefect with the environment as it is."""

from __future__ import annotations

from typing import Any

from prefect import Task, flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from vlmrl.pipeline.artifacts import stage_artifacts, stage_table
from vlmrl.pipeline.nodes import (
    NodeOutcome,
    node_name,
    nodes_state,
    pull_inputs,
    push_outputs,
    start_nodes,
    summary,
    train_on_node,
    wait_for_nodes,
)
from vlmrl.pipeline.orchestration import (
    PipelineReport,
    StageReport,
    resolve_repo,
    run_experiment,
    run_stage,
    select_stages,
    unchanged_prefix,
)


def publish_artifacts(stage: str, repo: str) -> None:
    for key, markdown, description in stage_artifacts(stage, resolve_repo(repo)):
        create_markdown_artifact(markdown=markdown, key=key, description=description)


def stage_task(stage: str, **options: Any) -> Task[[str, bool], StageReport]:
    def run(repo: str, known_up_to_date: bool = False) -> StageReport:
        logger = get_run_logger()
        report = run_stage(stage, resolve_repo(repo), logger.info, known_up_to_date)
        logger.info("stage '%s': %s in %.1f s", stage, report.outcome.value, report.seconds)
        publish_artifacts(stage, repo)
        return report

    run.__name__ = run.__qualname__ = stage  # Prefect keys tasks by function name
    return task(run, name=stage, cache_policy=NO_CACHE, **options)


prepare_data = stage_task("prepare_data")
sft_cold_start = stage_task("sft_cold_start")
baseline_eval = stage_task("baseline_eval")
train_gspo = stage_task("train_gspo")
post_eval = stage_task("post_eval")
verify_lora = stage_task("verify_lora")
export = stage_task("export")
upload = stage_task("upload", retries=2, retry_delay_seconds=10)  # S3 only; never GPU stages

PIPELINE = (prepare_data, sft_cold_start, baseline_eval, train_gspo, post_eval, verify_lora,
            export, upload)
STAGE_NAMES = tuple(stage.name for stage in PIPELINE)


@task(name="dvc-experiment", cache_policy=NO_CACHE)
def experiment(stages: list[str], overrides: dict[str, Any], repo: str) -> PipelineReport:
    logger = get_run_logger()
    report = run_experiment(stages, overrides, resolve_repo(repo), logger.info)
    logger.info("DVC experiment %s: %s", report.experiment, report.outcomes)
    for stage in stages:
        publish_artifacts(stage, repo)
    return report


@flow(name="vlmrl-pipeline")
def pipeline(stages: list[str] | None = None, repo: str | None = None,
             overrides: dict[str, Any] | None = None) -> PipelineReport:
    """Reproduces the selected DVC stages (default: all) of the project in `repo` (default: the
    current directory); `overrides` ({"train.grpo.learning_rate": 1e-4}) run as a DVC experiment."""
    selected = select_stages(stages, STAGE_NAMES)
    repo = str(resolve_repo(repo))
    if overrides:
        report = experiment(selected, overrides, repo)
    else:
        unchanged = unchanged_prefix(resolve_repo(repo), selected)
        report = PipelineReport([stage(repo, stage.name in unchanged)
                                 for stage in PIPELINE if stage.name in selected])
    create_table_artifact(table=stage_table(report.stages), key="pipeline-stages",
                          description="What DVC did with each stage: ran, cached or restored")
    return report


# --- one training stage over several machines (vlmrl.pipeline.nodes) ----------------------------


def node_log(rank: int, count: int):
    """The run logger, each line marked with the node it comes from."""
    logger = get_run_logger()
    return lambda line: logger.info("[%s] %s", node_name(rank, count), line)


@task(name="pull-inputs", cache_policy=NO_CACHE)
def pull_node_inputs(stage: str, rank: int, count: int, repo: str) -> list[str]:
    return pull_inputs(stage, resolve_repo(repo), node_log(rank, count))


@task(name="train", cache_policy=NO_CACHE)
def train_node(stage: str, rank: int, count: int, repo: str) -> str:
    return train_on_node(stage, resolve_repo(repo), rank, count, node_log(rank, count))


@task(name="push-outputs", cache_policy=NO_CACHE)
def push_node_outputs(stage: str, rank: int, count: int, repo: str) -> int | None:
    return push_outputs(stage, resolve_repo(repo), rank, node_log(rank, count))


@flow(name="vlmrl-node", flow_run_name="{stage}-node-{rank}-of-{count}")
def node(stage: str, rank: int, count: int, repo: str | None = None) -> State:
    """Node `rank` of `count` machines training `stage` together, in this clone: node 0 under
    DVC (recorded and pushed), the others outside it; its state's message says what it did."""
    repo = str(resolve_repo(repo))
    pull_node_inputs(stage, rank, count, repo)
    outcome = train_node(stage, rank, count, repo)
    pushed = push_node_outputs(stage, rank, count, repo)
    return Completed(message=summary(stage, outcome, pushed))


@task(name="start-nodes", cache_policy=NO_CACHE)
def start_node_runs(stage: str, count: int, pool: str) -> list[str]:
    return start_nodes(stage, count, pool)


@task(name="wait-for-nodes", cache_policy=NO_CACHE)
def wait_for_node_runs(count: int, runs: list[str]) -> list[NodeOutcome]:
    return wait_for_nodes(count, runs, get_run_logger().info)


@flow(name="vlmrl-nodes")
def nodes(stage: str, count: int, pool: str) -> State:
    """`stage` on `count` machines at once: one `node` run for each of the nodes registered on
    work pool `pool`, each given its rank; fails when one of them fails, with a line per node."""
    runs = start_node_runs(stage, count, pool)
    outcomes = wait_for_node_runs(count, runs)
    return nodes_state(outcomes)
