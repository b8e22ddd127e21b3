"""The CPU-side parts of `vlmrl.rollout.nf4_decode` (the kernel itself runs only on a GPU: its tests
are in tests/gpu/test_graph_decode_gpu.py): how K is split over the SMs, when the kernel is taken."""

from __future__ import annotations

import pytest
import torch

from vlmrl.rollout.nf4_decode import TILES, Tiles, k_splits, kernel_available, servable


@pytest.mark.parametrize(("out_features", "in_features"),
                         [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144), (12288, 4096)])
def test_k_splits_divide_k_and_fill_the_sms(out_features, in_features):
    sms = 132
    splits = k_splits(out_features, in_features, TILES, sms)
    k_tiles = in_features // TILES.block_k
    assert k_tiles % splits == 0
    programs = -(-out_features // TILES.block_n) * splits
    assert programs >= TILES.programs_per_sm * sms or splits == k_tiles
    if splits > 1:  # the fewest such splits: one fewer divisor would not fill the SMs
        smaller = max(d for d in range(1, splits) if k_tiles % d == 0)
        assert -(-out_features // TILES.block_n) * smaller < TILES.programs_per_sm * sms


def test_one_split_when_the_columns_alone_fill_the_sms():
    assert k_splits(65536, 2048, Tiles(block_n=64), sms=132) == 1


def test_no_kernel_without_cuda_or_for_a_plain_linear():
    if not torch.cuda.is_available():
        assert not kernel_available()
    assert not servable(torch.nn.Linear(256, 256, bias=False))  # no quant_state
