"""benchmarks/nf4_registers.py: the launch it compiles is the one `nf4_matmul` makes, and a
compile on this CPU reports registers and the programs an SM keeps by them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, load_benchmark

from vlmrl.training.rollout.nf4_decode import TILES, k_splits


@pytest.fixture(scope="module")
def registers():
    return load_benchmark("nf4_registers")


def test_the_recorded_launch_is_nf4_matmuls(registers) -> None:
    tiles = dataclasses.replace(registers.NARROW, xa_chunk=16, max_registers=168)
    arguments, options = registers.recorded_launch(12288, 4096, tiles)
    assert arguments["kernel"] == "nf4_lora_matmul"
    splits = k_splits(12288, 4096, tiles, registers.SMS)
    assert arguments["K_SPLIT"] == 4096 // splits
    assert (arguments["N"], arguments["K"], arguments["M"]) == (12288, 4096, registers.ROWS)
    assert (arguments["XA_CHUNK"], arguments["HAS_LORA"], arguments["NESTED"]) == (16, True, True)
    assert options == {"num_warps": 4, "num_stages": 3, "maxnreg": 168}


def test_the_shipped_tiles_record_the_wide_kernel(registers) -> None:
    arguments, _ = registers.recorded_launch(12288, 4096, TILES)
    assert arguments["kernel"] == "nf4_lora_matmul_wide"
    assert (arguments["KB"], arguments["XA_PRECISION"]) == (TILES.k_blocks, TILES.xa_precision)
    assert arguments["K_SPLIT"] == 4096 // k_splits(12288, 4096, TILES, registers.SMS)


def test_a_compile_reports_registers_and_programs_per_sm() -> None:
    """In a process of its own: the tests run Triton's interpreter, which compiles nothing."""
    pytest.importorskip("triton")
    script = ("import json, nf4_registers as r; "
              "print(json.dumps(r.compile_stats(*r.recorded_launch(1024, 2048, r.TILES))))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "benchmarks", env=env, check=False,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout.splitlines()[-1])
    threads = 32 * TILES.warps
    assert 0 < stats["registers"] <= 255
    assert stats["programs_per_sm_by_registers"] == min(
        65536 // (-(-stats["registers"] // 8) * 8 * threads), 2048 // threads)
