"""What a release was built from, so that publishing a version again from the same inputs is a
no-op instead of a conflict.

A rerun of an unchanged pipeline (`dvc repro -f`, a new machine, CI) does not write the same
bytes: CPU training is bitwise repeatable only within one machine and thread count, and the
merged model and the GGUF files follow the adapter. Comparing files would refuse it. What a run
was built from is what DVC already hashes: every stage's code and data dependencies and its
params, in `dvc.lock`. The hashes of dependencies that are another stage's outputs are left out
(they are what a rerun may write differently); the upload stage's own code, which dvc.lock
records only after this run, is hashed here the same way DVC would see it, file by file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

UPLOAD_STAGE = "upload"


def _entries(stage: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = stage.get(key) or []
    return [entry for entry in value if isinstance(entry, Mapping)]


def built_from(repo_dir: Path, stage: str = UPLOAD_STAGE) -> dict[str, Any] | None:
    """For every stage dvc.lock records but `stage`: the hashes of its dependencies that no
    stage writes, and its params; for `stage` itself the sha256 of the code it runs (its deps in
    dvc.yaml that are files or folders of the repository, not another stage's output). None
    where there is no dvc.lock, as in a run outside DVC."""
    lock_path, dvc_path = repo_dir / "dvc.lock", repo_dir / "dvc.yaml"
    if not lock_path.is_file() or not dvc_path.is_file():
        return None
    stages = (yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}).get("stages") or {}
    written = {out["path"] for entry in stages.values() for out in _entries(entry, "outs")}
    inputs: dict[str, Any] = {}
    for name, entry in sorted(stages.items()):
        if name == stage:
            continue
        deps = {dep["path"]: dep.get("md5") or dep.get("hash") or dep.get("etag")
                for dep in _entries(entry, "deps") if dep["path"] not in written}
        inputs[name] = {"deps": deps, "params": entry.get("params") or {}}
    inputs[stage] = {"code": code_digest(repo_dir, own_code(dvc_path, stage))}
    return inputs


def own_code(dvc_path: Path, stage: str) -> list[str]:
    """`stage`'s dependencies in dvc.yaml that are the repository's own files (the entries
    written with `${...}` are paths of data and other stages' outputs)."""
    spec = yaml.safe_load(dvc_path.read_text(encoding="utf-8"))["stages"][stage]
    names = [dep if isinstance(dep, str) else next(iter(dep)) for dep in spec.get("deps", [])]
    return sorted(name for name in names if "${" not in name)


def code_digest(repo_dir: Path, paths: list[str]) -> str:
    """sha256 over the relative name and bytes of every file under `paths`, in sorted order
    (caches such as __pycache__ left out)."""
    digest = hashlib.sha256()
    for name in paths:
        root = repo_dir / name
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for file in files:
            if file.is_file() and "__pycache__" not in file.parts:
                digest.update(file.relative_to(repo_dir).as_posix().encode() + b"\0")
                digest.update(file.read_bytes())
    return digest.hexdigest()


def inputs_digest(inputs: Mapping[str, Any] | None) -> str | None:
    """One sha256 of `built_from`'s answer, as the manifest records it."""
    if inputs is None:
        return None
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
