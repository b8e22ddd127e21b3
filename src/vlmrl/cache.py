"""Where the project keeps what it builds or downloads once and reuses across runs: the embedded
models and the llama.cpp converter sources. `$VLMRL_CACHE`, else ~/.cache/vlmrl.

History: `cache_root` lived in `vlmrl.embedded`; the GGUF tools need it without importing torch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("VLMRL_CACHE", Path.home() / ".cache" / "vlmrl"))
