"""How the pipeline runs commands (DVC, a stage): in the project repo, with the output streamed
line by line as it comes, so that a Prefect task's log shows a stage while it runs."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from vlmrl.pipeline.dvc_env import dvc_env

STDERR_TAIL_LINES = 40


def resolve_repo(repo: str | Path | None) -> Path:
    path = Path(repo or Path.cwd()).resolve()
    if not (path / "dvc.yaml").is_file():
        raise FileNotFoundError(f"{path} has no dvc.yaml: pass the project repo directory")
    return path


@dataclass
class CommandResult:
    returncode: int
    stdout: list[str] = field(default_factory=list)
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))


def _pump(stream: IO[str], name: str, lines: queue.Queue[tuple[str, str | None]]) -> None:
    for line in stream:
        lines.put((name, line.rstrip("\n")))
    lines.put((name, None))


def stream_command(cmd: Sequence[str], cwd: Path, on_line: Callable[[str, str], None],
                   env: Mapping[str, str] | None = None) -> CommandResult:
    """Runs cmd, calling on_line(stream, line) for each stdout/stderr line as it arrives, on the
    calling thread (Prefect's run logger belongs to it). Progress bars' carriage returns count as
    line ends. Interrupting the caller kills the whole process group (DVC and the stage). `env`:
    variables set on top of `dvc_env()` (a node's rank, for one)."""
    process = subprocess.Popen(cmd, cwd=cwd, env={**dvc_env(), **(env or {})}, text=True,
                               bufsize=1, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    pumps = [threading.Thread(target=_pump, args=(pipe, name, lines), daemon=True)
             for pipe, name in ((process.stdout, "stdout"), (process.stderr, "stderr"))]
    for pump in pumps:
        pump.start()
    result = CommandResult(returncode=-1)
    try:
        open_streams = len(pumps)
        while open_streams:
            name, line = lines.get()
            if line is None:
                open_streams -= 1
                continue
            (result.stdout if name == "stdout" else result.stderr_tail).append(line)
            on_line(name, line)
        result.returncode = process.wait()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
    return result
