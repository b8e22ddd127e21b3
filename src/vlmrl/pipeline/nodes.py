"""One training stage over several machines, from the pipeline: what each machine (node) does,
and the Prefect runs that start every node at once.

Every node works in its own clone of the project at the same commit, with the same DVC remote.
Node 0 (the main machine, where the global rank 0 writes the outputs) pulls the stage's inputs
from the remote, reproduces the stage with DVC (so that dvc.lock records it) and pushes its
outputs; every other node pulls the inputs and runs the stage's command from dvc.yaml outside
DVC, with its rank: its processes write nothing, and DVC records nothing there. The stage's
launcher on each machine meets the others before training and stops with one line naming a
node that fails or never comes (vlmrl.distributed.nodes); where DVC has the stage up to date on
node 0, node 0 only tells the others so.

`vlmrl node` runs one node's part by hand (a Slurm job step, an SSH session). With Prefect,
`vlmrl schedule --pool P --node R` registers a clone as node R of work pool P (a deployment on
the pool's work queue `node-R`, run in that clone), and `vlmrl run --nodes N --pool P` starts
one flow run per node at once, passes each its rank, waits for all of them and fails when one
fails."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl.pipeline.commands import CommandResult, resolve_repo, stream_command
from vlmrl.pipeline.dvc_records import read_locks, read_records

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment
    from prefect.states import State

NODE_STAGES = ("sft_cold_start", "train_gspo")  # the stages that train.distributed launches
DEFAULT_NODE_STAGE = "train_gspo"
NODE_FLOW, NODE_FLOW_NAME = "node", "vlmrl-node"  # flows/pipeline.py's function and flow name
NODES_FLOW = "nodes"
# What the stage's launcher reads (vlmrl.distributed.settings): the machine count and this
# machine's rank, and, on node 0, that DVC has the stage up to date.
COUNT_ENV, RANK_ENV, UP_TO_DATE_ENV = "NNODES", "NODE_RANK", "VLMRL_NODES_UP_TO_DATE"
POLL_SECONDS = 2.0
FINAL = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})


class NodeFailed(RuntimeError):
    """A node's step failed; the message is one line naming the node and why."""


def node_name(rank: int, count: int) -> str:
    return f"node {rank} of {count}"


def check_node_stage(stage: str) -> None:
    if stage not in NODE_STAGES:
        raise ValueError(f"{stage} runs on one machine; the stages that train over several "
                         f"are {', '.join(NODE_STAGES)}")


# ------------------------------------------------------------------ one node's part


def dvc_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def stage_of(repo: Path, stage: str) -> tuple[Any, dict[str, str]]:
    """The stage as DVC reads dvc.yaml (its vars filled in), and every stage's outputs."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        stages = {found.name: found for found in dvc.index.stages}
        if stage not in stages:
            raise ValueError(f"{repo}/dvc.yaml has no stage {stage}")
        return stages[stage], {str(out.fs_path): found.name for found in stages.values()
                               for out in found.outs}


def input_targets(repo: Path, stage: str) -> dict[str, str]:
    """The stage's dependencies that other stages write (the DVC-tracked inputs every node
    pulls): path as dvc.yaml names it -> the stage that writes it."""
    found, outs = stage_of(repo, stage)
    targets = {}
    for dep in found.deps:
        path = str(dep.fs_path)
        writer = next((name for out, name in outs.items()
                       if path == out or path.startswith(out.rstrip("/") + "/")), None)
        if writer is not None and writer != stage:
            targets[dep.def_path] = writer
    return targets


def stage_command(repo: Path, stage: str) -> list[str]:
    """The stage's command from dvc.yaml, as argv: what the other nodes run outside DVC."""
    import shlex

    return shlex.split(stage_of(repo, stage)[0].cmd)


