"""benchmarks/scaling.py's arithmetic (phases per rank, tokens per second, speedups:
`scaling_tables`), its tables
and the params of its runs, on hand-made records: the runs themselves need two GPUs and are the
benchmark's job (a CPU run of it, `--smoke`, measures nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, benchmark_fixture, run

from vlmrl.distributed.launch import DistributedParams, resolve
from vlmrl.params import Params
from vlmrl.training.gspo import local_generation_rows, split_batch

scaling = benchmark_fixture("scaling")
tables = benchmark_fixture("scaling_tables")


def rank_record(rank: int, *, step_seconds=(5.0, 1.0, 4.0, 2.0), sync=(0.4, 0.5),
                plain=(0.3, 0.3), tokens=1000) -> dict:
    """Two warm-up and two timed optimizer steps of gradient accumulation 2: one unsynced and one
    synced backward each; one generation in the warm-up (step 0) and one timed (step 2)."""
    calls = [["generation", 0, 9.0], ["forward", 0, 9.0], ["backward", 0, 9.0],
             ["generation", 2, 2.0], ["wait", 2, 0.1], ["old_logps", 2, 0.5]]
    for step, (a, b) in zip((2, 3), zip(plain, sync, strict=True), strict=True):
        calls += [["forward", step, 0.2], ["backward", step, a], ["forward", step, 0.2],
                  ["wait", step, 0.05], ["backward_sync", step, b]]
    return {"rank": rank, "steps": [[i, s] for i, s in enumerate(step_seconds)],
            "calls": calls, "tokens": [[0, 100, 10], [2, tokens, 10]],
            "peak_allocated_gib": 10.0 + rank, "peak_reserved_gib": 12.0 + rank,
            "device_used_gib": 13.0 + rank, "allreduce_probe_s": 0.002}


def test_phases_split_the_synced_backward_into_backward_and_all_reduce(tables) -> None:
    phases = tables.rank_phases(rank_record(0), warmup=2)
    # per timed step: generation 2.0 / 2; all-reduce (0.1 + 0.2) / 2 over the mean unsynced 0.3;
    # backward (0.6 + 0.9 - 0.3) / 2; waiting (0.1 + 0.05 + 0.05) / 2; step (4 + 2) / 2
    assert phases == pytest.approx({"generation": 1.0, "old_logps": 0.25, "forward": 0.4,
                                    "backward": 0.6, "all_reduce": 0.15, "wait": 0.1,
                                    "step": 3.0, "other": 0.5})


def test_one_process_has_no_all_reduce_and_no_accumulation_no_estimate(tables) -> None:
    alone = rank_record(0)
    alone["calls"] = [c if c[0] != "backward_sync" else ["backward", c[1], c[2]]
                      for c in alone["calls"] if c[0] != "wait"]
    phases = tables.rank_phases(alone, warmup=2)
    assert phases["all_reduce"] == 0.0 and phases["wait"] == 0.0
    assert phases["backward"] == pytest.approx((0.3 + 0.4 + 0.3 + 0.5) / 2)
    synced_only = rank_record(0)
    synced_only["calls"] = [c for c in synced_only["calls"] if c[0] != "backward" or c[1] < 2]
    phases = tables.rank_phases(synced_only, warmup=2)
    assert phases["all_reduce"] is None
    assert phases["backward"] == pytest.approx((0.4 + 0.5) / 2)


def test_run_summary_counts_every_ranks_tokens_over_the_slowest_ranks_time(tables) -> None:
    slow = rank_record(1, step_seconds=(5.0, 1.0, 4.1, 2.1))
    summary = tables.run_summary([slow, rank_record(0)], warmup=2)
    assert summary["processes"] == 2 and summary["timed_steps"] == 2
    assert summary["seconds_per_step"] == pytest.approx(3.1)
    assert summary["generated_tokens_per_second"] == pytest.approx(round(2000 / 6.2, 1))
    assert (summary["completions_per_step"], summary["completions_per_step_per_gpu"]) == (10, 5)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    failed = tables.run_summary([rank_record(0), {"rank": 1, "error": "OutOfMemoryError: x"}], 2)
    assert failed == {"error": "OutOfMemoryError: x"}


def test_speedups_and_verdicts_against_the_goals(tables) -> None:
    runs = {"one": {"generated_tokens_per_second": 100.0},
            "strong": {"generated_tokens_per_second": 160.0},
            "weak": {"generated_tokens_per_second": 170.0}}
    gains = tables.speedups(runs)
    assert gains == {"strong": 1.6, "weak": 1.7}
    assert tables.verdict("strong", gains["strong"]).endswith("(goal 1.5x: met)")
    assert tables.verdict("weak", gains["weak"]).endswith("(goal 1.8x: not met)")
    assert tables.speedups({"one": {"generated_tokens_per_second": 100.0}})["weak"] is None


def results_files(tables, tmp_path: Path) -> list[Path]:
    """The 2B runs and the 8B runs as two device calls' files."""
    one = tables.run_summary([rank_record(0)], 2)
    strong = tables.run_summary([rank_record(0), rank_record(1)], 2)
    runs = {"one": {**one, "completion_length": 1024, "warmup_steps": 2},
            "strong": {**strong, "completion_length": 1024, "warmup_steps": 2},
            "weak": {"error": "RuntimeError: NCCL timeout"},
            "8b_one": {**tables.run_summary([rank_record(0)], 2), "strategy": "none"},
            "8b_sharded": {**strong, "strategy": "fsdp", "completion_length": 256}}
    paths = []
    for name, names in (("2b", ("one", "strong", "weak")), ("8b", ("8b_one", "8b_sharded"))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"device": "2 x NVIDIA H100 80GB HBM3 (79 GiB)",
                                         "runs": {n: runs[n] for n in names}}))
    return paths


