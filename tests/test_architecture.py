"""The packages of `vlmrl`, read from the source with `ast` (nothing is imported): which package
may import which (docs/architecture.md is the map), no import circle between modules, the stage
packages do not import each other, and the modules that must start fast never reach torch.

Every import counts, function-local ones too (they run sooner or later), except those under
`if TYPE_CHECKING:`. A module belongs to its package (the folder under `src/vlmrl`), or is one
of the few modules at the root, which every package may use."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# The root's modules: every package may import them; they import only one another.
ROOT_MODULES = ("vlmrl", "vlmrl.cli", "vlmrl.errors", "vlmrl.params", "vlmrl.params_checks",
                "vlmrl.cache", "vlmrl.outputs", "vlmrl.hub")
MAX_ROOT_MODULES = 8
# Each package and the packages it may import besides the root's modules. A package missing here
# fails the first tests until it is placed.
ALLOWED: dict[str, set[str]] = {
    "vlmrl.reporting": set(),
    "vlmrl.rewards": set(),
    "vlmrl.data": {"vlmrl.rewards", "vlmrl.reporting"},
    "vlmrl.models": {"vlmrl.rewards"},
    "vlmrl.distributed": {"vlmrl.models"},  # the launch's precision, inside the launcher
    "vlmrl.training": {"vlmrl.models", "vlmrl.rewards", "vlmrl.distributed", "vlmrl.reporting"},
    "vlmrl.evaluation": {"vlmrl.models", "vlmrl.rewards", "vlmrl.distributed", "vlmrl.reporting"},
    "vlmrl.verification": {"vlmrl.models", "vlmrl.reporting"},
    "vlmrl.export": {"vlmrl.models", "vlmrl.data", "vlmrl.rewards", "vlmrl.reporting"},
    "vlmrl.serve": {"vlmrl.export"},
    "vlmrl.publish": {"vlmrl.models", "vlmrl.export", "vlmrl.rewards", "vlmrl.reporting"},
    "vlmrl.pipeline": {"vlmrl.rewards", "vlmrl.reporting"},
    "vlmrl.ui": {"vlmrl.rewards", "vlmrl.data", "vlmrl.evaluation"},
}
# Inside `vlmrl.training`: the trainer subclasses serve both stages and know neither, the
# rollouts serve GSPO alone, and the two stages never import each other.
TRAINING_PARTS: dict[str, set[str]] = {
    "vlmrl.training.trainer": set(),
    "vlmrl.training.checkpoints": set(),
    "vlmrl.training.rollout": {"vlmrl.training.trainer"},
    "vlmrl.training.sft": {"vlmrl.training.trainer"},
    "vlmrl.training.gspo": {"vlmrl.training.trainer", "vlmrl.training.rollout",
                            "vlmrl.training.checkpoints"},
}
# Imported at a module's top level, these make the module slow to import (torch and what loads it).
HEAVY_PACKAGES = {"torch", "transformers", "trl", "peft", "accelerate", "unsloth", "bitsandbytes",
                  "triton", "datasets"}
# Packages that must start without torch: scoring in the UI, `vlmrl pull`, prepare_data, the CLI.
LIGHT = ("vlmrl.rewards", "vlmrl.publish", "vlmrl.cli", "vlmrl.ui", "vlmrl.data",
         "vlmrl.pipeline", "vlmrl.reporting")


# ------------------------------------------------------------------------ graph


def module_files(src: Path = SRC) -> dict[str, Path]:
    modules = {}
    for path in sorted((src / "vlmrl").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


class _Imports(ast.NodeVisitor):
    """Names a module imports, resolved against the module's own package."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.names: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name != "TYPE_CHECKING":
            self.generic_visit(node)
        else:
            for child in node.orelse:
                self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.names += [alias.name for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        self.names.append(base)
        self.names += [f"{base}.{alias.name}" for alias in node.names]


def owner(name: str, modules: Iterable[str]) -> str | None:
    """The longest known module that `name` (a module, or an attribute of one) lies in."""
    known = set(modules)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the vlmrl modules it imports (their parent packages included: importing
    `vlmrl.models.loading` runs `vlmrl/models/__init__.py` too)."""
    files = module_files(src)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        targets = {owner(name, files) for name in visitor.names if name.split(".")[0] == "vlmrl"}
        with_parents = set()
        for target in targets - {None}:
            parts = target.split(".")
            with_parents |= {".".join(parts[:end]) for end in range(1, len(parts) + 1)}
        graph[module] = {t for t in with_parents if t in files and t != module
                         and not module.startswith(t + ".")}
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import circle as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def package_of(module: str) -> str | None:
    """The package (`vlmrl.<folder>`) a module lies in, the module itself at the root, or None
    for a package no rule names."""
    if module in ROOT_MODULES:
        return module
    package = ".".join(module.split(".")[:2])
    return package if package in ALLOWED else None


def training_part(module: str) -> str | None:
    """The part of `vlmrl.training` a module lies in (None: the package's own `__init__`)."""
    return next((part for part in TRAINING_PARTS
                 if module == part or module.startswith(part + ".")), None)


def imports_heavy_at_top(path: Path) -> bool:
    """Whether importing the file imports torch or a package that loads it."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        if any(name.split(".")[0] in HEAVY_PACKAGES for name in names):
            return True
    return False


def reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


GRAPH = import_graph()
FILES = module_files()


# ------------------------------------------------------------------------ tests


def test_the_graph_sees_the_imports() -> None:
    """Guards the tests below against an empty or misread graph."""
    assert "vlmrl.models.loading" in GRAPH["vlmrl.evaluation.evaluate"]
    assert "vlmrl.models" in GRAPH["vlmrl.evaluation.evaluate"]  # the package of a submodule
    assert "vlmrl.rewards.scoring" in GRAPH["vlmrl.rewards.text"]  # `from vlmrl.rewards import ...`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert imports_heavy_at_top(FILES["vlmrl.models.loading"])
    assert not imports_heavy_at_top(FILES["vlmrl.rewards.scoring"])


def test_the_root_holds_few_modules_and_every_package_is_placed() -> None:
    root = sorted(path.stem for path in (SRC / "vlmrl").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the root: {root}"
    homeless = sorted(module for module in GRAPH if package_of(module) is None)
    assert not homeless, f"place these modules' packages in ALLOWED: {homeless}"
    assert {f"vlmrl.{path.stem}" for path in (SRC / "vlmrl").glob("*.py")} - {"vlmrl.__init__"} \
        <= set(ROOT_MODULES)


def test_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_a_module_imports_only_what_its_package_may(module: str) -> None:
    package = package_of(module)
    if package is None:
        pytest.fail(f"{module} is in no package that ALLOWED names")
    may = ALLOWED.get(package, set(ROOT_MODULES)) | set(ROOT_MODULES) | {package}
    if package in ROOT_MODULES:
        may = set(ROOT_MODULES)
    problems = [target for target in sorted(GRAPH[module])
                if package_of(target) not in may]
    assert not problems, f"{module} ({package}) may not import {problems}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("vlmrl.training.")))
def test_training_parts_keep_to_their_own(module: str) -> None:
    """The trainer subclasses know neither stage, the rollouts serve GSPO alone, and the SFT and
    GSPO stages never import each other."""
    part = training_part(module)
    assert part is not None, f"{module} lies in no part of TRAINING_PARTS"
    may = TRAINING_PARTS[part] | {part, "vlmrl.training"}
    problems = [target for target in sorted(GRAPH[module])
                if target.startswith("vlmrl.training") and (training_part(target) or
                                                            "vlmrl.training") not in may]
    assert not problems, f"{module} ({part}) may not import {problems}"


def test_the_rules_are_a_ladder() -> None:
    """The allowed imports between packages themselves hold no circle."""
    assert find_cycle(ALLOWED) is None
    assert find_cycle(TRAINING_PARTS) is None


@pytest.mark.parametrize("package", LIGHT)
def test_light_packages_never_reach_torch(package: str) -> None:
    modules = [module for module in GRAPH if module == package or module.startswith(package + ".")]
    assert modules, f"no package {package} (renamed? update LIGHT)"
    heavy = {module: sorted(target for target in reachable(GRAPH, module) | {module}
                            if imports_heavy_at_top(FILES[target]))
             for module in modules}
    assert not {m: t for m, t in heavy.items() if t}, f"{package} imports (transitively) {heavy}"


MAX_MODULE_LINES = 470  # a module that grows past it is split by job


def test_no_module_is_too_long_to_read() -> None:
    lengths = {module: len(path.read_text(encoding="utf-8").splitlines())
               for module, path in FILES.items()}
    assert not {m: n for m, n in lengths.items() if n > MAX_MODULE_LINES}


def test_no_class_is_assembled_with_type() -> None:
    """Classes are class statements, whose bases a reader sees in one place; `type(name, bases,
    namespace)` would assemble one at run time."""
    made = [f"{module}:{node.lineno}" for module, path in FILES.items()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "type" and len(node.args) == 3]
    assert not made, f"type(name, bases, namespace) in {made}"
