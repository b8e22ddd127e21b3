"""benchmarks/gspo_step.py's roofline (issue 23): decode steps per generation batch, the bytes of
weights a decode step reads, the fraction of the bandwidth bound, and the docs table written from
a results file (failed runs listed, ratios against the Unsloth reference and today's profile)."""

from __future__ import annotations

import pytest
import torch
from conftest import load_benchmark
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gspo_step")


def test_decode_steps_count_every_generate_call(bench) -> None:
    completions = [[1] * 30, [1] * 12, [1] * 7, [1] * 30]
    assert bench.decode_steps_of(completions, {"max_generation_rows": None}) == 30
    assert bench.decode_steps_of(completions, {"max_generation_rows": 2}) == 60


def test_weight_bytes_count_tied_weights_once(bench) -> None:
    from vlmrl.models.embedded import ensure_embedded_model

    model = AutoModelForCausalLM.from_pretrained(
        str(ensure_embedded_model("embedded:tiny-qwen3", seed=0)), dtype=torch.bfloat16)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert bench.decode_weight_bytes(model) == sum(unique.values())


def test_fraction_and_table(bench, tmp_path) -> None:
    run = {"decode_steps_per_second": 100.0, "decode_weight_bytes": 2e9}
    assert bench.bandwidth_fraction(run, 4e12) == pytest.approx(0.05)
    assert bench.bandwidth_fraction({}, 4e12) is None

    def measured(config: str, tokens_per_s: float) -> dict:
        return {"config": config, "completion_length": 1024, "model": bench.MODEL,
                "seconds_per_step": 16384 / tokens_per_s, "generated_tokens_per_second":
                tokens_per_s, "generation_only_tokens_per_second": tokens_per_s * 2,
                "decode_steps_per_second": 50.0, "decode_weight_bytes": 1.5e9,
                "bandwidth_fraction": 0.025, "peak_allocated_gib": 4.0, "peak_reserved_gib": 5.0}

    results = {"device": "GPU X", "bandwidth_bytes_per_s": 3e12, "runs": {
        "unsloth_4bit@1024": measured("unsloth_4bit", 100.0),
        f"{bench.GPU_PROFILE}@1024": measured(bench.GPU_PROFILE, 400.0),
        "gpu_profile_graph_merged@1024": measured("gpu_profile_graph_merged", 1200.0),
        "gpu_profile_graph@256": {"config": "gpu_profile_graph", "completion_length": 256,
                                  "error": "no result after 9 s (timed out or crashed)"}}}
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{bench.DOC_START}\nold\n{bench.DOC_END}\nafter\n")
    bench.write_doc_table(results, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    merged_row = next(line for line in text.splitlines() if "gpu_profile_graph_merged" in line)
    assert merged_row.endswith("| 12.00x | 3.00x |")
    assert "| 2.5 |" in merged_row  # % of bound
    assert "3.00 TB/s" in text and "`gpu_profile_graph@256`: no result after 9 s" in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="no <!-- gspo_step roofline"):
        bench.write_doc_table(results, doc)
