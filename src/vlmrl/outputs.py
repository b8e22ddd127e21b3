"""A stage that fails must leave no half-written outputs, or DVC and the next stage would trust
them, and must not lose the last good ones, which people compare against. Every file is written
beside its destination and moved into place in one rename; a stage's earlier outputs wait beside
theirs while it runs and come back if it fails (`stage_outputs`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_dir(target: Path | str) -> Iterator[Path]:
    """Yields an empty temporary directory that replaces `target` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o777 & ~current_umask())  # mkdtemp makes it 0700: others could not read it
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, target)


def replace_dir(source: Path, target: Path) -> None:
    retired = target.with_name(f".{target.name}.old")
    shutil.rmtree(retired, ignore_errors=True)
    if target.exists():
        os.replace(target, retired)
    os.replace(source, target)
    shutil.rmtree(retired, ignore_errors=True)


def current_umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_text_atomic(path: Path | str, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.fchmod(fd, 0o666 & ~current_umask())
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path | str, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")


def write_jsonl_atomic(path: Path | str, rows: list[dict[str, Any]]) -> None:
    write_text_atomic(path, "".join(json.dumps(row, default=str) + "\n" for row in rows))


def remove_outputs(*paths: Path | str) -> None:
    """Removes files and folders that exist among `paths`."""
    for path in map(Path, paths):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def previous(path: Path) -> Path:
    """Where an output waits while its stage runs: a hidden sibling (same file system, so a
    rename) that no stage, DVC output or git status lists."""
    return path.with_name(f".{path.name}.previous")


def recover_outputs(*paths: Path | str) -> None:
    """Brings back the outputs a run moved aside and could not put back (it was killed): what
    that run wrote in their place is removed."""
    for path in map(Path, paths):
        if previous(path).exists():
            remove_outputs(path)
            os.replace(previous(path), path)


@contextlib.contextmanager
def stage_outputs(*paths: Path | str, owner: bool = True) -> Iterator[None]:
    """The shape of every stage script's work: its earlier outputs are moved aside while the block
    runs, so it never reads or leaves a stale one; if the block raises, what it wrote is removed
    and the earlier outputs come back, else they are deleted. (DVC removes a stage's outputs
    itself before running it; then there is nothing to bring back, and the error line names
    `dvc checkout`: vlmrl.errors.run_stage.) The error goes on to `run_stage`, which prints it in
    one line and exits 1.

    Args:
        owner: whether this process writes the outputs (false on the worker ranks of a launched
            run, which leave them to rank 0).
    """
    if not owner:
        yield
        return
    paths = tuple(map(Path, paths))
    recover_outputs(*paths)
    moved = [path for path in paths if path.exists() or path.is_symlink()]
    for path in moved:
        os.replace(path, previous(path))
    try:
        yield
    except BaseException:
        remove_outputs(*paths)
        recover_outputs(*moved)
        raise
    remove_outputs(*map(previous, moved))


def stage_parser(description: str, *, timings: bool = False) -> argparse.ArgumentParser:
    """The command line every stage script shares: where its headline metrics, its full details
    (and, with `timings`, its wall-clock figures) go, and which params file it reads; the script
    adds its own paths."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--metrics", type=Path, required=True,
                        help="the headline numbers (DVC metrics)")
    parser.add_argument("--details", type=Path, required=True,
                        help="the full results; the metrics file holds their headline numbers")
    if timings:
        parser.add_argument("--timings", type=Path, required=True,
                            help="wall-clock figures, apart from the metrics later stages "
                                 "depend on")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    return parser


def training_stage_parser(description: str, out_help: str) -> argparse.ArgumentParser:
    """`stage_parser` (with timings) for a training stage, with the paths both have: the train
    set, the adapter directory it writes (`out_help` says which) and the per-step log."""
    parser = stage_parser(description, timings=True)
    parser.add_argument("--train-set", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    parser.add_argument("--log", type=Path, required=True,
                        help="per-step log (a JSON list), rewritten at every logging step")
    return parser
