"""Every function and class a package exports from its `__init__` (its `__all__`, or without
one the names it imports from vlmrl), and every function of a stage script, says what it does in
a docstring. Read with `ast` (nothing is imported), following each re-export to the module that
defines the name; a dataclass's generated `__doc__` does not count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def module_path(module: str) -> Path | None:
    """The source file of `module` under src/, or None where there is none."""
    base = SRC.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def exported_names(init: Path) -> list[str]:
    """A package's exports: its `__all__`, else the names it imports from vlmrl modules."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets):
            return list(ast.literal_eval(node.value))
    return [alias.asname or alias.name for node in tree.body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlmrl")
            for alias in node.names]


def definition(module: str, name: str) -> Definition | None:
    """The def or class statement that `module`'s `name` is, followed through `from vlmrl...
    import`s; None for a constant or a module."""
    path = module_path(module)
    if path is None:
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, Definition) and node.name == name:
            return node
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlmrl"):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    if module_path(f"{node.module}.{alias.name}") is not None:
                        return None  # a submodule, not a function or class
                    return definition(node.module, alias.name)
    return None


def package_exports() -> dict[str, Definition]:
    """Every function and class exported by a package `__init__` under src/vlmrl, by its
    dotted export name."""
    found = {}
    for init in sorted((SRC / "vlmrl").rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(SRC).parts)
        for name in exported_names(init):
            node = definition(package, name)
            if node is not None:
                found[f"{package}.{name}"] = node
    return found


def test_every_exported_function_and_class_has_a_docstring() -> None:
    exports = package_exports()
    assert "vlmrl.publish.publish" in exports and "vlmrl.data.synth.generate" in exports
    missing = sorted(name for name, node in exports.items() if not ast.get_docstring(node))
    assert not missing, f"exported without a docstring: {missing}"


def test_every_function_of_a_stage_script_has_a_docstring() -> None:
    scripts = sorted((ROOT / "stages").glob("*.py"))
    assert scripts
    missing = [f"{script.relative_to(ROOT)}:{node.lineno} {node.name}"
               for script in scripts
               for node in ast.walk(ast.parse(script.read_text(encoding="utf-8")))
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
               and not ast.get_docstring(node)]
    assert not missing, f"stage functions without a docstring: {missing}"


def test_a_re_export_is_followed_to_its_definition() -> None:
    """The check reads the statement that defines an exported name, not the import of it."""
    node = definition("vlmrl.publish", "PublishError")
    assert isinstance(node, ast.ClassDef) and node.name == "PublishError"
    assert definition("vlmrl.publish", "GROUPS") is None  # a constant: nothing to document
