"""Two machines on one: `vlmrl run --nodes 2` trains train_gspo over two "nodes" on 127.0.0.1, each
a clone of the project with its own Prefect process worker, the data travelling through a DVC
remote on a local S3 (moto's server), the processes meeting over gloo, one per node. Nothing is
mocked: real git and DVC repos, a real `prefect server`, real workers, real training of the
embedded model.

It checks that (a) both ranks took part (the global batch was split over the two nodes' processes,
and node 1 wrote nothing), (b) the adapter and the train log equal those of a one-machine run of
two processes with the same params (exactly, as the two-process evaluation equals one process's
in tests/test_distributed.py), (c) the second clone gets the adapter with `dvc pull`, and (d)
killing node 1 mid-run stops node 0 with one line naming it, and DVC records and pushes nothing.

Both nodes and the one-machine run use one thread per process (OMP_NUM_THREADS=1, which torchrun
sets itself only for several processes on a machine), so that their matmuls add in one order."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import TEST_PARAMS, make_project_repo, run, update_params
from prefect_server import (
    Api,
    background,
    offline_prefect,  # noqa: F401 (an autouse fixture)
    prefect_command,
    prefect_env,
    prefect_server,
)
from s3_server import TEST_ACCESS_KEY, TEST_SECRET_KEY, MotoServer, start_moto_server
from test_nodes import free_pair

POOL = "loopback-pool"
BUCKET = "vlmrl-nodes"
AUDIT_SITE = Path(__file__).parent / "write_audit"
# TEST_PARAMS' 4 GSPO steps of a global batch of 4 over 2 processes, without the cold start
NODE_PARAMS = {**TEST_PARAMS, "sft.enabled": False, "train.distributed.num_processes": 2,
               "train.distributed.strategy": "ddp", "train.distributed.rdzv_timeout": 120}
STAGE = "train_gspo"
ADAPTER = Path("data/models/adapter/adapter_model.safetensors")
TRAIN_LOG = Path("data/metrics/train_log.json")
RUN_OUTPUT = "vlmrl-run-nodes-2.txt"  # what `vlmrl run --nodes 2` printed, kept for the docs


@dataclass
class Cluster:
    node0: Path
    node1: Path
    one_machine: Path
    api: Api
    env: dict[str, str]  # the client's: `vlmrl run` and the test's own DVC commands
    s3: MotoServer
    audit: Path
    logs: Path


def s3_env() -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1", "OMP_NUM_THREADS": "1"}


def git(repo: Path, *args: str) -> str:
    return run(["git", *args], repo).stdout


def data_files(repo: Path) -> set[str]:
    return {str(path.relative_to(repo)) for path in (repo / "data").rglob("*") if path.is_file()}


def remote_objects(s3: MotoServer) -> int:
    listed = s3.client().list_objects_v2(Bucket=BUCKET)
    return listed.get("KeyCount", 0)


def first_project(target: Path, s3: MotoServer, env: dict[str, str]) -> Path:
    """Node 0's clone: the project with its DVC remote on the S3 server, the stages before
    train_gspo run and recorded, pushed, committed."""
    repo = make_project_repo(target, NODE_PARAMS)
    run(["dvc", "remote", "add", "-d", "storage", f"s3://{BUCKET}/dvcstore"], repo)
    run(["dvc", "remote", "modify", "storage", "endpointurl", s3.endpoint_url], repo)
    run(["dvc", "repro", "prepare_data", "sft_cold_start"], repo, env=env)
    run(["dvc", "push"], repo, env=env)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "the DVC remote; prepare_data and sft_cold_start recorded")
    return repo


def start_worker(stack: ExitStack, repo: Path, rank: int, env: dict[str, str],
                 logs: Path) -> subprocess.Popen:
    registered = run([sys.executable, "-m", "vlmrl.cli", "schedule", "--pool", POOL,
                      "--node", str(rank)], repo, env=env, timeout=300)
    assert f"--work-queue node-{rank} --limit 1" in registered.stdout
    command = prefect_command("worker", "start", "--pool", POOL, "--work-queue",
                              f"node-{rank}", "--limit", "1")
    return stack.enter_context(background(command, logs / f"worker-{rank}.log", env, cwd=repo))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("nodes")
    logs = base / "logs"
    logs.mkdir()
    with ExitStack() as stack:
        s3 = start_moto_server(logs)
        stack.callback(s3.stop)
        s3.client().create_bucket(Bucket=BUCKET)
        (base / "prefect-server").mkdir()
        url = stack.enter_context(prefect_server(base / "prefect-server"))
        env = {**prefect_env(base / "client-home", url), **s3_env()}
        node0 = first_project(base / "node0", s3, env)
        node1, one_machine = base / "node1", base / "one-machine"
        for clone in (node1, one_machine):
            run(["git", "clone", "-q", str(node0), str(clone)], base)
        master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_pair())}
        audit = base / "audit"
        audit.mkdir()
        audited = {"PYTHONPATH": str(AUDIT_SITE), "VLMRL_WRITE_AUDIT": str(audit)}
        start_worker(stack, node0, 0, {**env, **master}, logs)
        start_worker(stack, node1, 1, {**env, **master, **audited}, logs)
        yield Cluster(node0, node1, one_machine, Api(url), env, s3, audit, logs)


@pytest.fixture(scope="module")
def one_machine(cluster: Cluster) -> Path:
    """The same stage, same params, two processes on one machine: a plain `dvc repro`."""
    repo = cluster.one_machine
    run(["dvc", "pull", "data/prepared/train", "data/models/sft"], repo, env=cluster.env)
    result = run(["dvc", "repro", "--single-item", STAGE], repo, env=cluster.env)
    assert "launching 2 process(es) with ddp.yaml" in result.stdout
    return repo


@pytest.fixture(scope="module")
def two_nodes(cluster: Cluster, one_machine: Path) -> dict:
    """`vlmrl run --nodes 2` from node 0's clone: both workers train at once."""
    started = time.monotonic()
    result = run([sys.executable, "-m", "vlmrl.cli", "run", "--nodes", "2", "--pool", POOL],
                 cluster.node0, env=cluster.env, timeout=900, check=False)
    seconds = time.monotonic() - started
    (cluster.logs / RUN_OUTPUT).write_text(result.stdout)
    print(f"\n$ vlmrl run --nodes 2 --pool {POOL}  ({seconds:.0f} s)\n{result.stdout}")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {run_["name"]: run_ for run_ in cluster.api.flow_runs("vlmrl-node")}
    return {"output": result.stdout, "runs": runs, "seconds": seconds}