def pull_inputs(stage: str, repo: Path, log: Callable[[str], None]) -> list[str]:
    """`dvc pull` of the stage's inputs: the outputs dvc.lock records for the stages that write
    them, at this node's commit. Returns the paths pulled."""
    targets = input_targets(repo, stage)
    unrecorded = sorted({writer for writer in targets.values() if writer not in read_locks(repo)})
    if unrecorded:
        raise NodeFailed(f"dvc.lock at this commit does not record {', '.join(unrecorded)}, "
                         f"which {stage} reads: run it on one machine, commit dvc.lock, "
                         "`dvc push`, and check that commit out on every node")
    if not targets:
        return []
    log(f"$ dvc pull {' '.join(targets)}  (in {repo})")
    check(stream_command(dvc_command("pull", *targets), repo, lambda _s, line: log(line)),
          f"dvc pull of {stage}'s inputs")
    return list(targets)


def train_on_node(stage: str, repo: Path, rank: int, count: int,
                  log: Callable[[str], None]) -> str:
    """This node's share of the stage; returns what happened: `ran` (node 0, under DVC),
    `cached` (node 0: DVC has it up to date; the others were told) or `trained` (another node,
    outside DVC)."""
    env = {COUNT_ENV: str(count), RANK_ENV: str(rank)}
    if rank > 0:
        command, outcome = stage_command(repo, stage), "trained"
    elif stage in read_records(repo, [stage]).stale:
        command, outcome = dvc_command("repro", "--single-item", "--no-run-cache", stage), "ran"
    else:
        command, outcome = stage_command(repo, stage), "cached"
        env[UP_TO_DATE_ENV] = "1"
    log(f"$ {' '.join(command[2:] if command[0] == sys.executable else command)}  "
        f"(in {repo}; {COUNT_ENV}={count} {RANK_ENV}={rank})")
    own: list[str] = []  # the stage's one-line error, however much its workers print after it

    def on_line(_stream: str, line: str) -> None:
        if f"{stage} failed" in line:  # after a progress bar's last update, on its line
            own.append(line[line.index(f"{stage} failed"):])
        log(line)

    check(stream_command(command, repo, on_line, env), stage, own)
    return outcome


def push_outputs(stage: str, repo: Path, rank: int, log: Callable[[str], None]) -> int | None:
    """Node 0: `dvc push` of the stage's outputs, so any machine gets them with `dvc pull`;
    returns how many files went up (None on the other nodes, which have nothing to push)."""
    if rank > 0:
        log(f"node {rank} wrote none of {stage}'s outputs: node 0 pushes them")
        return None
    log(f"$ dvc push {stage}  (in {repo})")
    result = check(stream_command(dvc_command("push", stage), repo, lambda _s, line: log(line)),
                   f"dvc push of {stage}'s outputs")
    counted = [re.match(r"(\d+) files? pushed", line) for line in result.stdout]
    return next((int(match.group(1)) for match in counted if match), 0)


def check(result: CommandResult, what: str, own: Sequence[str] = ()) -> CommandResult:
    """`result`, or NodeFailed with one line: the stage's own `<stage> failed: ...` line where
    it printed one (`own`), else how the command ended and its last line."""
    if result.returncode == 0:
        return result
    if own:
        raise NodeFailed(own[-1])
    if result.returncode < 0:
        raise NodeFailed(f"{what} was killed (signal {-result.returncode})")
    lines = [line.strip() for line in [*result.stdout, *result.stderr_tail] if line.strip()]
    raise NodeFailed(f"{what} ended with exit code {result.returncode}: "
                     f"{lines[-1] if lines else 'no output'}")


def summary(stage: str, outcome: str, pushed: int | None) -> str:
    """One line on what a node did, for `vlmrl run` and the node's flow run."""
    if outcome == "trained":
        return f"{stage}'s command ran outside DVC; nothing written here"
    done = "ran under DVC" if outcome == "ran" else "was up to date in DVC"
    return f"{stage} {done}; recorded in dvc.lock, {pushed} file(s) pushed to the DVC remote"


def run_node(stage: str, repo: Path, rank: int, count: int,
             log: Callable[[str], None]) -> str:
    """One node's whole part, in order (what `vlmrl node` runs); returns its summary."""
    pull_inputs(stage, repo, log)
    outcome = train_on_node(stage, repo, rank, count, log)
    return summary(stage, outcome, push_outputs(stage, repo, rank, log))


