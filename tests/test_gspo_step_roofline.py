"""benchmarks/gspo_step.py's measures and full table: decode steps per generation batch, the bytes
of weights a decode step reads, the fraction of the bandwidth bound, the phase timers and
profilers, and the docs table written from a results file (failed runs listed, ratios against
the Unsloth reference and TRL's generate)."""

from __future__ import annotations

import pytest
import torch
from conftest import benchmark_fixture
from transformers import AutoModelForCausalLM

measure = benchmark_fixture("gspo_measure")
tables = benchmark_fixture("gspo_tables")
profilers = benchmark_fixture("gspo_profilers")
configs = benchmark_fixture("gspo_configs")


def test_decode_steps_count_every_generate_call(measure) -> None:
    completions = [[1] * 30, [1] * 12, [1] * 7, [1] * 30]
    assert measure.decode_steps_of(completions, {"max_generation_rows": None}) == 30
    assert measure.decode_steps_of(completions, {"max_generation_rows": 2}) == 60


def test_weight_bytes_count_tied_weights_once(measure) -> None:
    from vlmrl.models.embedded import ensure_embedded_model

    model = AutoModelForCausalLM.from_pretrained(
        str(ensure_embedded_model("embedded:tiny-qwen3", seed=0)), dtype=torch.bfloat16)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert measure.decode_weight_bytes(model) == sum(unique.values())


def test_fraction_and_table(measure, tables, configs, tmp_path) -> None:
    run = {"decode_steps_per_second": 100.0, "decode_weight_bytes": 2e9}
    assert measure.bandwidth_fraction(run, 4e12) == pytest.approx(0.05)
    assert measure.bandwidth_fraction({}, 4e12) is None

    def measured(config: str, tokens_per_s: float) -> dict:
        return {"config": config, "completion_length": 1024, "model": configs.MODEL,
                "seconds_per_step": 16384 / tokens_per_s, "generated_tokens_per_second":
                tokens_per_s, "generation_only_tokens_per_second": tokens_per_s * 2,
                "decode_steps_per_second": 50.0, "decode_weight_bytes": 1.5e9,
                "bandwidth_fraction": 0.025, "peak_allocated_gib": 4.0, "peak_reserved_gib": 5.0}

    results = {"device": "GPU X", "bandwidth_bytes_per_s": 3e12, "runs": {
        "unsloth_4bit@1024": measured("unsloth_4bit", 100.0),
        f"{configs.GPU_PROFILE}@1024": measured(configs.GPU_PROFILE, 400.0),
        "gpu_profile_graph_merged@1024": measured("gpu_profile_graph_merged", 1200.0),
        "gpu_profile_graph@256": {"config": "gpu_profile_graph", "completion_length": 256,
                                  "error": "no result after 9 s (timed out or crashed)"}}}
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{tables.DOC_START}\nold\n{tables.DOC_END}\nafter\n")
    tables.write_doc_table(results, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    merged_row = next(line for line in text.splitlines() if "gpu_profile_graph_merged" in line)
    assert merged_row.endswith("| 12.00x | 3.00x |")
    assert "| 2.5 |" in merged_row  # % of bound
    assert "3.00 TB/s" in text and "`gpu_profile_graph@256`: no result after 9 s" in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="no <!-- gspo_step roofline"):
        tables.write_doc_table(results, doc)


