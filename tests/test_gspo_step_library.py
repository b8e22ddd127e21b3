"""`benchmarks/gspo_step.py`'s configurations that run another library or kernel: the float8
profile before (the library of BASELINE_COMMIT, whose params refuse the keys added since, so it
reads its own commit's params.yaml) and the `_narrow` ones (the NF4 decode kernel's earlier
tiles)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from conftest import ROOT, benchmark_fixture

from vlmrl.training.rollout.nf4_decode import TILES, Tiles

gspo_step = benchmark_fixture("gspo_step")
gspo_worker = benchmark_fixture("gspo_worker")


def baseline_copy(tmp_path: Path, with_params: bool) -> Path:
    """A stand-in for `git archive BASELINE_COMMIT src params.yaml` unpacked in tmp_path."""
    (tmp_path / "src" / "vlmrl").mkdir(parents=True)
    (tmp_path / "src" / "vlmrl" / "__init__.py").write_text("")
    if with_params:
        (tmp_path / "params.yaml").write_text("model: {}\n")
    return tmp_path / "src"


def test_the_baseline_needs_its_own_params_beside_its_src(gspo_step, tmp_path: Path) -> None:
    knobs = gspo_step.CONFIGS["gpu_profile_graph_fp8_before"]
    with pytest.raises(SystemExit, match="params.yaml beside it"):
        gspo_step.worker_env(knobs, baseline_copy(tmp_path, with_params=False))


def test_a_worker_on_the_baseline_reads_the_baseline_params(gspo_step, gspo_worker,
                                                             tmp_path: Path, monkeypatch) -> None:
    src = baseline_copy(tmp_path, with_params=True)
    env = gspo_step.worker_env(gspo_step.CONFIGS["gpu_profile_graph_fp8_before"], src)
    assert env["PYTHONPATH"].split(":")[0] == str(src.resolve())
    assert gspo_worker.library_params() == ROOT / "params.yaml"  # this library: the repository's
    monkeypatch.setitem(sys.modules, "vlmrl", type(sys)("vlmrl"))
    sys.modules["vlmrl"].__file__ = str(src / "vlmrl" / "__init__.py")
    assert gspo_worker.library_params() == tmp_path.resolve() / "params.yaml"


@pytest.mark.parametrize("name", ["gpu_profile_graph_fp8_compiled",
                                  "gpu_profile_graph_fp8_mb4_compiled"])
def test_narrow_runs_the_recipe_on_the_one_block_kernel(gspo_step, name: str) -> None:
    narrow = gspo_step.CONFIGS[f"{name}_narrow"]
    assert {key: value for key, value in narrow.items() if key != "decode_tiles"} == \
        gspo_step.CONFIGS[name]
    tiles = Tiles(**narrow["decode_tiles"])
    assert (tiles.k_blocks, tiles.xa_precision) == (1, "ieee")
    assert (TILES.k_blocks, TILES.xa_precision) != (1, "ieee")  # the shipped tiles differ


@pytest.mark.parametrize("name", ["gpu_profile_graph_fp8_rolled_compiled",
                                  "gpu_profile_graph_fp8_mb4_rolled_compiled"])
def test_lanes_runs_the_recipe_on_the_tiles_it_was_timed_with_in_lane_order(gspo_step,
                                                                             name: str) -> None:
    lanes = gspo_step.CONFIGS[f"{name}_lanes"]
    assert {key: value for key, value in lanes.items() if key != "decode_tiles"} == \
        gspo_step.CONFIGS[name]
    assert Tiles(**lanes["decode_tiles"]) == dataclasses.replace(TILES, lane_order=True,
                                                                 partials="float32")


@pytest.mark.parametrize("name", ["gpu_profile_graph_fp8_rolled_compiled",
                                  "gpu_profile_graph_fp8_mb4_rolled_compiled"])
def test_parts_run_the_recipe_on_the_shipped_tiles_and_the_tiles_before(gspo_step,
                                                                        name: str) -> None:
    for suffix, tiles in (("parts_bf16", TILES),
                          ("parts_float32", dataclasses.replace(TILES, partials="float32"))):
        parts = gspo_step.CONFIGS[f"{name}_{suffix}"]
        assert {key: value for key, value in parts.items() if key != "decode_tiles"} == \
            gspo_step.CONFIGS[name]
        assert Tiles(**parts["decode_tiles"]) == tiles


def test_nf4_linears_variants_change_only_their_knobs(gspo_step) -> None:
    """The `_nf4_linears` variants are the recipe's profile with `nf4_linears` (and reentrant
    checkpointing) on, nothing else."""
    for suffix in ("nf4_linears", "reentrant_nf4_linears"):
        knobs = gspo_step.CONFIGS[f"gpu_profile_graph_fp8_rolled_compiled_{suffix}"]
        assert knobs["nf4_linears"] is True and set(knobs) <= {
            *gspo_step.CONFIGS["gpu_profile_graph_fp8_rolled_compiled"], "nf4_linears",
            "gradient_checkpointing_kwargs"}
