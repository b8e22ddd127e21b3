"""What a DVC command did with each stage, read from DVC's own records of a repo before and after
it, through DVC's Python API: which stages `dvc status` calls stale, their dvc.lock entries, and
DVC's run-cache. DVC prints what it does but returns none of it (`dvc repro` and `dvc exp run`
have no machine-readable output, and `dvc exp run` does not even return its stages), so these
records are the structured account there is; `stage_outcomes` says where it and DVC's log differ.
The log lines are written for people, and a pattern over them breaks when DVC rewords one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from dvc.repo import Repo

__all__ = ["DvcRecords", "LockWatcher", "Outcome", "experiment_names", "read_records",
           "stage_outcomes", "stage_seconds"]

LOCK_FILE = "dvc.lock"


class Outcome(str, Enum):
    """What DVC did with a stage."""

    RAN = "ran"  # the stage's command ran
    CACHED = "cached"  # nothing changed: DVC skipped it
    RESTORED = "restored"  # changed, but DVC's run-cache had this exact run: outputs checked out


@dataclass(frozen=True)
class DvcRecords:
    """What DVC records about the stages of a repo's dvc.yaml at one moment."""

    stale: frozenset[str]  # the stages asked about that `dvc status` reports: repro would redo them
    locks: Mapping[str, Any]  # stage -> its dvc.lock entry (deps, params and outs with hashes)
    run_cache: frozenset[Path]  # DVC's run-cache entries, one file per distinct run of a stage


def read_records(repo: Path, stale_of: Iterable[str] = ()) -> DvcRecords:
    """DVC's records in repo, asking `dvc status` (DVC's Python API) only about `stale_of`."""
    wanted = set(stale_of)
    with Repo(str(repo)) as dvc, dvc.lock:
        stale = frozenset(stage.name for stage in dvc.index.stages
                          if stage.name in wanted and stage.changed())
        run_cache_dir = Path(dvc.stage_cache.cache_dir)
    entries = frozenset(path for path in run_cache_dir.glob("*/*/*") if path.is_file())
    return DvcRecords(stale, read_locks(repo), entries)


def read_locks(repo: Path) -> dict[str, Any]:
    path = repo / LOCK_FILE
    if not path.is_file():
        return {}
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("stages") or {}


def stage_outcomes(before: DvcRecords, after: DvcRecords, stages: Iterable[str]
                   ) -> dict[str, Outcome]:
    """What a successful DVC command did with each stage, from DVC's records before and after it.

    A stage that `before` does not call stale and whose dvc.lock entry is unchanged was skipped
    (CACHED). Any other stage was reproduced: RESTORED when the run-cache already held its new
    dvc.lock entry before the command (DVC checks such a run out instead of running it, and a run
    that happens writes a new entry), RAN otherwise. Corner cases where this reads differently
    from DVC's log: deleted outputs that DVC checks out from dvc.lock with no run-cache entry for
    them (a fresh clone) read as RAN, and a stage DVC reruns with an unchanged result (its outputs
    gone from the cache) reads as CACHED when `before.stale` was not asked about it."""
    held = RunCache(before.run_cache)
    outcomes: dict[str, Outcome] = {}
    for stage in stages:
        lock = after.locks.get(stage)
        if stage not in before.stale and lock == before.locks.get(stage):
            outcomes[stage] = Outcome.CACHED
        elif lock is not None and held.holds(lock):
            outcomes[stage] = Outcome.RESTORED
        else:
            outcomes[stage] = Outcome.RAN
    return outcomes


class RunCache:
    """Run-cache entries (YAML files in DVC's lock-entry format), read when first needed."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self.paths = sorted(paths)
        self._entries: list[Any] | None = None

    def holds(self, lock: Any) -> bool:
        if self._entries is None:
            self._entries = [yaml.safe_load(path.read_text(encoding="utf-8"))
                             for path in self.paths]
        return lock in self._entries


class LockWatcher:
    """The moment each stage's dvc.lock entry first changes during a command: DVC rewrites
    dvc.lock after every stage it reproduces, so this is when the stage finished."""

    def __init__(self, repo: Path, locks: Mapping[str, Any]) -> None:
        self.path = repo / LOCK_FILE
        self.locks = locks
        self.finished: dict[str, float] = {}
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        with contextlib.suppress(FileNotFoundError):
            stat = self.path.stat()
            return stat.st_mtime_ns, stat.st_size
        return None

    def poll(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        try:
            locks = read_locks(self.path.parent)
        except (yaml.YAMLError, UnicodeDecodeError):
            return  # caught mid-write: the next poll reads it whole
        self._stamp = stamp
        now = time.monotonic()
        for stage, entry in locks.items():
            if entry != self.locks.get(stage):
                self.finished.setdefault(stage, now)


def stage_seconds(stages: Sequence[str], started: float, finished: Mapping[str, float]
                  ) -> dict[str, float]:
    """Each stage's share of one command: from the previous stage's dvc.lock write (or the start)
    to its own; 0 for stages DVC did not record anew (skipped, or checked out unchanged)."""
    seconds, mark = dict.fromkeys(stages, 0.0), started
    for stage in sorted((stage for stage in stages if stage in finished), key=finished.__getitem__):
        seconds[stage], mark = finished[stage] - mark, finished[stage]
    return seconds


def experiment_names(repo: Path) -> set[tuple[str, str | None]]:
    """(name, commit) of the experiments on the repo's HEAD (`dvc exp list`)."""
    with Repo(str(repo)) as dvc:
        listed = dvc.experiments.ls()
    return {pair for pairs in listed.values() for pair in pairs}
