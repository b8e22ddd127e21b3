"""Params come from one `params.yaml`, one section per stage, as DVC tracks them. Reading them
in one place gives every stage the same error for a missing or mistyped key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

PARAMS_FILE = Path("params.yaml")


class ParamsError(ValueError):
    """A params value is missing or wrong; the message names the key."""


def load_params(path: Path | str = PARAMS_FILE) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found (run from the repository root)")
    with path.open(encoding="utf-8") as handle:
        params = yaml.safe_load(handle) or {}
    if not isinstance(params, dict):
        raise ParamsError(f"{path}: expected a mapping at the top level")
    return params


def section(params: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The `name` section; a dotted name walks into nested sections."""
    node: Any = params
    for part in name.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ParamsError(f"params.yaml has no `{name}` section")
        node = node[part]
    if not isinstance(node, Mapping):
        raise ParamsError(f"params.yaml `{name}` must be a mapping, got {type(node).__name__}")
    return dict(node)


def require(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in mapping:
        raise ParamsError(f"params.yaml `{where}.{key}` is missing")
    return mapping[key]
