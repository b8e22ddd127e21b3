"""The package's floors, read from the source with `ast` (nothing is imported): no import circle
between vlmrl modules, no import from a floor above, the stage modules do not import each other,
and the modules that must start fast never reach a torch-bound module.

Every import counts, function-local ones too (they run sooner or later), except those under
`if TYPE_CHECKING:`. A module belongs to the floor of its longest listed prefix, so a new
subpackage (`vlmrl.synth.canvas`) sits where its package (`vlmrl.synth`) is listed; a module on
no floor fails the first test until it is listed."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module may import its own floor and the floors below it.
FLOORS: dict[str, tuple[str, ...]] = {
    "ground": ("vlmrl.errors", "vlmrl.checkpoints", "vlmrl.params", "vlmrl.params_checks", "vlmrl.answer_format", "vlmrl.outputs", "vlmrl.cache", "vlmrl.checks",
               "vlmrl.timing", "vlmrl.prompts", "vlmrl.scoring", "vlmrl.rewards", "vlmrl.text_rewards", "vlmrl.synth",
               "vlmrl.data", "vlmrl.data_columns", "vlmrl.data_sources", "vlmrl.gguf_tools", "vlmrl.merged_weights", "vlmrl.eval_report",
               "vlmrl.train_logs", "vlmrl.chunked_generation",
               "vlmrl.logprob_fallback", "vlmrl.private_names", "vlmrl.tables", "vlmrl.dvc_env", "vlmrl.dvc_records",
               "vlmrl.launch", "vlmrl.data_parallel", "vlmrl.gguf_release", "vlmrl.export_checks",
               "vlmrl.portable", "vlmrl.metric_files"),
    "models": ("vlmrl.models", "vlmrl.rollout", "vlmrl.training_attention", "vlmrl.compiled_layers", "vlmrl.nonfinite",
               "vlmrl.trainers", "vlmrl.trainer_config", "vlmrl.nf4_linear", "vlmrl.pixel_values"),
    "stages": ("vlmrl.evaluation", "vlmrl.training", "vlmrl.verify", "vlmrl.export",
               "vlmrl.sft"),
    "apps": ("vlmrl.cli", "vlmrl.ui", "vlmrl.publish", "vlmrl.orchestration", "vlmrl.recipes",
             "vlmrl.serve", "vlmrl.serve_app"),
}
# Floors whose units (the names listed) must not import one another.
PEER_FLOORS = {"stages"}
# Floors whose modules import torch when imported.
TORCH_FLOORS = {"models", "stages"}
# Modules that must start without torch: scoring in the UI, `vlmrl pull`, prepare_data.
LIGHT = ("vlmrl.scoring", "vlmrl.rewards", "vlmrl.publish", "vlmrl.cli", "vlmrl.ui",
         "vlmrl.data", "vlmrl.data_sources")


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


def unit_of(module: str) -> tuple[str, str] | None:
    """(floor, listed name) of a module: its longest prefix that FLOORS lists."""
    if module == "vlmrl":  # the package itself, which imports nothing
        return "ground", module
    matches = [(len(name), floor, name) for floor, names in FLOORS.items() for name in names
               if module == name or module.startswith(name + ".")]
    if not matches:
        return None
    _length, floor, name = max(matches)
    return floor, name


def reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


GRAPH = import_graph()
FLOOR_ORDER = list(FLOORS)


# ------------------------------------------------------------------------ tests


def test_the_graph_sees_the_imports() -> None:
    """Guards the tests below against an empty or misread graph."""
    assert "vlmrl.models.loading" in GRAPH["vlmrl.evaluation"]
    assert "vlmrl.models" in GRAPH["vlmrl.evaluation"]  # the package of an imported submodule
    assert "vlmrl.scoring" in GRAPH["vlmrl.rewards"]  # `from vlmrl import scoring`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_is_on_a_floor() -> None:
    homeless = [module for module in GRAPH if unit_of(module) is None]
    assert not homeless, f"list these modules' packages in FLOORS: {homeless}"


def test_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_upward_import_and_no_peer_import(module: str) -> None:
    if unit_of(module) is None:
        pytest.fail(f"{module} is on no floor")
    floor, unit = unit_of(module)
    problems = []
    for target in sorted(GRAPH[module]):
        if unit_of(target) is None:
            problems.append(f"{target}, which is on no floor")
            continue
        target_floor, target_unit = unit_of(target)
        if FLOOR_ORDER.index(target_floor) > FLOOR_ORDER.index(floor):
            problems.append(f"{target} is on the floor above ({target_floor})")
        elif floor in PEER_FLOORS and target_floor == floor and target_unit != unit:
            problems.append(f"{target} is a peer on the {floor} floor")
    assert not problems, f"{module} imports " + "; ".join(problems)


def test_models_import_only_the_ground_floor() -> None:
    """The brief's rule for vlmrl.models, stated on its own: nothing from stages or apps."""
    models = [module for module in GRAPH if unit_of(module) == ("models", "vlmrl.models")]
    assert "vlmrl.models.loading" in models
    upward = {module: sorted(t for t in GRAPH[module]
                             if (unit_of(t) or ("",))[0] not in {"ground", "models"})
              for module in models}
    assert not {m: t for m, t in upward.items() if t}


@pytest.mark.parametrize("unit", LIGHT)
def test_light_modules_never_reach_torch_bound_modules(unit: str) -> None:
    modules = [module for module in GRAPH if (unit_of(module) or ("", ""))[1] == unit]
    assert modules, f"no module {unit} (renamed? update LIGHT)"
    heavy = {module: sorted(target for target in reachable(GRAPH, module)
                            if (unit_of(target) or ("",))[0] in TORCH_FLOORS)
             for module in modules}
    assert not {m: t for m, t in heavy.items() if t}, f"{unit} imports (transitively) {heavy}"


MAX_MODULE_LINES = 470  # "no module over ~450 lines": a module that grows past it is split by job


def test_no_module_is_too_long_to_read() -> None:
    lengths = {module: len(path.read_text(encoding="utf-8").splitlines())
               for module, path in module_files().items()}
    assert not {m: n for m, n in lengths.items() if n > MAX_MODULE_LINES}
