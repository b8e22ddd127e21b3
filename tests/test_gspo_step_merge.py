"""`benchmarks/gspo_step.py --merge`: the results of several device calls, each recording the
command it ran, combine into one file whose runs, calls and summaries are those of one file
holding them all; calls on different devices are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import ROOT, run

STORED = ROOT / "benchmarks" / "results" / "gspo_step_h200x2_pool_2b.json"
SCRIPT = ROOT / "benchmarks" / "gspo_step.py"


def split(tmp_path: Path) -> tuple[dict, list[Path]]:
    """The stored results of several bench calls, written back as one file per call."""
    whole = json.loads(STORED.read_text())
    files = []
    for index, call in enumerate(whole["device_calls"]):
        part = {key: value for key, value in whole.items() if key not in ("runs", "results")}
        part.update(device_calls=[call], runs={key: whole["runs"][key] for key in call["runs"]})
        files.append(tmp_path / f"call{index}.json")
        files[-1].write_text(json.dumps(part))
    return whole, files


def test_merged_calls_equal_the_file_that_held_them_all(tmp_path: Path) -> None:
    whole, files = split(tmp_path)
    assert len(files) >= 2
    out = tmp_path / "merged.json"
    run([sys.executable, str(SCRIPT), "--merge", *map(str, files), "--out", str(out)], ROOT)
    merged = json.loads(out.read_text())
    called = {key for call in whole["device_calls"] for key in call["runs"]}
    assert merged["runs"] == {key: whole["runs"][key] for key in called}
    assert merged["device_calls"] == whole["device_calls"]
    assert all(call["command"].startswith("tests/gpu/run_on_device.sh ")
               and " bench " in call["command"] for call in merged["device_calls"])
    if called == set(whole["runs"]):  # the summaries are recomputed from the same runs
        assert merged["results"] == whole["results"]


def test_calls_on_different_devices_are_refused(tmp_path: Path) -> None:
    _, files = split(tmp_path)
    other = json.loads(files[-1].read_text())
    other["device"] = "NVIDIA H200"
    files[-1].write_text(json.dumps(other))
    result = run([sys.executable, str(SCRIPT), "--merge", *map(str, files),
                  "--out", str(tmp_path / "merged.json")], ROOT, check=False)
    assert result.returncode != 0
    assert "--merge: the files were measured on different devices" in result.stderr
    assert not (tmp_path / "merged.json").exists()
