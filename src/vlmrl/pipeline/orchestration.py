"""Run, watch and schedule the DVC pipeline from Prefect, with DVC as the only judge of staleness.

Prefect gives users schedules, a UI with per-stage logs and artifacts, and retries; DVC already
knows which stages are stale from hashes of code, data and params. Letting both decide would make
them disagree, so every Prefect task here shells out to `dvc repro -s STAGE` (or one `dvc exp run`
when params are overridden, so an override is recorded as an experiment instead of silently editing
params.yaml), streams DVC's output into the task log, and reports what DVC did from DVC's own
records, read before and after the command (`vlmrl.pipeline.dvc_records`). Prefect's task caching stays
off.

This module holds everything except the flow itself (flows/pipeline.py, one task per stage), so
that the flow file reads like the pipeline and the logic here is testable without a flow run.
Prefect reads its settings when first imported, so this module imports it lazily and the CLI
entry points set the offline defaults (`set_offline_defaults`) first.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl.pipeline.commands import (  # resolve_repo and stream_command: the flows' too
    STDERR_TAIL_LINES,
    CommandResult,
    resolve_repo,
    stream_command,
)
from vlmrl.pipeline.dvc_records import (
    LockWatcher,
    Outcome,
    experiment_names,
    read_records,
    stage_outcomes,
    stage_seconds,
)
from vlmrl.pipeline.nodes import (
    NODE_FLOW_NAME,
    cli_run_nodes,
    node_deployment,
    node_deployment_name,
    node_queue,
)

if TYPE_CHECKING:
    from uuid import UUID

    from prefect import Flow
    from prefect.deployments.runner import RunnerDeployment
    from prefect.schedules import Cron

FLOW_FILE = Path("flows") / "pipeline.py"
FLOW_FUNCTION = "pipeline"
DEFAULT_DEPLOYMENT_NAME = "scheduled"

# Offline by default: the project never phones home unless the user asks for it.
OFFLINE_DEFAULTS = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "DVC_NO_ANALYTICS": "1",
    # `vlmrl run` without a server starts a temporary one; 20 s is too short on 2 busy cores.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def set_offline_defaults() -> None:
    """Sets `OFFLINE_DEFAULTS` where the user has not set them; call before importing Prefect,
    which reads its settings once, when first imported."""
    for name, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(name, value)


@dataclass(frozen=True)
class StageReport:
    stage: str
    outcome: Outcome
    seconds: float

    @property
    def ran(self) -> bool:
        return self.outcome is Outcome.RAN


@dataclass(frozen=True)
class PipelineReport:
    stages: list[StageReport]
    experiment: str | None = None

    @property
    def outcomes(self) -> dict[str, str]:
        return {report.stage: report.outcome.value for report in self.stages}


class StageFailed(RuntimeError):
    """A DVC command failed; the message carries the tail of its stderr."""


def format_override(key: str, value: Any) -> str:
    """One `-S key=value`; non-strings as JSON, which DVC parses back to the same YAML value."""
    text = value if isinstance(value, str) else json.dumps(value)
    return f"{key}={text}"


def repro_command(stage: str) -> list[str]:
    return [sys.executable, "-m", "dvc", "repro", "--single-item", stage]


def experiment_command(stages: Sequence[str], overrides: Mapping[str, Any]) -> list[str]:
    settings = [arg for key, value in overrides.items()
                for arg in ("-S", format_override(key, value))]
    return [sys.executable, "-m", "dvc", "exp", "run", "--single-item", *settings, *stages]


def _failure_message(what: str, result: CommandResult) -> str:
    tail = "\n".join(result.stderr_tail) or "\n".join(result.stdout[-STDERR_TAIL_LINES:])
    return f"{what} failed with exit code {result.returncode}:\n{tail}"


# --- what the flow's tasks call -----------------------------------------------------------------


def run_stage(stage: str, repo: Path, log: Callable[[str], None],
              known_up_to_date: bool = False) -> StageReport:
    """`dvc repro --single-item STAGE` in repo, its output sent to log line by line.

    Args:
        known_up_to_date: the flow's `dvc status` at its start called this stage and every one
            before it up to date, so nothing can have changed its inputs since: the stage is
            reported cached without another DVC process (each costs about a second and a half).
    """
    if known_up_to_date:
        log(f"{stage}: up to date (dvc status at the start of the run)")
        return StageReport(stage, Outcome.CACHED, 0.0)
    started = time.monotonic()
    before = read_records(repo, [stage])
    log(f"$ dvc repro --single-item {stage}  (in {repo})")
    result = stream_command(repro_command(stage), repo, lambda _stream, line: log(line))
    if result.returncode != 0:
        raise StageFailed(_failure_message(f"stage '{stage}'", result))
    outcome = stage_outcomes(before, read_records(repo), [stage])[stage]
    return StageReport(stage, outcome, time.monotonic() - started)


def run_experiment(stages: Sequence[str], overrides: Mapping[str, Any], repo: Path,
                   log: Callable[[str], None]) -> PipelineReport:
    """One `dvc exp run -S ... --single-item STAGES`: the overrides land in a named experiment."""
    cmd = experiment_command(stages, overrides)
    # `dvc exp run` checks the outputs out before it reproduces, so staleness before it says
    # nothing about what it does: only dvc.lock changes count.
    before, experiments = read_records(repo), experiment_names(repo)
    watcher = LockWatcher(repo, before.locks)
    log("$ dvc " + " ".join(cmd[3:]) + f"  (in {repo})")
    started = time.monotonic()

    def on_line(_stream: str, line: str) -> None:
        watcher.poll()
        log(line)

    result = stream_command(cmd, repo, on_line)
    if result.returncode != 0:
        raise StageFailed(_failure_message(f"experiment over {', '.join(stages)}", result))
    watcher.poll()
    outcomes = stage_outcomes(before, read_records(repo), stages)
    seconds = stage_seconds(stages, started, watcher.finished)
    new = sorted(experiment_names(repo) - experiments)
    reports = [StageReport(stage, outcomes[stage], seconds[stage]) for stage in stages]
    return PipelineReport(reports, new[0][0] if len(new) == 1 else None)


def select_stages(requested: Iterable[str] | None, pipeline: Sequence[str]) -> list[str]:
    """The requested stages in pipeline order (all when none are given); unknown names fail."""
    if requested is None:
        return list(pipeline)
    wanted = {name.strip() for name in requested if name.strip()}
    unknown = sorted(wanted - set(pipeline))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; the pipeline has {list(pipeline)}")
    if not wanted:
        raise ValueError("no stages selected")
    return [stage for stage in pipeline if stage in wanted]


# --- loading the flow, deployments, CLI ---------------------------------------------------------


def load_pipeline_flow(repo: str | Path | None = None) -> Flow:
    """The flow defined in REPO/flows/pipeline.py (the repo's own copy, like its dvc.yaml)."""
    from prefect.flows import load_flow_from_entrypoint

    path = resolve_repo(repo) / FLOW_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no Prefect flow at {path}")
    return load_flow_from_entrypoint(f"{path}:{FLOW_FUNCTION}")


def pipeline_deployment(name: str, cron: str | None, repo: str | Path | None = None,
                        stages: list[str] | None = None,
                        overrides: dict[str, Any] | None = None,
                        timezone: str | None = None,
                        work_pool: str | None = None) -> RunnerDeployment:
    """A deployment of the pipeline flow (on a cron schedule unless cron is None), its code read
    from the repo. With a work pool, its pull step sets the working directory to the repo, so a
    worker of that pool runs it there: on the machine where the repo lives at that path."""
    from prefect.deployments.runner import RunnerDeployment

    path = resolve_repo(repo)
    parameters: dict[str, Any] = {"repo": str(path)}
    if stages is not None:
        parameters["stages"] = stages
    if overrides:
        parameters["overrides"] = overrides
    when = f"on cron '{cron}'" if cron else "run on demand"
    options: dict[str, Any] = {
        "name": name, "schedule": cron_schedule(cron, timezone), "parameters": parameters,
        "tags": ["vlmrl"], "description": f"The vlmrl DVC pipeline in {path}, {when}"}
    if work_pool:
        from prefect.runner.storage import LocalStorage

        return RunnerDeployment.from_storage(
            LocalStorage(str(path)), entrypoint=f"{FLOW_FILE.as_posix()}:{FLOW_FUNCTION}",
            work_pool_name=work_pool, **options)
    with contextlib.chdir(path):  # the deployment's code path is the current directory
        return RunnerDeployment.from_entrypoint(
            entrypoint=f"{path / FLOW_FILE}:{FLOW_FUNCTION}", **options)


def cron_schedule(cron: str | None, timezone: str | None) -> Cron | None:
    from prefect.schedules import Cron

    if cron is None:
        return None
    return Cron(cron, timezone=timezone) if timezone else Cron(cron)


def ensure_process_pool(name: str) -> None:
    """Creates a process work pool of that name unless one exists (of any type)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(
            WorkPoolCreate(name=name, type=ProcessWorker.type, base_job_template=template))


def register_deployment(name: str, cron: str | None, repo: str | Path | None = None,
                        stages: list[str] | None = None,
                        overrides: dict[str, Any] | None = None,
                        timezone: str | None = None, work_pool: str | None = None) -> UUID:
    """Creates or updates the deployment and its schedule without serving it; returns its id.
    Without a work pool, runs are only executed while `vlmrl schedule` (or a served copy) is
    running; with one, by a worker of that pool (`prefect worker start --pool NAME`), which is
    created as a process pool if it does not exist."""
    if work_pool:
        ensure_process_pool(work_pool)
    return pipeline_deployment(name, cron, repo, stages, overrides, timezone, work_pool).apply()


def parse_overrides(pairs: Iterable[str]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--set takes key=value, got {pair!r}")
        overrides[key.strip()] = value
    return overrides


def _common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", type=Path, default=None,
                        help="project repo with dvc.yaml (default: current directory)")
    parser.add_argument("--stages", type=lambda text: text.split(","), default=None,
                        help="comma-separated stages to run, in pipeline order (default: all)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="param override, recorded as a DVC experiment; repeatable "
                             "(default: none, params.yaml as it is)")


def cli_run(argv: list[str]) -> int:
    """Runs the pipeline flow once and prints what each stage did (`vlmrl run`). Without
    PREFECT_API_URL, Prefect starts a temporary server for this run (unless DVC says every stage
    is up to date: then nothing runs and no server starts), and the Prefect UI shows the run
    only while it lasts; set PREFECT_API_URL to a running server (`prefect server start`) to
    keep its history there."""
    set_offline_defaults()
    parser = argparse.ArgumentParser(prog="vlmrl run", description=cli_run.__doc__)
    _common_options(parser)
    parser.add_argument("--nodes", type=int, default=1, metavar="N",
                        help="machines that train one stage together (--stages: sft_cold_start "
                             "or train_gspo, default train_gspo): one run on each node of "
                             "--pool at once, given its rank (default: 1, the pipeline here)")
    parser.add_argument("--pool", default=None, metavar="WORK_POOL",
                        help="with --nodes: the work pool whose nodes train, each registered "
                             "with `vlmrl schedule --pool WORK_POOL --node RANK` (default: none)")
    args = parser.parse_args(argv)
    if args.nodes != 1 or args.pool:
        return run_on_nodes(args)
    repo, overrides = resolve_repo(args.repo), parse_overrides(args.overrides)
    if not overrides and not os.environ.get("PREFECT_API_URL") and up_to_date(repo, args.stages):
        # Nothing to run and no server to keep the run: no temporary Prefect server is started.
        print_report(PipelineReport([StageReport(stage, Outcome.CACHED, 0.0)
                                     for stage in select_stages(args.stages, dvc_stages(repo))]))
        print("every stage is up to date; no Prefect server was started")
        return 0
    pipeline = load_pipeline_flow(args.repo)
    state = pipeline(stages=args.stages, repo=str(repo), overrides=overrides or None,
                     return_state=True)
    if not state.is_completed():
        print(f"pipeline {state.name.lower()}: {state.message}", file=sys.stderr)
        return 1
    print_report(state.result())
    return 0


def run_on_nodes(args: argparse.Namespace) -> int:
    """`vlmrl run --nodes N --pool P` (vlmrl.pipeline.nodes); bad input is one line, status 1."""
    try:
        if args.nodes < 2:
            raise ValueError(f"--nodes {args.nodes}: a run over several machines takes 2 or "
                             "more (--pool goes with it)")
        return cli_run_nodes(args, resolve_repo(args.repo))
    except (ValueError, FileNotFoundError) as error:
        print(f"vlmrl run: {error}", file=sys.stderr)
        return 1


def dvc_stages(repo: Path) -> list[str]:
    """The stages of the repo's dvc.yaml, in its order."""
    import yaml

    return list(yaml.safe_load((repo / "dvc.yaml").read_text(encoding="utf-8"))["stages"])


def up_to_date(repo: Path, stages: Sequence[str] | None) -> bool:
    """Whether DVC would reproduce none of the selected stages (`dvc status`)."""
    selected = select_stages(stages, dvc_stages(repo))
    return len(unchanged_prefix(repo, selected)) == len(selected)


def unchanged_prefix(repo: Path, stages: Sequence[str]) -> set[str]:
    """The stages, in order, before the first one `dvc status` calls stale: no stage before them
    runs, so their inputs stay as they are and `dvc repro` would skip them. A stage after a stale
    one may go stale once that one runs, so the rest are left to `dvc repro`."""
    stale = read_records(repo, stages).stale
    return set(itertools.takewhile(lambda stage: stage not in stale, stages))


def print_report(report: PipelineReport) -> None:
    """What DVC did with each stage, a line each, and the experiment it recorded."""
    for stage in report.stages:
        print(f"{stage.stage:<14} {stage.outcome.value:<9} {stage.seconds:7.1f} s")
    if report.experiment:
        print(f"DVC experiment: {report.experiment}")


def cli_schedule(argv: list[str]) -> int:
    """Registers a deployment on the schedule --cron gives and serves it (blocks; the scheduled
    runs execute in this process's children until it is stopped). With --pool NAME it registers
    the deployment on that process work pool instead and returns; a worker on the machine that
    holds the repo (`prefect worker start --pool NAME`) runs what is scheduled."""
    set_offline_defaults()
    parser = argparse.ArgumentParser(prog="vlmrl schedule", description=cli_schedule.__doc__)
    parser.add_argument("--cron", default=None,
                        help='cron expression, e.g. "0 3 * * *"; required without --pool, '
                             "optional with it (default: none, runs start from the UI or API)")
    parser.add_argument("--pool", default=None, metavar="WORK_POOL",
                        help="register on this Prefect work pool (created as a process pool if "
                             "missing) instead of serving (default: none, serve here)")
    parser.add_argument("--name", default=DEFAULT_DEPLOYMENT_NAME,
                        help=f"Prefect deployment name (default: {DEFAULT_DEPLOYMENT_NAME})")
    parser.add_argument("--timezone", default=None, help="IANA zone of the cron (default UTC)")
    parser.add_argument("--node", type=int, default=None, metavar="RANK",
                        help="with --pool: register this clone as node RANK of a training run "
                             "over several machines (`vlmrl run --nodes`), run by a worker of "
                             "the pool's queue node-RANK (default: none, the pipeline)")
    _common_options(parser)
    args = parser.parse_args(argv)
    if args.cron is None and args.pool is None:
        parser.error("--cron is required unless --pool is given")
    repo = resolve_repo(args.repo)
    if args.node is not None:
        return schedule_node(args, repo)
    overrides = parse_overrides(args.overrides) or None
    if args.pool:
        deployment_id = register_deployment(args.name, args.cron, repo, args.stages, overrides,
                                            args.timezone, args.pool)
        print(f"deployment vlmrl-pipeline/{args.name} ({deployment_id}) on work pool "
              f"'{args.pool}', running in {repo}; start a worker where that path holds the "
              f"repo: prefect worker start --pool {args.pool}")
        return 0
    from prefect import serve

    deployment = pipeline_deployment(args.name, args.cron, repo, args.stages, overrides,
                                     args.timezone)
    # Scheduled runs start in this process's directory, which must be the deployment's code path.
    os.chdir(repo)
    serve(deployment, limit=1)
    return 0


def schedule_node(args: argparse.Namespace, repo: Path) -> int:
    """`vlmrl schedule --pool P --node R`: this clone as node R of pool P (vlmrl.pipeline.nodes)."""
    unused = [flag for flag, value in (("--cron", args.cron), ("--stages", args.stages),
                                       ("--set", args.overrides), ("--timezone", args.timezone))
              if value]
    problem = (f"--node {args.node}: a rank is 0 or more" if args.node < 0 else
               f"{', '.join(unused)}: not with --node (`vlmrl run --nodes` starts the node "
               "runs and picks the stage)" if unused else None)
    if problem:
        print(f"vlmrl schedule: {problem}", file=sys.stderr)
        return 1
    ensure_process_pool(args.pool)
    deployment_id = node_deployment(args.pool, args.node, repo).apply()
    print(f"deployment {NODE_FLOW_NAME}/{node_deployment_name(args.pool, args.node)} "
          f"({deployment_id}) on work pool '{args.pool}', queue {node_queue(args.node)}, running "
          f"in {repo}; start this machine's worker: prefect worker start --pool {args.pool} "
          f"--work-queue {node_queue(args.node)} --limit 1")
    return 0
