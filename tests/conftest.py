"""Shared fixtures: a real git + DVC copy of the project in a temporary directory, so stages run
through `dvc repro` exactly as users run them, without touching the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TESTMINI = SHARED / "mathvista" / "testmini.json"
PROJECT_FILES = ("dvc.yaml", "params.yaml", "pyproject.toml", "README.md")
PROJECT_DIRS = ("stages", "src", "flows")


def pytest_collection_modifyitems(config, items):
    import importlib.util

    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def dvc_env() -> dict[str, str]:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=kwargs.pop("env", dvc_env()), text=True,
                            capture_output=True, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def make_project_repo(target: Path, params_update: dict | None = None) -> Path:
    """A fresh git + DVC repository holding the project's pipeline files."""
    target.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, target / name)
    for name in PROJECT_DIRS:
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, target / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (target / "data").mkdir(exist_ok=True)
    shutil.copy2(ROOT / ".gitignore", target / ".gitignore")
    if params_update:
        update_params(target, params_update)
    run(["git", "init", "-q"], target)
    run(["git", "config", "user.email", "test@vlmrl.invalid"], target)
    run(["git", "config", "user.name", "vlmrl tests"], target)
    run(["dvc", "init", "-q"], target)
    run(["dvc", "config", "core.analytics", "false"], target)
    run(["git", "add", "-A"], target)
    run(["git", "commit", "-qm", "project"], target)
    return target


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


def dvc_repro(repo: Path, *targets: str, check: bool = True, extra: tuple[str, ...] = ()):
    return run(["dvc", "repro", *extra, *targets], repo, check=check)


@pytest.fixture(scope="session")
def pipeline_repo(tmp_path_factory) -> Path:
    """One project repo per test session, shared by the stage tests; each test reproduces the
    stages it needs (DVC skips what is already done) and must not change params in it."""
    return make_project_repo(tmp_path_factory.mktemp("pipeline") / "repo")


@pytest.fixture
def fresh_repo(tmp_path) -> Path:
    return make_project_repo(tmp_path / "repo")
