"""`Tiles.fused_sum` under Triton's interpreter: the last program of each column tile adds the K
splits in the first launch, so its output must be the two-launch path's to the bit wherever the
adapter's B^T product is out of the picture, within float32 rounding where it is not, and every
tile counter must be back at 0 after the call (the next launch, or a graph replay, counts from
there)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_nf4_decode import largest_row_error, product_case, random_nf4

from vlmrl.rollout.nf4_decode import Tiles

CASES = [
    # the wide kernel, two steps a split, four splits over 4 SMs; adapter
    (19, 128, 1024, True, True, Tiles(block_n=64, programs_per_sm=1, k_blocks=2,
                                      xa_precision="tf32")),
    # the one-block kernel, several column tiles, float32 scales; no adapter
    (6, 256, 512, False, False, Tiles(block_n=64, programs_per_sm=2)),
    # one split (nothing to add but the adapter)
    (32, 512, 128, True, True, Tiles(block_n=128, programs_per_sm=1, k_blocks=2))]


@pytest.mark.parametrize(("rows", "out_features", "in_features", "nested", "lora", "tiles"),
                         CASES)
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_the_fused_sum_gives_the_two_launch_output(interpreted_kernel, rows, out_features,
                                                   in_features, nested, lora, tiles):
    weight, x, adapter, expected = product_case(rows, out_features, in_features, nested, lora,
                                                {0: 2.0 ** 17})
    two_launches = interpreted_kernel.nf4_matmul(x, weight, adapter, tiles)
    fused = interpreted_kernel.nf4_matmul(x, weight, adapter,
                                          dataclasses.replace(tiles, fused_sum=True))
    if adapter is None:
        assert torch.equal(fused, two_launches)
    else:  # B^T's product in another tile shape: its float32 sums may round differently
        assert largest_row_error(fused.double(), two_launches.double()) < 1e-2
    assert largest_row_error(fused.double(), expected) < 2e-2
    assert not interpreted_kernel._tile_counters(x.device, 1024).any()


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_fused_group_matches_its_projections(interpreted_kernel):
    """q, k, v in one launch with no second one: each column tile adds its own projection's
    x A^T B^T."""
    generator = torch.Generator().manual_seed(5)
    members = [random_nf4(width, 512, True, generator, offset=0.01 * (index + 1))
               for index, width in enumerate((128, 64, 64))]
    weights = interpreted_kernel.side_by_side([weight for weight, _ in members])
    x = torch.randn(9, 512, generator=generator).to(torch.bfloat16)
    loras = [(torch.randn(16, 512, generator=generator) * 0.05,
              torch.randn(weight.out_features, 16, generator=generator) * 0.05, 0.5)
             for weight in weights]
    tiles = Tiles(block_n=64, programs_per_sm=1, k_blocks=2, fused_sum=True)
    got = interpreted_kernel.nf4_group_matmul(x, weights, loras, tiles).double()
    start = 0
    for (_, dense), (a, b, scaling) in zip(members, loras):
        width = dense.shape[0]
        expected = (x.double() @ dense.t()
                    + scaling * (x.double() @ a.double().t()) @ b.double().t())
        assert largest_row_error(got[:, start:start + width], expected) < 2e-2
        start += width
    assert not interpreted_kernel._tile_counters(x.device, 1024).any()
