"""A stage that fails on bad params, data or inputs must say so in one line a person can act on,
not a Python traceback; a bug in the project must still show its traceback.

The line between the two: `UserError` is the base of every error the project raises on purpose
with a message for the user (`ParamsError`, `DataError`, `EvalError`, `ExportError`, `GGUFError`,
`MergeCheckError`, `PublishError`, `RecipeError`): its message names the key path, record or file
and what is wrong. A missing file or folder (`FileNotFoundError`, `NotADirectoryError`) is the
other bad input every stage meets, and its message names the path; so is a file that is not
valid YAML (PyYAML's message names the file, line and column), or not valid JSON (a corrupt
artifact, read here by datasets, PEFT or the project: the line names the file the innermost
reader had open or named, `json_source`). Anything else (a `TypeError`, a `KeyError`, an
error from a library on input the project did not check) is a bug, here or upstream, and keeps
its traceback. `VLMRL_DEBUG=1` shows the traceback of user errors too.

A stage script's entry point is `raise SystemExit(run_stage("<stage>", main))`."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import yaml

DEBUG_ENV = "VLMRL_DEBUG"
# The exit status of a stage refused for bad input: what the stages' own checks have always used.
USER_ERROR_STATUS = 1


class UserError(Exception):
    """Bad params, data or inputs; the message names the key, record or file and what is wrong."""


class ParamsError(UserError, ValueError):
    """A params value is missing or wrong; the message names the key path. (Imported from
    vlmrl.params, which raises it; defined here so that params.py stays one job's length.)"""


USER_FACING: tuple[type[BaseException], ...] = (UserError, FileNotFoundError, NotADirectoryError,
                                                 yaml.YAMLError, json.JSONDecodeError)


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(error: BaseException) -> str:
    """The error's message on one line: a multi-line message's lines joined by `; `; a JSON
    error prefixed with the file it was read from."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    message = "; ".join(lines) or type(error).__name__
    if isinstance(error, json.JSONDecodeError):
        source = json_source(error.__traceback__)
        message = f"{source or 'an input file'}: not valid JSON ({message})"
    return message


def json_source(trace: TracebackType | None) -> str | None:
    """The file a JSON decoder failed on, from the frames that read it, innermost first: an open
    file (`json.load(handle)`), else a local path ending in .json (`json.loads(path.read_text())`)."""
    frames = []
    while trace is not None:
        frames.append(trace.tb_frame)
        trace = trace.tb_next
    for frame in reversed(frames):
        values = list(frame.f_locals.values())
        for value in values:
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                return value.name
        for value in values:
            if isinstance(value, (str, Path)) and str(value).endswith(".json"):
                return str(value)
    return None


def run_stage(stage: str, main: Callable[[], int | None]) -> int:
    """Runs a stage's `main` and returns its exit status; a user error becomes the line
    `<stage> failed: <message>` on stderr and status 1 (the traceback only with VLMRL_DEBUG=1).
    Under DVC, which removed the stage's outputs before running it, the line (or, after a
    traceback, a line of its own) names the command that brings back the last good ones."""
    try:
        status = main() or 0
    except USER_FACING as error:
        if debugging():
            raise
        print(f"{stage} failed: {one_line(error)}{restore_hint()}", file=sys.stderr)
        return USER_ERROR_STATUS
    except BaseException:
        if hint := restore_hint():
            print(f"{stage} failed{hint}", file=sys.stderr)
        raise
    if status and (hint := restore_hint()):
        print(f"{stage} failed{hint}", file=sys.stderr)
    return status


def restore_hint() -> str:
    """Where DVC runs this stage (it sets DVC_ROOT and DVC_STAGE) and dvc.lock records an earlier
    good run of it: `; <how to restore its outputs>`, else "". DVC removes a stage's outputs
    before running it and writes dvc.lock only after a success, so `dvc checkout` of the stage
    restores the outputs of the run that dvc.lock still describes."""
    root, stage = os.environ.get("DVC_ROOT"), os.environ.get("DVC_STAGE")
    if not root or not stage:
        return ""
    try:
        locked = yaml.safe_load((Path(root) / "dvc.lock").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return ""
    stages = locked.get("stages", {}) if isinstance(locked, dict) else {}
    if stage.rpartition(":")[2] not in stages:
        return ""
    return f"; the outputs of its last good run come back with `dvc checkout {stage}`"
