"""Tests and benchmarks must run the pipeline the way users do (git + DVC, `dvc repro`) without
touching the checkout, so they work on a fresh copy of the project's pipeline files.

Imported by tests/conftest.py, and by benchmarks/pipeline.py with tests/ put on sys.path. The
environment stages run in is `vlmrl.pipeline.dvc_env`'s: the package's own runs need it too.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import yaml

from vlmrl.pipeline.dvc_env import dvc_env

PROJECT_FILES = ("dvc.yaml", "params.yaml", "pyproject.toml", "README.md", ".gitignore", ".dvcignore")
# data/local: the default data.path, a dependency of prepare_data that must exist
PROJECT_DIRS = ("stages", "src", "flows", "data/local", "recipes")


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


def copy_project(target: Path, params_update: dict | None = None,
                 source: Path | None = None) -> Path:
    """The project's pipeline files in `target` (no git, no DVC), with params updated."""
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
    return target


def stage_command(name: str, root: Path) -> list[str]:
    """dvc.yaml's command for stage `name` with `${paths.*}` filled in, as argv (`python` first):
    the stages' paths live only in dvc.yaml."""
    dvc = yaml.safe_load((root / "dvc.yaml").read_text())
    variables = {f"{group}.{key}": str(value)
                 for entry in dvc.get("vars", []) if isinstance(entry, dict)
                 for group, values in entry.items() for key, value in (values or {}).items()}
    command = re.sub(r"\$\{([\w.]+)\}", lambda match: variables[match.group(1)],
                     dvc["stages"][name]["cmd"])
    return shlex.split(command)


def make_project_repo(target: Path, params_update: dict | None = None,
                      source: Path | None = None) -> Path:
    """A fresh git + DVC repository holding the project's pipeline files."""
    copy_project(target, params_update, source)
    run(["git", "init", "-q"], target)
    run(["git", "config", "user.email", "dev@vlmrl.invalid"], target)
    run(["git", "config", "user.name", "vlmrl"], target)
    run(["dvc", "init", "-q"], target)
    run(["dvc", "config", "core.analytics", "false"], target)
    run(["git", "add", "-A"], target)
    run(["git", "commit", "-qm", "project"], target)
    return target
