"""The environment DVC and the pipeline's stages run in, for every process that starts them
(the Prefect tasks, the tests, the benchmarks): stages run `python` and `dvc`, which must be this
interpreter's, and nothing phones home.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def dvc_env() -> dict[str, str]:
    """The environment DVC and the stages run in: this interpreter's venv first on PATH (stages
    run `python` and `dvc`), analytics off."""
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env

