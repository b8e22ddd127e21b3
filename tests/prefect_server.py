"""A real `prefect server` on 127.0.0.1 for the Prefect tests, its REST API as the UI uses it,
and the processes the tests start against it (a serving `vlmrl schedule`, a process worker).

The tests read the server through the API and never write to it themselves: runs come from
Prefect's scheduler, writes from Prefect's own client, runner and worker, which retry the 503 that
the SQLite server sends for a write it lost to another writer. A bare post of
`create_flow_run` the moment a served deployment appears fails now and then: other writers are
busy with it then (the serving runner updates it, and Prefect's scheduler inserts a new cron
deployment's runs within 5 s of its creation). SQLite (WAL) fails a transaction that read before
another connection's commit and writes after it with SQLITE_BUSY_SNAPSHOT at once, whatever the
busy timeout, and the server answers 503 "try again"; a bare post does not retry. Reproduced
with bare posts against freshly served deployments: the server log showed the INSERT INTO
flow_run failing, and the runner's own update of that deployment failing the same way a moment
later. docs/prefect.md, section 4, says the same for users.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from project_repo import dvc_env
from s3_server import free_port

from vlmrl.pipeline.orchestration import OFFLINE_DEFAULTS

FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
# Prefect's runner and worker poll every 10 s by default; the tests do not need to wait that long.
FAST_POLLING = {"PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_WORKER_QUERY_SECONDS": "2"}


@pytest.fixture(scope="module", autouse=True)
def offline_prefect() -> Iterator[None]:
    """What `vlmrl run` sets before importing Prefect, set before a test module imports it."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE_DEFAULTS.items():
            if name not in os.environ:
                patch.setenv(name, value)
        yield


class Api:
    """The Prefect REST API, as the UI uses it; reads only (filters are POSTs that write nothing)."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url.rstrip("/") + "/", timeout=30)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = self.client.post(path, json=body)
        response.raise_for_status()
        return response.json()

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        response.raise_for_status()
        return response.json()

    def flow_runs(self, flow_name: str) -> list[dict]:
        return self.post("flow_runs/filter", {"flows": {"name": {"any_": [flow_name]}}})

    def deployment_runs(self, deployment_id: str) -> list[dict]:
        """The deployment's runs, earliest expected start first."""
        return self.post("flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}},
                                              "sort": "EXPECTED_START_TIME_ASC"})

    def task_runs(self, flow_run_id: str) -> list[dict]:
        return self.post("task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})

    def artifacts(self, flow_run_id: str) -> dict[str, dict]:
        found = self.post("artifacts/filter",
                          {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
        return {artifact["key"]: artifact for artifact in found if artifact["key"]}

    def logs(self, flow_run_id: str) -> list[str]:
        messages: list[str] = []
        while True:
            page = self.post("logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                             "limit": 200, "offset": len(messages)})
            messages += [entry["message"] for entry in page]
            if len(page) < 200:
                return messages

    def deployments(self, name: str) -> list[dict]:
        return self.post("deployments/filter", {"deployments": {"name": {"any_": [name]}}})

    def deployment(self, name: str) -> dict:
        (found,) = self.deployments(name)
        return found


def task_names(task_runs: list[dict]) -> Counter:
    return Counter(task_run["task_key"].split("-")[0] for task_run in task_runs)


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {key: value for key, value in dvc_env().items() if not key.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if api_url:
        env.update(PREFECT_API_URL=api_url, **FAST_POLLING)
    return env


def prefect_command(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "prefect"), *args]


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def background(cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path | None = None
               ) -> Iterator[subprocess.Popen]:
    """cmd running in its own process group, its output in log_path; stopped on exit."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield process
    finally:
        stop(process)


def wait_until_ready(url: str, server: subprocess.Popen, log_path: Path,
                     timeout: float = 120) -> None:
    """Until /api/ready answers 200: the app is up and its database connectable (migrated)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"prefect server did not come up:\n{log_path.read_text()}")


@contextmanager
def prefect_server(home: Path) -> Iterator[str]:
    """A `prefect server start` with its own PREFECT_HOME (so its own SQLite database); yields the
    API URL once the server is ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    log_path = home / "server.log"
    command = prefect_command("server", "start", "--host", "127.0.0.1", "--port", str(port))
    with background(command, log_path, prefect_env(home)) as server:
        wait_until_ready(url, server, log_path)
        yield url


def wait_for(what: str, probe, process: subprocess.Popen, log_path: Path,
             timeout: float = 180) -> Any:
    """probe() until it returns something truthy, while process lives; else fail with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        found = probe()
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (exit code {process.poll()}):\n"
                         f"{log_path.read_text()}")


def wait_for_final_state(api: Api, flow_run_id: str, process: subprocess.Popen,
                         log_path: Path, timeout: float = 300) -> str:
    def final_state() -> str | None:
        state = api.get(f"flow_runs/{flow_run_id}")["state_type"]
        return state if state in FINAL_STATES else None

    return wait_for(f"flow run {flow_run_id} finishing", final_state, process, log_path, timeout)


def daily_cron_soon(lead_seconds: float = 60) -> str:
    """A daily cron (UTC) that next fires at the first whole minute at least lead_seconds from
    now: time to register the deployment first, and one run during a test, the next a day later."""
    at = datetime.now(UTC) + timedelta(seconds=lead_seconds)
    at = at.replace(second=0, microsecond=0) + timedelta(minutes=1)
    return f"{at.minute} {at.hour} * * *"


def first_scheduled_run(api: Api, deployment_id: str, process: subprocess.Popen,
                        log_path: Path) -> dict:
    """The deployment's earliest run, once Prefect's scheduler has created it; it must be due
    within minutes (else the deployment was registered after the cron's first firing)."""
    runs = wait_for(f"a scheduled run of deployment {deployment_id}",
                    lambda: api.deployment_runs(deployment_id), process, log_path)
    due = datetime.fromisoformat(runs[0]["expected_start_time"])
    assert due - datetime.now(UTC) < timedelta(minutes=3), (
        f"the first scheduled run is due at {due}: registering took longer than the cron's lead")
    return runs[0]
