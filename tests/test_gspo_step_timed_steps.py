"""`benchmarks/gspo_step.py` times whole generation cycles: a configuration that generates once
for two optimizer steps, timed over one, would report the tokens of no generation at all."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT, benchmark_fixture

gspo_step = benchmark_fixture("gspo_step")


def knobs(steps_per_generation: int, accumulation: int) -> dict:
    return {"steps_per_generation": steps_per_generation,
            "gradient_accumulation_steps": accumulation}


@pytest.mark.parametrize(("steps_per_generation", "accumulation", "steps"),
                         [(2, 2, 1), (4, 2, 2), (4, 2, 4), (4, 8, 1), (12, 4, 3)])
def test_whole_generation_cycles_are_accepted(gspo_step, steps_per_generation, accumulation,
                                              steps) -> None:
    gspo_step.check_timed_steps("c", knobs(steps_per_generation, accumulation), steps)


@pytest.mark.parametrize(("steps_per_generation", "accumulation", "steps", "cycle"),
                         [(4, 2, 1, 2), (4, 2, 3, 2), (12, 4, 4, 3), (6, 4, 1, 3)])
def test_part_of_a_cycle_is_refused_naming_the_param_and_the_cycle(
        gspo_step, steps_per_generation, accumulation, steps, cycle) -> None:
    with pytest.raises(SystemExit, match=rf"--steps {steps}: c .* a multiple of {cycle}$"):
        gspo_step.check_timed_steps("c", knobs(steps_per_generation, accumulation), steps)


def test_the_shipped_profile_timed_over_one_step_is_refused(gspo_step) -> None:
    config = "gpu_profile_mb8_spg4_rows16"
    with pytest.raises(SystemExit, match="multiple of 2"):
        gspo_step.check_timed_steps(config, gspo_step.CONFIGS[config], 1)
    gspo_step.check_timed_steps(config, gspo_step.CONFIGS[config], 2)


def test_every_configuration_accepts_the_documented_runs_steps(gspo_step) -> None:
    for config in ("unsloth_4bit", "gpu_profile_mb8_spg4_rows16", "gpu_profile_graph_fp8_before",
                   "gpu_profile_graph_fp8_mb4_rolled_compiled_images"):
        gspo_step.check_timed_steps(config, gspo_step.CONFIGS[config], 2)


def test_each_generation_used_twice_doubles_the_cycle(gspo_step) -> None:
    gspo_step.check_timed_steps("c", knobs(4, 2), 4, num_iterations=2)
    with pytest.raises(SystemExit, match="multiple of 4$"):
        gspo_step.check_timed_steps("c", knobs(4, 2), 2, num_iterations=2)


def test_the_runs_num_iterations_come_from_the_params_it_reads(gspo_step, tmp_path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "params.yaml").write_text("train:\n  grpo:\n    num_iterations: 3\n")
    before = gspo_step.CONFIGS["gpu_profile_graph_fp8_before"]
    assert gspo_step.grpo_num_iterations(before, tmp_path / "src") == 3
    shipped = gspo_step.CONFIGS["gpu_profile_mb8_spg4_rows16"]
    repository = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["grpo"]
    assert (gspo_step.grpo_num_iterations(shipped, tmp_path / "src")
            == repository["num_iterations"])