def test_render_writes_the_tables_between_the_markers(scaling, tables, tmp_path: Path) -> None:
    """The tokens per second and verdicts into the block `:summary`, the phases and the 8B
    memory into the unnamed block."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text("before\n<!-- benchmarks/scaling.py:begin:summary -->\nOLD\n"
                   "<!-- benchmarks/scaling.py:end:summary -->\nbetween\n"
                   "<!-- benchmarks/scaling.py:begin -->\nOLD\n"
                   "<!-- benchmarks/scaling.py:end -->\nafter\n")
    merged = tmp_path / "scaling.json"
    run([sys.executable, "benchmarks/scaling.py", "--render",
         *map(str, results_files(tables, tmp_path)), "--doc", str(doc), "--out", str(merged)],
        ROOT)
    assert sorted(json.loads(merged.read_text())["runs"]) == sorted(scaling.RUNS)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "OLD" not in text
    lines = text.splitlines()
    # one: 1000 tokens in 6 s; strong: 2000 tokens in 6 s (1000 per rank)
    assert "| one | 1 | 1024 | 2 + 2 | 5 (5) | 3.00 | 167 | 1.00x |" in lines
    assert "| strong | 2 | 1024 | 2 + 2 | 10 (5) | 3.00 | 333 | 2.00x |" in lines
    assert any(line.startswith("| weak |") and "NCCL timeout" in line for line in lines)
    assert "- strong scaling: **2.00x** tokens/s (goal 1.5x: met)" in lines
    assert "- weak scaling: not measured" in lines
    assert ("| strong | 1 | 1.000 | 0.250 | 0.400 | 0.600 | 0.150 | 0.100 | 0.500 | 3.00 | "
            "2.00 |") in lines
    assert "| 8b_sharded | fsdp | 2 | 256 | 3.00 | 10.00, 11.00 | 12.00, 13.00 | 13.00, 14.00 |" in (
        lines)
    summary, details = text.split("between\n")
    assert "- weak scaling: not measured" in summary and "| 8b_sharded |" not in summary
    assert "| one | 1 | 1024 |" not in details and "| 8b_sharded |" in details


@pytest.mark.parametrize("name", ["one", "strong", "weak", "8b_one", "8b_sharded"])
def test_runs_are_the_recipes_at_their_process_count(scaling, name: str) -> None:
    raw = scaling.run_params(name, 1024, 4)
    params = Params(raw)
    train = params.train
    settings = resolve(DistributedParams.from_params(train.distributed), 0)
    expected = scaling.RUNS[name]
    assert settings.num_processes == expected["processes"]
    assert settings.strategy == {"one": "none", "strong": "ddp", "weak": "ddp", "8b_one": "none",
                                 "8b_sharded": "fsdp"}[name]
    assert params.model.name == expected["model"]
    assert params.model.load_in_4bit is not expected.get("sharded", False)
    grpo = split_batch(train.grpo, settings.num_processes)
    share = grpo["per_device_train_batch_size"] * grpo["steps_per_generation"]
    assert share == {"one": 32, "strong": 16, "weak": 32, "8b_one": 32, "8b_sharded": 16}[name]
    assert local_generation_rows(train.max_generation_rows, share) == min(
        train.max_generation_rows, share)
    assert (grpo["max_completion_length"], grpo["max_steps"]) == (1024, 4)
    if not expected.get("sharded"):  # the 2B recipe's profile itself
        assert (train.graph_decoding, train.kv_cache_dtype) == ("graph", "fp8")
