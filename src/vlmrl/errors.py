"""A stage that fails on bad params, data or inputs must say so in one line a person can act on,
not a Python traceback (issue 24); a bug in the project must still show its traceback.

The line between the two: `UserError` is the base of every error the project raises on purpose
with a message for the user (`ParamsError`, `DataError`, `EvalError`, `ExportError`, `GGUFError`,
`MergeCheckError`, `PublishError`, `RecipeError`): its message names the key path, record or file
and what is wrong. A missing file or folder (`FileNotFoundError`, `NotADirectoryError`) is the
other bad input every stage meets, and its message names the path. Anything else (a `TypeError`,
a `KeyError`, an error from a library on input the project did not check) is a bug, here or
upstream, and keeps its traceback. `VLMRL_DEBUG=1` shows the traceback of user errors too.

A stage script's entry point is `raise SystemExit(run_stage("<stage>", main))`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

DEBUG_ENV = "VLMRL_DEBUG"
# The exit status of a stage refused for bad input: what the stages' own checks have always used.
USER_ERROR_STATUS = 1


class UserError(Exception):
    """Bad params, data or inputs; the message names the key, record or file and what is wrong."""


USER_FACING: tuple[type[BaseException], ...] = (UserError, FileNotFoundError, NotADirectoryError)


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def one_line(error: BaseException) -> str:
    """The error's message on one line: a multi-line message's lines joined by `; `."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def run_stage(stage: str, main: Callable[[], int | None]) -> int:
    """Runs a stage's `main` and returns its exit status; a user error becomes the line
    `<stage> failed: <message>` on stderr and status 1 (the traceback only with VLMRL_DEBUG=1)."""
    try:
        return main() or 0
    except USER_FACING as error:
        if debugging():
            raise
        print(f"{stage} failed: {one_line(error)}", file=sys.stderr)
        return USER_ERROR_STATUS
