"""A release must stand on its own: someone who pulls it on another machine needs to know which
base model it belongs to, and nothing in it may name the machine that made it. PEFT writes the
local directory it loaded the base from into `adapter_config.json` (for the built-in tiny models
a path under this machine's cache), transformers writes `local_files_only` and `is_local` into the
tokenizer config (settings of one run, which flip between runs and so change the release's hash),
and llama.cpp's converter names a GGUF file after the staging folder it read. This module turns
each of them into a name that means the same everywhere, and finds what is left
(`machine_values_in`), so that the upload refuses a release that still carries one."""

from __future__ import annotations

import getpass
import json
import mmap
import socket
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vlmrl.cache import cache_root

EMBEDDED_PREFIX = "embedded:"
ADAPTER_CONFIG = "adapter_config.json"
# Written by PEFT's save_pretrained: its empty template ("Model Card for Model ID ... [More
# Information Needed]"); the upload stage publishes a real card in its place.
TEMPLATE_CARD = "README.md"
# Settings of the run that saved a file, not of the model.
MACHINE_KEYS = ("local_files_only", "is_local")
# A host or user name shorter than this is a word of any vocabulary ("vm", "root"): only its
# appearance in a path (home folder, cache) is looked for then.
MIN_NAME_LENGTH = 5
TEXT_SUFFIXES = (".json", ".md", ".jinja", ".txt", ".yaml", ".yml", "Modelfile")


def release_base_name(model_name: str) -> str:
    """The base model as a release names it: the hub id or the built-in model's name
    (`embedded:tiny-qwen3-vl`, rebuilt by the project from its seed); a local directory by its
    folder name, as `local:NAME`, since its path means nothing elsewhere."""
    if model_name.startswith(EMBEDDED_PREFIX) or not _is_local_path(model_name):
        return model_name
    return f"local:{Path(model_name).name}"


def _is_local_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def make_adapter_portable(adapter_dir: Path, model_name: str) -> None:
    """Names the base model by `release_base_name` in adapter_config.json, drops PEFT's template
    card and the machine's settings from the saved tokenizer files. PEFT keeps `target_modules`
    as a set, which it writes in the order of that run's string hashes: sorted, the file is the
    same for the same adapter."""
    config_path = Path(adapter_dir) / ADAPTER_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = release_base_name(model_name)
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (Path(adapter_dir) / TEMPLATE_CARD).unlink(missing_ok=True)
    strip_machine_settings(adapter_dir)


def strip_machine_settings(directory: Path) -> list[str]:
    """Removes MACHINE_KEYS from every top-level JSON file of `directory`; returns the files
    rewritten."""
    rewritten = []
    for path in sorted(Path(directory).glob("*.json")):
        payload = json.loads(path.read_text(encoding="utf-8"))
        cleaned = _without_keys(payload, MACHINE_KEYS)
        if cleaned != payload:
            path.write_text(json.dumps(cleaned, indent=2, ensure_ascii=False) + "\n",
                            encoding="utf-8")
            rewritten.append(path.name)
    return rewritten


def _without_keys(value: Any, keys: Iterable[str]) -> Any:
    keys = tuple(keys)
    if isinstance(value, Mapping):
        return {k: _without_keys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [_without_keys(item, keys) for item in value]
    return value


def gguf_metadata(model_name: str) -> dict[str, Any]:
    """The converter's `--metadata` override: general.name and friends from the base model, not
    from the (randomly named) staging folder the merged model sits in."""
    base = release_base_name(model_name)
    basename = base.removeprefix(EMBEDDED_PREFIX).rsplit("/", 1)[-1]
    return {"general.name": f"{basename}-gspo", "general.basename": basename,
            "general.finetune": "gspo"}


# ------------------------------------------------------------------ finding what is left


def machine_values(extra: Iterable[str] = ()) -> list[str]:
    """Strings that name this machine: its home and cache folders (as path prefixes), the temp
    folder, the host and user name where long enough not to be ordinary words, and the run
    settings of MACHINE_KEYS."""
    home = str(Path.home())
    values = {f"{home}/", f"{cache_root()}/", f"{tempfile.gettempdir()}/", *MACHINE_KEYS,
              *extra}
    for name in (socket.gethostname(), getpass.getuser()):
        if len(name) >= MIN_NAME_LENGTH:
            values.add(name)
        values.add(f"/home/{name}/")
    return sorted(value for value in values if value and value != "/")


def machine_values_in(paths: Iterable[Path], values: Iterable[str] | None = None,
                      text_only: bool = False) -> list[str]:
    """`file: value` for every machine value found in the files (bytes, so binary files count;
    `text_only` reads only the text files of TEXT_SUFFIXES)."""
    needles = [(value, value.encode("utf-8")) for value in (values or machine_values())]
    found = []
    for path in paths:
        if text_only and not path.name.endswith(TEXT_SUFFIXES):
            continue
        found += [f"{path}: {value}" for value in _found_in(path, needles)]
    return found


def _found_in(path: Path, needles: list[tuple[str, bytes]]) -> list[str]:
    """The values whose bytes occur in the file, read through mmap (a GGUF file can be 16 GB)."""
    if path.stat().st_size == 0:
        return []
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return [value for value, needle in needles if data.find(needle) >= 0]
