"""Where the project keeps what it builds or downloads once and reuses across runs: the embedded
models and the llama.cpp converter sources. `$VLMRL_CACHE`, else ~/.cache/vlmrl.

A module of its own so that the GGUF tools reach it without importing torch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("VLMRL_CACHE", Path.home() / ".cache" / "vlmrl"))
