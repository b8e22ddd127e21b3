"""benchmarks/decode_profile.py's tile shapes: what `--tiles` accepts, and that every shape the
sweep times is one the kernel takes (a bad one would only fail on the GPU, inside a paid call)."""

from __future__ import annotations

import argparse

import pytest
from conftest import load_benchmark

from vlmrl.rollout.nf4_decode import Tiles


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("decode_profile")


def test_tiles_parse_with_and_without_the_sum_tile(profile) -> None:
    assert profile.parse_tiles("128,4,3,4;64,4,3,0.5,32,16") == [(128, 4, 3, 4.0),
                                                                 (64, 4, 3, 0.5, 32, 16)]
    assert Tiles(*profile.parse_tiles("64,4,3,0.5,32,16")[0]) == Tiles(
        block_n=64, warps=4, stages=3, programs_per_sm=0.5, sum_block_n=32, sum_rows=16)
    assert Tiles(*profile.parse_tiles("128,4,3,4,16,16,1")[0]).pdl


@pytest.mark.parametrize("text", ["128,4,3", "128,4,3,4,16", "128,four,3,4", "128,4,3,4,16,16,2"])
def test_bad_tiles_name_the_shape(profile, text) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        profile.parse_tiles(text)


def test_every_swept_shape_is_a_valid_tile(profile) -> None:
    assert len(set(profile.SWEEP)) == len(profile.SWEEP)
    for values in profile.SWEEP:
        Tiles(*values)
