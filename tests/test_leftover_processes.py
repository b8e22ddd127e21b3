"""The check at the end of every test run (tests/leftover_processes.py): a server a test starts
and forgets fails the run, by name, even where its launcher is gone; it is stopped; a run whose
tests stop what they start passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# A launcher that starts a real HTTP server on 127.0.0.1 and exits at once: the server outlives
# it, as llama_cpp.server outlived a killed `vlmrl serve`.
ORPHANING = '''
import subprocess, sys

def test_starts_a_server_through_a_launcher_that_exits():
    launcher = ("import subprocess, sys; subprocess.Popen([sys.executable, '-m', 'http.server', "
                "'--bind', '127.0.0.1', '0'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
    subprocess.run([sys.executable, "-c", launcher], check=True)
'''
TIDY = '''
import subprocess, sys, time

def test_starts_a_server_and_stops_it():
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    server.terminate()
    server.wait()
'''


def run_pytest_on(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get(
        "PYTHONPATH")])), "VLMRL_LEFTOVER_GRACE_S": "3"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "leftover_processes",
                           "-p", "no:cacheprovider", str(test_file)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_forgotten_server_fails_the_run_and_is_stopped(tmp_path: Path) -> None:
    result = run_pytest_on(tmp_path, ORPHANING)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the tests left these servers running (now stopped)" in result.stdout
    (pid,) = [int(found) for found in re.findall(r"pid (\d+): .*http\.server", result.stdout)]
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # stopped, and reaped by init once the inner pytest exited
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_a_run_that_stops_its_servers_passes(tmp_path: Path) -> None:
    result = run_pytest_on(tmp_path, TIDY)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "left these servers" not in result.stdout
