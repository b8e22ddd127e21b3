"""`Tiles.fused_sums` under Triton's interpreter: the wide kernel's last program of each column
tile writes what the second launch writes, for one projection and a group, with and without the
adapter, and leaves its counters at zero for the next launch. The interpreter runs one program
at a time in grid order, so the wait for x A^T never spins here; tests/gpu runs it on programs
that race."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_nf4_decode import product_case, random_nf4

from vlmrl.rollout.nf4_decode import Tiles

TILES = Tiles(block_n=64, programs_per_sm=2, k_blocks=2, xa_precision="fp16",
              partials="bfloat16")
FUSED = dataclasses.replace(TILES, fused_sums=True)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer made with torch.empty starts as NaN (or -1): an output the fused path left
    unwritten cannot equal the second launch's, whatever memory it was given."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def one_launch(interpreted_kernel, monkeypatch):
    """`interpreted_kernel` whose second launch fails the test if it runs."""
    triton, kernel, _, wide = interpreted_kernel._kernel()

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("the second launch ran")

    def patch():
        monkeypatch.setattr(interpreted_kernel, "_kernel",
                            lambda: (triton, kernel, Refused(), wide))

    return patch


def counters(kernel) -> torch.Tensor:
    """All of the fused sums' counters on the CPU."""
    return kernel.fused_counters(torch.device("cpu"), 1)


@pytest.mark.parametrize(("rows", "out_features", "in_features", "nested", "lora"), [
    (19, 192, 1024, True, True),   # 3 column tiles, 2 splits (4 SMs x 2 programs)
    (32, 128, 512, False, True),
    (5, 256, 1024, True, False)])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_fused_sums_write_the_second_launchs_bits(interpreted_kernel, one_launch, poisoned, rows,
                                                  out_features, in_features, nested, lora):
    weight, x, adapter, _ = product_case(rows, out_features, in_features, nested, lora, {})
    assert interpreted_kernel.k_splits(out_features, in_features, TILES, 4) > 1
    two_launches = interpreted_kernel.nf4_matmul(x, weight, adapter, TILES)
    assert not two_launches.isnan().any()
    one_launch()
    for _ in range(2):  # the second launch finds the counters the first left
        assert torch.equal(interpreted_kernel.nf4_matmul(x, weight, adapter, FUSED),
                           two_launches)
        assert not counters(interpreted_kernel).any()


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_fused_group_writes_each_projections_columns(interpreted_kernel, one_launch, poisoned):
    """q, k, v in one launch: each tile's last program adds its own projection's adapter, after
    the projection's first tile stored x A^T (those tiles take the first tickets)."""
    generator = torch.Generator().manual_seed(11)
    members = [random_nf4(width, 512, True, generator, offset=0.01 * (index + 1))
               for index, width in enumerate((128, 64, 128))]
    weights = interpreted_kernel.side_by_side([weight for weight, _ in members])
    x = torch.randn(9, 512, generator=generator).to(torch.bfloat16)
    loras = [(torch.randn(16, 512, generator=generator) * 0.05,
              torch.randn(weight.out_features, 16, generator=generator) * 0.05, 0.5)
             for weight in weights]
    assert interpreted_kernel.groupable(weights, loras, FUSED)
    two_launches = interpreted_kernel.nf4_group_matmul(x, weights, loras, TILES)
    one_launch()
    assert torch.equal(interpreted_kernel.nf4_group_matmul(x, weights, loras, FUSED),
                       two_launches)
    assert not counters(interpreted_kernel).any()


def test_fused_sums_where_the_one_block_kernel_runs_take_the_second_launch(interpreted_kernel):
    """Five scale blocks of input take one a step: the one-block kernel, which does not add its
    splits, and the second launch as before."""
    weight, x, adapter, _ = product_case(6, 128, 320, False, True, {})
    narrow = interpreted_kernel.nf4_matmul(x, weight, adapter, TILES)
    assert torch.equal(interpreted_kernel.nf4_matmul(x, weight, adapter, FUSED), narrow)


def test_more_column_tiles_than_counters_are_refused_by_count() -> None:
    pytest.importorskip("triton")
    from vlmrl.rollout import nf4_decode, nf4_fused_sums

    with pytest.raises(ValueError, match=f"{nf4_fused_sums.MAX_TILES + 1} column tiles"):
        nf4_decode.fused_counters(torch.device("cpu"), nf4_fused_sums.MAX_TILES + 1)