def test_phase_table_sets_the_first_micro_batch_after_a_generation_apart(tables) -> None:
    run = {"config": "gpu_profile_graph", "completion_length": 1024, "warmup_steps": 1,
           "timed_steps": 2, "seconds_per_step": (1.7 + 9.0) / 2,
           "generation_calls": [{"step": 0}, {"step": 2}],
           "seconds_by_phase": {"generation": 6.5, "old_logps": 0.6, "loss": 0.7, "backward": 1.0,
                                "prompts": 0.25, "rewards": 0.05, "prepare_inputs": 7.6,
                                "training_step": (1.6 + 8.8) / 2},
           "phase_calls": {"loss": [[0, 9.0], [1, 0.3], [1, 0.3], [2, 1.5], [2, 0.3]],
                           "backward": [[0, 9.0], [1, 0.5], [1, 0.5], [2, 2.0], [2, 0.5]]}}
    first, others = tables.micro_batch_seconds(run)
    assert first == [pytest.approx(3.5)]  # step 0 is warm-up: left out
    assert others == [pytest.approx(0.8)] * 3
    lines = tables.phase_table([run, {"config": "unsloth_4bit", "completion_length": 1024}])
    row = next(line for line in lines if "gpu_profile_graph" in line)
    assert row == ("| qwen3-vl-2b-shape | `gpu_profile_graph` | 1024 | 6.50 | 0.60 | 0.25 | 0.20 | "
                   "0.70 | 1.00 | 0.15 | 3.50 | 0.80 |")  # 7.6 s of inputs, 7.4 of them timed parts
    assert tables.optimizer_seconds(run) == pytest.approx((0.1 + 0.2) / 2)  # steps 1 and 2
    untimed = {key: value for key, value in run.items() if key != "seconds_per_step"}
    assert "| 1.00 | - | 3.50 |" in tables.phase_table([untimed])[-1]
    without_inputs = {**run, "seconds_by_phase": {"generation": 6.5}}
    assert "| 6.50 | - | - | - | - | - |" in tables.phase_table([without_inputs])[-1]
    assert not any("unsloth_4bit" in line for line in lines)
    assert tables.phase_table([{"config": "x", "completion_length": 1}]) == []


def test_training_kernel_table_shows_each_profiled_runs_largest_kernels(tables) -> None:
    kernels = [{"kernel": f"kernel_{i}<a|b>", "calls_per_step": 2 * i, "ms_per_step": 100.0 - i}
               for i in range(tables.TRAINING_KERNELS_SHOWN + 3)]
    run = {"config": "gpu_profile_graph_fp8", "completion_length": 1024,
           "training_kernels": kernels}
    lines = tables.training_kernel_table([run, {"config": "x", "completion_length": 1}])
    rows = [line for line in lines if line.startswith("| qwen3-vl-2b-shape")]
    assert len(rows) == tables.TRAINING_KERNELS_SHOWN
    assert rows[1] == "| qwen3-vl-2b-shape | `gpu_profile_graph_fp8` | `kernel_1<a/b>` | 2 | 99.0 |"
    assert not any("`x`" in line for line in lines)
    assert tables.training_kernel_table([{"config": "x", "completion_length": 1}]) == []


def test_training_busy_table_shows_each_micro_batchs_busy_share(tables) -> None:
    run = {"config": "gpu_profile_graph", "completion_length": 1024,
           "training_busy": [{"wall_s": 0.8, "gpu_busy_s": 0.2, "kernels": 900},
                             {"wall_s": 0.5, "gpu_busy_s": 0.4, "kernels": 950}]}
    lines = tables.training_busy_table([run, {"config": "x", "completion_length": 1}])
    rows = [line for line in lines if line.startswith("| qwen3")]
    assert rows == ["| qwen3-vl-2b-shape | `gpu_profile_graph` | 1 | 0.800 | 0.200 | 25% | 900 |",
                    "| qwen3-vl-2b-shape | `gpu_profile_graph` | 2 | 0.500 | 0.400 | 80% | 950 |"]
    assert tables.training_busy_table([{"config": "x", "completion_length": 1}]) == []


def test_training_host_table_shows_the_functions_of_most_own_time(tables) -> None:
    functions = [{"function": f"f.py:{i}(f{i})", "calls": i, "own_s": 1.0 / i,
                  "cumulative_s": 2.0 / i} for i in range(1, 20)]
    run = {"config": "gpu_profile_graph", "completion_length": 1024,
           "training_host_profile": {"step": 4, "micro_batches": 2, "wall_s": 3.0,
                                     "by_own": functions, "by_cumulative": functions}}
    rows = [line for line in tables.training_host_table([run]) if line.startswith("| qwen3")]
    assert len(rows) == tables.TRAINING_HOST_SHOWN
    assert rows[1] == "| qwen3-vl-2b-shape | `gpu_profile_graph` | `f.py:2(f2)` | 2 | 0.500 | 1.000 |"
    assert tables.training_host_table([{"config": "x", "completion_length": 1}]) == []