@pytest.mark.slow
def test_both_ranks_took_part_and_node_1_wrote_nothing(cluster: Cluster, two_nodes: dict):
    lines = two_nodes["output"].splitlines()
    assert lines[0] == f"{STAGE} on 2 nodes of work pool {POOL}:"
    assert lines[1].startswith("node 0 of 2  completed")
    assert re.search(rf"{STAGE} ran under DVC; recorded in dvc.lock, \d+ file\(s\) pushed to "
                     "the DVC remote$", lines[1]), lines[1]
    assert lines[2].startswith("node 1 of 2  completed")
    assert lines[2].endswith(f"{STAGE}'s command ran outside DVC; nothing written here")
    batch = json.loads((cluster.node0 / "data/reports/details/train_gspo.json").read_text())[
        "batch"]
    assert (batch["num_processes"], batch["strategy"], batch["per_device_train_batch_size"]) == (
        2, "ddp", 2)  # the global batch of 4, split over the two nodes' processes
    assert batch["rows_per_process"] == [8, 8] and batch["prompts_in_several_processes"] == 0
    node1_run = two_nodes["runs"][f"{STAGE}-node-1-of-2"]
    logs = cluster.api.logs(node1_run["id"])
    assert any(line.startswith("[node 1 of 2] node 1 of 2: launching 1 of 2 process(es) with "
                               "ddp.yaml") for line in logs), logs[-20:]
    ours = [line for line in logs if "process(es)" in line or "node 1 of 2:" in line]
    assert ours and all(line.startswith("[node 1 of 2] ") for line in ours), ours
    assert [line for path in cluster.audit.glob("rank1-*.txt")
            for line in path.read_text().splitlines()] == []
    assert list(cluster.audit.glob("rank1-*.txt")), "rank 1 was never audited"
    tracked = set(git(cluster.node1, "ls-files", "data").splitlines())
    written = {path for path in data_files(cluster.node1) - tracked
               if not path.startswith(("data/prepared/train/", "data/models/sft/"))}
    assert written == set()  # besides git's files, only the inputs dvc pull brought


