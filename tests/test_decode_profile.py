"""benchmarks/decode_profile.py's tile shapes: what `--tiles` accepts, and that every shape the
sweep times is one the kernel takes (a bad one would only fail on the GPU, inside a paid call);
and its replay and gap tables (`decode_tables`), rendered from stored results."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from conftest import benchmark_fixture

from vlmrl.training.rollout.nf4_decode import Tiles

profile = benchmark_fixture("decode_profile")
tables = benchmark_fixture("decode_tables")


def test_tiles_parse_in_order_and_by_name(profile) -> None:
    assert profile.parse_tiles("128,4,3,4;64,4,3,0.5,32,16") == [
        Tiles(128, 4, 3, 4.0), Tiles(64, 4, 3, 0.5, sum_block_n=32, sum_rows=16)]
    assert profile.parse_tiles("128,pdl=1,xa_chunk=16,max_registers=168") == [
        Tiles(128, pdl=True, xa_chunk=16, max_registers=168)]
    assert profile.parse_tiles("128,max_registers=none")[0].max_registers is None
    assert profile.parse_tiles("128,k_blocks=2,xa_precision=fp16") == [
        Tiles(128, k_blocks=2, xa_precision="fp16")]


@pytest.mark.parametrize(("text", "says"), [
    ("128,four,3,4", "warps is 'four'"), ("128,pdl=2", "pdl is '2'"),
    ("128,warp=8", "no field 'warp'"), ("128,sum_rows=24", "Tiles.sum_rows is 24"),
    (",".join(["64"] * (len(dataclasses.fields(Tiles)) + 1)), "more than the"),
    ("pdl=1,128", "come before"),
    ("128,pdl=1,pdl=0", "pdl is given twice"), ("", "block_n is ''"),
    ("128,max_registers=16", "Tiles.max_registers is 16"),
    ("128,xa_precision=fp8", "Tiles.xa_precision is 'fp8'")])
def test_bad_tiles_name_the_shape_and_the_field(profile, text, says) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)) as raised:
        profile.parse_tiles(text)
    assert says in str(raised.value)


def test_the_sweep_has_no_shape_twice(profile) -> None:
    assert all(isinstance(tiles, Tiles) for tiles in profile.SWEEP)
    assert len(set(profile.SWEEP)) == len(profile.SWEEP)


def test_the_replay_table_gives_steady_calls_and_their_parts(tables, tmp_path) -> None:
    """The first call of each decoder is left out (it warms up), the later steps' milliseconds
    are what the call had beyond its prefill and first step, and a run without call phases
    gets dashes."""
    run = {"ms_per_step": 4.0, "replay_ms": {"64": {"gpu_ms": 3.5, "host_ms": 0.03}},
           "call_tokens": 102}
    timed = {**run, "call_phases": {"not kept": [
        {"call_s": 9.0, "prefill_s": 9.0, "first_step_s": 9.0},
        {"call_s": 0.6, "prefill_s": 0.1, "first_step_s": 0.1},
        {"call_s": 0.8, "prefill_s": 0.3, "first_step_s": 0.1}]}}
    path = tmp_path / "calls.json"
    path.write_text(json.dumps({"model": "embedded:qwen3-vl-2b-shape", "device": "NVIDIA H200",
                                "decode_tiles": None, "runs": [timed, run]}))
    rows = tables.replay_table([path]).splitlines()[-2:]
    assert rows[0].split(" | ")[5:11] == ["not kept", "2", "0.70", "0.200", "0.100", "4.00"]
    assert rows[1].split(" | ")[5:11] == ["-"] * 6


def test_the_replay_table_names_a_file_without_replays(tables, tmp_path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"model": "m", "device": "d", "runs": [
        {"ms_per_step": 4.0, "replay_ms": {}}]}))
    with pytest.raises(SystemExit, match="old.json"):
        tables.replay_table([path])


def test_call_phases_time_each_calls_prefill_and_first_step(profile) -> None:
    """`--call-phases` on the CPU's eager decode loop: each call gets its prefill and first step
    timed (through `GraphDecoding.decoder_class`), inside the call's own time."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.embedded import ensure_embedded_model
    from vlmrl.models.processor import load_processor

    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    processor = load_processor(str(path))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2 + 2?"}]}],
        add_generation_prompt=True, tokenize=False)
    batch = dict(processor(text=[text] * 2, images=[Image.new("RGB", (64, 64))] * 2,
                           return_tensors="pt"))
    with torch.no_grad():
        records = profile.call_phases(model, batch, "model", 5, 64, keep=False, calls=2)
    assert [sorted(record) for record in records] == [["call_s", "first_step_s", "prefill_s"]] * 2
    assert all(record["call_s"] >= record["prefill_s"] + record["first_step_s"]
               for record in records)


def test_replay_gaps_add_the_idle_time_between_kernels_by_transition(profile) -> None:
    """Two replays of three kernels, given out of order: the idle time between each kernel's end
    and the next one's start, per replay, by the families of the kernels around it; kernels
    that overlap add none."""
    kernels = [("nf4_lora_matmul_wide", 0.0, 10.0), ("sum_splits", 10.5, 12.0),
               ("triton_per_fused_add", 12.5, 14.0), ("nf4_lora_matmul_wide", 20.0, 30.0),
               ("sum_splits", 29.0, 32.0), ("triton_per_fused_add", 33.5, 35.0)]
    gaps = profile.gap_transitions(list(reversed(kernels)), 2)
    assert gaps["kernels_per_replay"] == 3
    assert gaps["gap_us_per_replay"] == pytest.approx((0.5 + 0.5 + 6.0 + 0.0 + 1.5) / 2, abs=0.05)
    rows = {row["transition"]: row for row in gaps["transitions"]}
    assert rows["inductor -> NF4"] == {"transition": "inductor -> NF4", "us_per_replay": 3.0,
                                       "per_replay": 0.5, "mean_us": 6.0}
    assert rows["NF4 -> sum of the splits"]["mean_us"] == pytest.approx(0.25)
    assert rows["sum of the splits -> inductor"]["us_per_replay"] == pytest.approx(1.0)
    assert gaps["transitions"][0]["transition"] == "inductor -> NF4"
    assert profile.kernel_family("void at::native::vectorized_elementwise_kernel<4>(int)") == \
        "void at::native::vectorized_elementwise_kernel"


def test_the_gap_table_shows_a_replays_idle_time_and_its_largest_transitions(profile,
                                                                            tables) -> None:
    kernels = [("nf4_lora_matmul_wide", 0.0, 900.0), ("sum_splits", 901.0, 950.0),
               ("triton_poi_fused_add", 960.0, 1000.0)]
    results = {"model": "embedded:qwen3-vl-2b-shape", "device": "NVIDIA H200 (140 GiB)",
               "runs": [{"replay_ms": {"64": {"gpu_ms": 1.1}, "gaps": profile.gap_transitions(
                   kernels, 1)}}, {"replay_ms": {"64": {"gpu_ms": 1.0}}}]}
    (row,) = tables.gap_rows(results)
    assert row.startswith("| qwen3-vl-2b-shape | H200 | 1.10 | 3 | 11 (1%) | ")
    assert row.index("sum of the splits -> inductor: 10 (1 x 10.00)") < \
        row.index("NF4 -> sum of the splits: 1 (1 x 1.00)")