def test_time_phases_records_each_call_with_its_step(measure) -> None:
    from types import SimpleNamespace

    trainer = SimpleNamespace(state=SimpleNamespace(global_step=3),
                              accelerator=SimpleNamespace(backward=lambda loss: None))
    for method in [*measure.PHASES, "_get_per_token_logps_and_entropies"]:
        setattr(trainer, method, lambda *args, **kwargs: "done")
    calls = measure.time_phases(trainer)
    assert trainer.compute_loss() == "done"
    trainer.state.global_step = 4
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies()
    trainer._get_per_token_logps_and_entropies()  # with grad: the loss's own pass, not timed
    trainer.accelerator.backward(1.0)
    assert [step for step, _ in calls["loss"]] == [3]
    assert [step for step, _ in calls["old_logps"]] == [4]
    assert [step for step, _ in calls["backward"]] == [4]
    assert measure.phase_means(calls, warmup=4, timed_steps=1)["loss"] == 0.0
    import gc

    gc.callbacks.pop()  # time_phases' garbage-collection timer


def test_a_profiled_step_after_the_timed_ones_is_left_out_of_the_timings(measure, tables) -> None:
    run = {"config": "gpu_profile_graph", "completion_length": 1024, "warmup_steps": 1,
           "timed_steps": 2, "generation_calls": [{"step": 0}, {"step": 2}],
           "phase_calls": {"loss": [[1, 0.3], [2, 1.5], [3, 50.0]],
                           "backward": [[1, 0.5], [2, 2.0], [3, 50.0]]}}
    first, others = tables.micro_batch_seconds(run)
    assert first == [pytest.approx(3.5)] and others == [pytest.approx(0.8)]
    means = measure.phase_means({"loss": [(0, 9.0), (1, 0.3), (2, 1.5), (3, 50.0)]}, 1, 2)
    assert means == {"loss": pytest.approx(0.9)}


def test_profile_training_records_the_operators_of_one_optimizer_step(profilers) -> None:
    from types import SimpleNamespace

    weights = torch.randn(64, 64)
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=1))
    trainer.training_step = lambda batch: (batch @ weights).relu().sum()
    kernels, busy = profilers.profile_training(trainer, step=2)
    trainer.training_step(torch.randn(8, 64))
    assert kernels == [] and busy == []  # another step: not profiled
    trainer.state.global_step = 2
    for _ in range(3):  # the step's micro-batches, added up
        trainer.training_step(torch.randn(8, 64))
    assert busy == [{}] * 3  # one entry a micro-batch; no GPU here, so no busy time
    by_name = {k["kernel"]: k for k in kernels}
    assert by_name["aten::mm"]["calls_per_step"] == 3
    assert all(k["ms_per_step"] > 0 for k in kernels)
    assert [k["ms_per_step"] for k in kernels] == sorted((k["ms_per_step"] for k in kernels),
                                                        reverse=True)


def test_union_length_counts_overlapping_kernels_once(profilers) -> None:
    assert profilers.union_length([]) == 0.0
    assert profilers.union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert profilers.union_length([(0.0, 10.0), (1.0, 2.0), (3.0, 4.0)]) == 10.0  # nested
    assert profilers.union_length([(0.0, 1.0), (1.0, 2.0)]) == 2.0  # end to end


def test_training_host_profile_covers_one_step_without_its_generation(profilers) -> None:
    from types import SimpleNamespace

    def busy_python(count: int) -> int:
        return sum(i * i for i in range(count))

    def generate() -> int:
        return busy_python(200_000)

    trainer = SimpleNamespace(state=SimpleNamespace(global_step=1))
    profiler = None

    def training_step(count: int) -> int:
        with profiler.paused():
            generate()
        return busy_python(count)

    trainer.training_step = training_step
    profiler = profilers.TrainingHostProfile(trainer, step=2, top=5)
    trainer.training_step(10)
    assert profiler.result() == {}  # another step: not profiled
    trainer.state.global_step = 2
    for _ in range(2):
        trainer.training_step(50_000)
    result = profiler.result()
    assert result["micro_batches"] == 2 and result["wall_s"] > 0
    functions = [row["function"] for row in result["by_cumulative"]]
    assert any("busy_python" in name for name in functions)
    assert not any("generate" in name for name in functions)  # paused: left out
    assert len(result["by_own"]) <= 5