@pytest.mark.slow
def test_the_result_equals_one_machine_with_two_processes(cluster: Cluster, one_machine: Path,
                                                          two_nodes: dict):
    from safetensors.numpy import load_file

    two, one = (json.loads((repo / TRAIN_LOG).read_text()) for repo in (cluster.node0,
                                                                        one_machine))
    assert len(two) == TEST_PARAMS["train.grpo.max_steps"]
    assert two == one
    tensors = {name: load_file(str(repo / ADAPTER)) for name, repo in (("two", cluster.node0),
                                                                        ("one", one_machine))}
    assert tensors["two"].keys() == tensors["one"].keys()
    for key, value in tensors["two"].items():
        assert (value == tensors["one"][key]).all(), key


@pytest.mark.slow
def test_the_second_clone_gets_the_adapter_with_dvc_pull(cluster: Cluster, two_nodes: dict):
    git(cluster.node0, "add", "dvc.lock")
    git(cluster.node0, "commit", "-qm", "train_gspo on two nodes")
    git(cluster.node1, "pull", "-q")
    run(["dvc", "pull", STAGE], cluster.node1, env=cluster.env)
    assert (cluster.node1 / ADAPTER).read_bytes() == (cluster.node0 / ADAPTER).read_bytes()
    assert (cluster.node1 / TRAIN_LOG).read_text() == (cluster.node0 / TRAIN_LOG).read_text()


def logged_since(path: Path, since: float) -> bool:
    """Whether rank 0 has written the train log since `since` (a new run's first step)."""
    try:
        return path.stat().st_mtime > since
    except FileNotFoundError:
        return False


def stage_launcher(clone: Path) -> int | None:
    """The pid of the stage's own process in `clone` (the launcher, not a launched worker)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if (len(argv) > 1 and argv[1].endswith(b"stages/train_gspo.py") and cwd == str(clone)
                and b"LOCAL_RANK=" not in environ):
            return int(proc.name)
    return None


@pytest.mark.slow
def test_a_killed_node_stops_node_0_and_nothing_is_recorded(cluster: Cluster, two_nodes: dict):
    """A new commit (8 steps) on both nodes; node 1's processes are killed once node 0 has
    logged a step: node 0 stops within seconds with one line naming node 1, DVC records
    nothing and pushes nothing, and `vlmrl run` fails naming both nodes."""
    update_params(cluster.node0, {"train.grpo.max_steps": 8})
    git(cluster.node0, "commit", "-qam", "8 steps")
    git(cluster.node1, "pull", "-q")
    lock_before = (cluster.node0 / "dvc.lock").read_text()
    objects_before = remote_objects(cluster.s3)
    log = cluster.logs / "killed-run.txt"
    command = [sys.executable, "-m", "vlmrl.cli", "run", "--nodes", "2", "--pool", POOL]
    started = time.time()
    with background(command, log, cluster.env, cwd=cluster.node0) as running:
        deadline = time.monotonic() + 600
        while not logged_since(cluster.node0 / TRAIN_LOG, started):
            assert running.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        launcher = stage_launcher(cluster.node1)
        assert launcher is not None, log.read_text()
        os.killpg(launcher, signal.SIGKILL)  # node 1's launcher and accelerate; its worker
        killed = time.monotonic()            # dies with its launcher
        running.wait(300)
        stopped = time.monotonic()
    output = log.read_text()
    assert running.returncode == 1, output
    node0 = next(line for line in output.splitlines() if line.startswith("node 0 of 2"))
    assert node0.startswith("node 0 of 2  failed"), output
    assert re.search(r"s  train_gspo failed: node 1 of 2 left the run after \d+ s \(its "
                     r"connection closed\); the outputs of its last good run come back with "
                     r"`dvc checkout train_gspo`$", node0), node0
    node1 = next(line for line in output.splitlines() if line.startswith("node 1 of 2"))
    assert node1.startswith("node 1 of 2  failed") and node1.endswith(
        "train_gspo was killed (signal 9)"), output
    assert stopped - killed < 120
    assert (cluster.node0 / "dvc.lock").read_text() == lock_before
    assert remote_objects(cluster.s3) == objects_before
    status = yaml.safe_load(run(["dvc", "status", STAGE, "--json"], cluster.node0).stdout)
    assert STAGE in status  # nothing recorded: DVC still calls it stale