def cli_node(argv: list[str]) -> int:
    """Runs one machine's part of a training stage over several machines, here and now (one
    per machine, all started together: a Slurm job step, an SSH session). Node 0 pulls the
    stage's inputs with DVC, reproduces the stage with `dvc repro` and pushes its outputs; every
    other node pulls the inputs and runs the stage's command outside DVC. MASTER_ADDR and
    MASTER_PORT (or params.yaml's train.distributed) name the main machine."""
    parser = argparse.ArgumentParser(prog="vlmrl node", description=cli_node.__doc__)
    parser.add_argument("--rank", type=int, required=True,
                        help="this machine's rank, 0 for the main machine (required)")
    parser.add_argument("--nodes", type=int, required=True,
                        help="machines training together (required)")
    parser.add_argument("--stage", default=DEFAULT_NODE_STAGE, choices=NODE_STAGES,
                        help=f"the training stage (default: {DEFAULT_NODE_STAGE})")
    parser.add_argument("--repo", type=Path, default=None,
                        help="this machine's clone of the project (default: current directory)")
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.rank < args.nodes:
            raise ValueError(f"--rank {args.rank} must be in 0..{args.nodes - 1} (--nodes "
                             f"{args.nodes})")
        repo = resolve_repo(args.repo)
        print(run_node(args.stage, repo, args.rank, args.nodes, print))
    except (NodeFailed, ValueError, FileNotFoundError) as error:
        print(f"vlmrl node: {error}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ Prefect: every node at once


def node_deployment_name(pool: str, rank: int) -> str:
    return f"{pool}-node-{rank}"


def node_queue(rank: int) -> str:
    return f"node-{rank}"


def node_deployment(pool: str, rank: int, repo: str | Path | None = None) -> RunnerDeployment:
    """The node flow of this clone as node `rank` of `pool`: on the pool's queue `node-<rank>`,
    which only this machine's worker polls, and run in this clone (its pull step)."""
    from prefect.deployments.runner import RunnerDeployment
    from prefect.runner.storage import LocalStorage

    path = resolve_repo(repo)
    return RunnerDeployment.from_storage(
        LocalStorage(str(path)), entrypoint=f"flows/pipeline.py:{NODE_FLOW}",
        name=node_deployment_name(pool, rank), work_pool_name=pool,
        work_queue_name=node_queue(rank), parameters={"rank": rank, "repo": str(path)},
        tags=["vlmrl"], description=f"Node {rank} of a training run over several machines, in "
                                    f"{path}")


def check_nodes_registered(pool: str, count: int) -> None:
    """Every node's deployment exists, else ValueError naming the missing ones."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    missing = []
    with get_client(sync_client=True) as client:
        for rank in range(count):
            try:
                client.read_deployment_by_name(
                    f"{NODE_FLOW_NAME}/{node_deployment_name(pool, rank)}")
            except ObjectNotFound:
                missing.append(rank)
    if missing:
        ranks = ", ".join(map(str, missing))
        raise ValueError(f"work pool {pool} has no node {ranks}: in that machine's clone run "
                         f"`vlmrl schedule --pool {pool} --node RANK` and start its worker "
                         f"(prefect worker start --pool {pool} --work-queue node-RANK)")


def start_nodes(stage: str, count: int, pool: str) -> list[str]:
    """One flow run per node, all created at once (their workers start them as they poll);
    returns their ids, node 0 first."""
    from prefect.deployments import run_deployment

    runs = [run_deployment(f"{NODE_FLOW_NAME}/{node_deployment_name(pool, rank)}",
                           parameters={"stage": stage, "rank": rank, "count": count},
                           flow_run_name=f"{stage}-node-{rank}-of-{count}", timeout=0)
            for rank in range(count)]
    return [str(run.id) for run in runs]


@dataclass(frozen=True)
class NodeOutcome:
    rank: int
    count: int
    state: str  # Prefect's state type: COMPLETED, FAILED, CRASHED, CANCELLED
    seconds: float
    message: str

    @property
    def line(self) -> str:
        return (f"{node_name(self.rank, self.count):<12} {self.state.lower():<10}"
                f"{self.seconds:7.1f} s  {self.message}")


def wait_for_nodes(count: int, run_ids: Sequence[str],
                   log: Callable[[str], None]) -> list[NodeOutcome]:
    """Until every node's run has ended, saying when each starts and ends; a run that has not
    started when another failed is cancelled (the running ones stop by themselves within the
    rendezvous timeout). Returns how each ended."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    seen: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        while True:
            runs = [client.read_flow_run(UUID(run_id)) for run_id in run_ids]
            for rank, run in enumerate(runs):
                if seen.get(run.id.hex) != run.state.name:
                    seen[run.id.hex] = run.state.name
                    log(f"{node_name(rank, count)}: {run.state.name.lower()}")
            failed = any(run.state.type.value in FINAL - {"COMPLETED"} for run in runs)
            for run in runs:
                if failed and run.state.type.value == "SCHEDULED":
                    client.set_flow_run_state(run.id, Cancelled(
                        message="another node failed before this one started"), force=True)
            if all(run.state.type.value in FINAL for run in runs):
                break
            time.sleep(POLL_SECONDS)
    return [NodeOutcome(rank, count, run.state.type.value, run_seconds(run),
                        state_line(run.state.message)) for rank, run in enumerate(runs)]


def nodes_state(outcomes: Sequence[NodeOutcome]) -> State:
    """The parent run's end: completed where every node's run completed, else failed; its
    message has a line per node."""
    from prefect.states import Completed, Failed

    message = "\n".join(outcome.line for outcome in outcomes)
    done = all(outcome.state == "COMPLETED" for outcome in outcomes)
    return Completed(message=message) if done else Failed(message=message)


def run_seconds(run: Any) -> float:
    return run.total_run_time.total_seconds() if run.total_run_time else 0.0


def state_line(message: str | None) -> str:
    """A node run's state message as one line: a failure's own line, without the names
    Prefect puts before it."""
    text = (message or "").strip()
    for marker in ("NodeFailed: ", "StageFailed: "):
        text = text.split(marker, 1)[-1]
    return " ".join(text.split())


def cli_run_nodes(args: argparse.Namespace, repo: Path) -> int:
    """`vlmrl run --nodes N --pool P`: the parent flow of the node runs, in this process."""
    import os

    from prefect.flows import load_flow_from_entrypoint

    stages = args.stages or [DEFAULT_NODE_STAGE]
    if len(stages) != 1:
        raise ValueError(f"--nodes runs one training stage at a time, got {','.join(stages)}: "
                         "the next one reads what this one records on node 0")
    stage = stages[0]
    check_node_stage(stage)
    if args.overrides:
        raise ValueError("--set does not go with --nodes: every node must run the same "
                         "params.yaml, so commit the change and check it out on every node")
    if not args.pool:
        raise ValueError("--nodes needs --pool: the work pool of the nodes' workers")
    if not os.environ.get("PREFECT_API_URL"):
        raise ValueError("--nodes needs the Prefect server the nodes' workers use: set "
                         "PREFECT_API_URL")
    check_nodes_registered(args.pool, args.nodes)
    nodes = load_flow_from_entrypoint(f"{repo / 'flows' / 'pipeline.py'}:{NODES_FLOW}")
    print(f"{stage} on {args.nodes} nodes of work pool {args.pool}:", flush=True)
    state = nodes(stage=stage, count=args.nodes, pool=args.pool, return_state=True)
    print(state.message or "", flush=True)
    if state.is_completed():
        print(f"{stage}'s outputs are recorded in node 0's dvc.lock and on the DVC remote: "
              f"commit dvc.lock there; on any machine, `git pull && dvc pull {stage}`")
        return 0
    print(f"vlmrl run: {stage} on {args.nodes} nodes failed", file=sys.stderr)
    return 1

