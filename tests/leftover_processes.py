"""A test run leaves no server behind. Loaded by conftest.py (and by name, `-p
leftover_processes`, where a test runs pytest on a file of its own).

pytest is made a child subreaper (Linux's PR_SET_CHILD_SUBREAPER), so a process a test started
stays pytest's descendant even where the process that started it is gone (a server whose
launcher was killed is otherwise adopted by init, out of sight). When the session ends, every
descendant still listening on a TCP port is a leftover: the run fails and names each one, and
each is stopped, since the tests started it and nothing else will. Helpers that live as long as
the interpreter and listen on nothing (multiprocessing's resource tracker) are not servers."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

import pytest

PR_SET_CHILD_SUBREAPER = 36
# A server that is shutting down as the session ends (one a fixture just stopped) gets this
# long to exit before it counts as left behind.
GRACE_SECONDS = float(os.environ.get("VLMRL_LEFTOVER_GRACE_S", "10"))
LISTEN = "0A"  # the state column of /proc/net/tcp


def descendants(pid: int) -> list[int]:
    """The live (not zombie) processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while being read
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def listening_inodes() -> set[str]:
    """The socket inodes of every TCP socket listening in this network namespace."""
    tables = [Path("/proc/net/tcp")] + [table for table in [Path("/proc/net/tcp6")]
                                        if table.exists()]  # no IPv6 table where IPv6 is off
    inodes = set()
    for table in tables:
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN:
                inodes.add(fields[9])
    return inodes


def is_server(pid: int, listening: set[str]) -> bool:
    """Whether the process holds one of the listening sockets."""
    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return False  # it exited, or is not ours to read
    return any(link.startswith("socket:[") and link[8:-1] in listening for link in links)


def servers_below(pid: int) -> list[int]:
    listening = listening_inodes()
    return [child for child in descendants(pid) if is_server(child, listening)]


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(exited)"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def stop(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL for whatever still runs after a few seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and set(pids) & set(descendants(os.getpid())):
            time.sleep(0.2)


def leftovers(grace_s: float = GRACE_SECONDS) -> list[int]:
    """The servers below pytest once its other processes have exited, or `grace_s` passed."""
    deadline = time.monotonic() + grace_s
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return servers_below(os.getpid())


def pytest_configure(config: pytest.Config) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # Linux, as the project's machines and CI
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    found = leftovers()
    if not found:
        return
    lines = [f"  pid {pid}: {command_line(pid)}" for pid in found]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = ("the tests left these servers running (now stopped); stop each process a "
               "test starts:\n" + "\n".join(lines))
    if reporter is not None:
        reporter.write_line(message, red=True)
    stop(found)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
