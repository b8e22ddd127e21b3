"""dvc.yaml's deps decide what `dvc repro` reruns, so a stage that imports a module it does not
declare silently keeps stale outputs, and one that declares a module it never imports reruns for
nothing. This test derives each stage's imports from its script and compares them with the deps."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vlmrl"
# Holds only the version string; every module imports it, so no stage lists it.
IGNORED = {PACKAGE / "__init__.py"}


def is_code_free(path: Path) -> bool:
    """An `__init__.py` that holds only its docstring: importing it runs nothing, so a stage
    that imports one of its package's modules need not list it (editing the docstring reruns
    nothing)."""
    if path.name != "__init__.py":
        return False
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
               for node in body)
# Package data read at run time by the modules that name it.
ASSET_READERS = {"qwen3_vl_chat_template.jinja":
                 PACKAGE / "assets" / "qwen3_vl_chat_template.jinja",
                 '"accelerate_configs"': PACKAGE / "assets" / "accelerate_configs"}


def module_file(name: str) -> Path | None:
    """The file of a `vlmrl...` module name, or None when it names no module."""
    parts = name.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def imported_modules(path: Path) -> set[str]:
    """Every `vlmrl` module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "vlmrl")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "vlmrl":
                continue
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in names if module_file(name) is not None}


def with_parent_packages(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}


def used_files(script: Path) -> set[Path]:
    """The script's vlmrl files, transitively, plus package data that they read."""
    seen: set[str] = set()
    todo = list(imported_modules(script))
    while todo:
        for name in with_parent_packages(todo.pop()):
            if name not in seen:
                seen.add(name)
                todo.extend(imported_modules(module_file(name)))
    files = {module_file(name) for name in seen} - IGNORED
    files = {path for path in files if not is_code_free(path)}
    for marker, asset in ASSET_READERS.items():
        if any(marker in path.read_text(encoding="utf-8") for path in files):
            files.add(asset)
    return files


def stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def declared_paths(stage: dict) -> set[Path]:
    deps = [dep if isinstance(dep, str) else next(iter(dep)) for dep in stage.get("deps", [])]
    return {(ROOT / dep).resolve() for dep in deps if not dep.startswith("${")}


def script_of(stage: dict) -> Path:
    match = re.search(r"python (stages/\S+\.py)", stage["cmd"])
    assert match, f"stage command runs no stages/ script: {stage['cmd']}"
    return ROOT / match.group(1)


def covers(dep: Path, file: Path) -> bool:
    return dep == file or dep in file.parents


@pytest.mark.parametrize("name", sorted(stages()))
def test_stage_deps_match_its_imports(name: str) -> None:
    stage = stages()[name]
    script = script_of(stage)
    used = used_files(script) | {script}
    declared = declared_paths(stage)
    code_deps = {dep for dep in declared if PACKAGE in dep.parents or dep.parent == ROOT / "stages"}

    missing = sorted(str(f.relative_to(ROOT)) for f in used
                     if not any(covers(dep, f) for dep in code_deps))
    unused = sorted(str(dep.relative_to(ROOT)) for dep in code_deps
                    if not any(covers(dep, f) for f in used))
    assert not missing, f"{name} imports {missing} but dvc.yaml does not list them as deps"
    assert not unused, f"{name} lists {unused} as deps but never imports them"


def test_used_files_follow_imports_inside_functions(tmp_path: Path) -> None:
    script = tmp_path / "stage.py"
    script.write_text("def main():\n    from vlmrl.rewards.scoring import score\n")
    assert PACKAGE / "rewards" / "scoring.py" in used_files(script)


ROLLOUT = PACKAGE / "training" / "rollout"
TRAINING_STAGES = {"train_gspo"}  # the stages whose scripts run `vlmrl.training.rollout`


@pytest.mark.parametrize("name", sorted(stages()))
def test_rollout_package_is_a_dep_of_training_alone(name: str) -> None:
    """Editing a file of `vlmrl.training.rollout` (training's decoding speed-ups) puts train_gspo out of
    date and no other stage: evaluations, verify and export declare no dep that covers it."""
    files = sorted(ROLLOUT.glob("*.py"))
    assert {path.name for path in files} >= {"graph_decode.py", "decode_attention.py",
                                             "nf4_decode.py", "shared_prompts.py"}
    declared = declared_paths(stages()[name])
    covering = {str(f.relative_to(ROOT)) for f in files
                if any(covers(dep, f) for dep in declared)}
    if name in TRAINING_STAGES:
        assert covering == {str(f.relative_to(ROOT)) for f in files}, \
            f"{name} must list src/vlmrl/training/rollout as a dep"
        assert ROLLOUT in {f.parent for f in used_files(script_of(stages()[name]))}
    else:
        assert not covering, f"{name} lists {sorted(covering)} although only training runs them"
        assert not any(covers(ROLLOUT, f) for f in used_files(script_of(stages()[name])))
