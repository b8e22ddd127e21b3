"""benchmarks/decode_profile.py's tile shapes: what `--tiles` accepts, and that every shape the
sweep times is one the kernel takes (a bad one would only fail on the GPU, inside a paid call)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from conftest import load_benchmark

from vlmrl.rollout.nf4_decode import Tiles


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("decode_profile")


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
