"""Time to build the embedded tiny Qwen3-VL from scratch (target: under 30 s on 2 cores) and to
find it again in the cache.

    python benchmarks/embedded_build.py
"""

from __future__ import annotations

import os
import tempfile
import time


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="vlmrl-cache-") as cache:
        os.environ["VLMRL_CACHE"] = cache
        from vlmrl.models.embedded import ensure_embedded_model

        started = time.perf_counter()
        path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
        built = time.perf_counter() - started
        started = time.perf_counter()
        ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
        cached = time.perf_counter() - started
        size_mb = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20
    print(f"built in {built:.1f} s ({size_mb:.0f} MB on disk); cached lookup {cached * 1000:.1f} ms")


if __name__ == "__main__":
    main()
