"""Tests and benchmarks must run the pipeline the way users do (git + DVC, `dvc repro`) without
touching the checkout, so they work on a fresh copy of the project's pipeline files.

Imported by tests/conftest.py, and by benchmarks/pipeline.py with tests/ put on sys.path.
History: `vlmrl.project_copy` until it moved out of the package; its `dvc_env` (the environment
stages run in) moved to `vlmrl.dvc_env`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from vlmrl.dvc_env import dvc_env

PROJECT_FILES = ("dvc.yaml", "params.yaml", "pyproject.toml", "README.md", ".gitignore", ".dvcignore")
PROJECT_DIRS = ("stages", "src", "flows")


def project_root() -> Path:
    return Path(__file__).resolve().parents[1]


def run(cmd: list[str], cwd: Path, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=kwargs.pop("env", dvc_env()), text=True, check=False,
                            capture_output=True, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def update_params(repo: Path, update: dict) -> None:
    """Applies {"train.grpo.max_steps": 2, ...} to the repo's params.yaml."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in update.items():
        node = params
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def make_project_repo(target: Path, params_update: dict | None = None,
                      source: Path | None = None) -> Path:
    """A fresh git + DVC repository holding the project's pipeline files."""
    source = source or project_root()
    target.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        shutil.copy2(source / name, target / name)
    for name in PROJECT_DIRS:
        if (source / name).exists():
            shutil.copytree(source / name, target / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (target / "data").mkdir(exist_ok=True)
    if params_update:
        update_params(target, params_update)
    run(["git", "init", "-q"], target)
    run(["git", "config", "user.email", "dev@vlmrl.invalid"], target)
    run(["git", "config", "user.name", "vlmrl"], target)
    run(["dvc", "init", "-q"], target)
    run(["dvc", "config", "core.analytics", "false"], target)
    run(["git", "add", "-A"], target)
    run(["git", "commit", "-qm", "project"], target)
    return target
