"""The NF4 decode kernel with several scale blocks a K step (`nf4_lora_matmul_wide`, the shipped
tiles) under Triton's interpreter: against float64, alone and in a group, and where its fp16
weights stop being exact. The interpreter ignores `tl.dot`'s input precision, so the adapter's
tf32 rounding is covered by tests/gpu/test_graph_decode_gpu.py only."""

from __future__ import annotations

import pytest
import torch
from test_nf4_decode import largest_row_error, product_case, random_nf4

from vlmrl.training.rollout.nf4_decode import PackedNF4, Tiles, k_splits, step_blocks


@pytest.mark.parametrize(("in_features", "asked", "taken"),
                         [(2048, 4, 4), (2048, 2, 2), (320, 4, 1), (384, 4, 2), (12288, 8, 8)])
def test_a_step_takes_the_blocks_asked_where_they_divide_the_input(in_features, asked, taken):
    assert step_blocks(in_features, Tiles(k_blocks=asked)) == taken


def test_splits_count_steps_of_several_blocks():
    """64 columns: one column tile, so K splits fill the SMs, as many as there are steps."""
    assert k_splits(64, 2048, Tiles(block_n=64, k_blocks=4), sms=132) == 8  # 8 steps of 256
    assert k_splits(64, 2048, Tiles(block_n=64), sms=132) == 32  # 32 blocks of 64


def test_an_unknown_adapter_precision_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Tiles.xa_precision is 'bf16'"):
        Tiles(xa_precision="bf16")


@pytest.mark.parametrize(("rows", "out_features", "in_features", "nested", "lora", "tiles",
                          "row_scales"), [
    # four blocks a step, two steps a split (one column tile of 64 on 4 SMs: 4 splits of 512)
    (19, 64, 2048, True, True, Tiles(block_n=64, programs_per_sm=1, k_blocks=4,
                                     xa_precision="tf32"), {4: 2.0 ** -20, 0: 2.0 ** 17}),
    # four blocks asked, where the input's five blocks take one a step (the one-block kernel)
    (6, 128, 320, False, True, Tiles(block_n=64, programs_per_sm=1, k_blocks=4), {2: 0.0}),
    (32, 256, 512, True, False, Tiles(block_n=128, programs_per_sm=1, k_blocks=2), {1: 2.0 ** 40}),
    # the adapter's A in fp16, x's rows far apart; two steps a split
    (32, 128, 1024, True, True, Tiles(block_n=128, programs_per_sm=2, k_blocks=2,
                                      xa_precision="fp16"), {0: 2.0 ** -24, 5: 2.0 ** 30}),
    # K in lane order, two and four blocks a step, with and without the adapter
    (32, 128, 1024, True, True, Tiles(block_n=128, programs_per_sm=2, k_blocks=2,
                                      xa_precision="fp16", lane_order=True), {3: 2.0 ** 20}),
    (9, 64, 2048, False, False, Tiles(block_n=64, programs_per_sm=1, k_blocks=4,
                                      lane_order=True), {0: 0.0}),
    # one split of the whole input: its column scales' largest over 6 tiles (8 read, 2 masked)
    # and over 36 (three reads of 16, the last partly masked)
    (5, 64, 384, True, True, Tiles(block_n=64, programs_per_sm=0.25, k_blocks=2,
                                   xa_precision="fp16"), {1: 2.0 ** 10}),
    (5, 64, 2304, True, False, Tiles(block_n=64, programs_per_sm=0.25, k_blocks=2), {}),
    # lane order asked where the input's five blocks take one a step: the one-block kernel
    (6, 128, 320, True, True, Tiles(block_n=64, programs_per_sm=1, k_blocks=2,
                                    lane_order=True), {})])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_the_wide_kernel_matches_a_float64_product(interpreted_kernel, rows, out_features,
                                                   in_features, nested, lora, tiles, row_scales):
    """As the one-block kernel's test: rows far above and below fp16's range, a row of zeros,
    the adapter; 2e-2 of a row's largest value (the interpreter truncates bf16)."""
    weight, x, adapter, expected = product_case(rows, out_features, in_features, nested, lora,
                                                row_scales)
    got = interpreted_kernel.nf4_matmul(x, weight, adapter, tiles).double()
    assert largest_row_error(got, expected) < 2e-2


def test_lane_order_puts_each_lanes_columns_in_one_quarter_of_the_step():
    """Columns 2l, 2l + 1, 2l + 8 and 2l + 9 of every 16 come from quarter l, in order, and
    each step is a permutation of its own columns; without `lane_order`, x keeps its order."""
    from vlmrl.training.rollout.nf4_decode import fp16_rows, lane_order_index, lane_step

    index = lane_order_index(512, 128, torch.device("cpu"))
    assert index[:18].tolist() == [0, 1, 32, 33, 64, 65, 96, 97, 2, 3, 34, 35, 66, 67, 98, 99,
                                   4, 5]
    for start in (0, 128, 384):
        assert sorted(index[start:start + 128].tolist()) == list(range(start, start + 128))
    assert lane_step(512, Tiles(k_blocks=2, lane_order=True)) == 128
    assert lane_step(320, Tiles(k_blocks=2, lane_order=True)) is None  # one block a step
    assert lane_step(512, Tiles(k_blocks=2)) is None
    x = torch.randn(3, 512).to(torch.bfloat16)
    plain, up = fp16_rows(x, Tiles(k_blocks=2))
    ordered, same_up = fp16_rows(x, Tiles(k_blocks=2, lane_order=True))
    assert torch.equal(ordered, plain[:, index]) and torch.equal(up, same_up)


def test_lane_order_takes_steps_of_two_or_four_blocks() -> None:
    with pytest.raises(ValueError, match="Tiles.lane_order takes K steps of 2 or 4 blocks"):
        Tiles(k_blocks=8, lane_order=True)


@pytest.mark.parametrize("lane_order", [False, True])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_wide_group_matches_its_projections(interpreted_kernel, lane_order):
    """q, k, v in one launch of the wide kernel, each with its own nested scales and adapter."""
    generator = torch.Generator().manual_seed(3)
    members = [random_nf4(width, 512, True, generator, offset=0.01 * (index + 1))
               for index, width in enumerate((128, 64, 64))]
    weights = interpreted_kernel.side_by_side([weight for weight, _ in members])
    x = torch.randn(7, 512, generator=generator).to(torch.bfloat16)
    loras = [(torch.randn(16, 512, generator=generator) * 0.05,
              torch.randn(weight.out_features, 16, generator=generator) * 0.05, 0.5)
             for weight in weights]
    tiles = Tiles(block_n=64, programs_per_sm=1, k_blocks=2, lane_order=lane_order)
    assert interpreted_kernel.groupable(weights, loras, tiles)
    got = interpreted_kernel.nf4_group_matmul(x, weights, loras, tiles).double()
    start = 0
    for (_, dense), (a, b, scaling) in zip(members, loras):
        width = dense.shape[0]
        expected = (x.double() @ dense.t()
                    + scaling * (x.double() @ a.double().t()) @ b.double().t())
        assert largest_row_error(got[:, start:start + width], expected) < 2e-2
        start += width


def far_apart_scales(ratio: float) -> tuple[PackedNF4, torch.Tensor, torch.Tensor]:
    """A weight whose block scales alternate 1 and `ratio` along each row, its float64 dense
    weight, and x that is non-zero only on the small blocks."""
    from vlmrl.training.rollout.nf4_codes import NF4_CODES

    generator = torch.Generator().manual_seed(7)
    out_features, in_features = 64, 512
    packed = torch.randint(0, 256, (out_features * in_features // 2, 1), dtype=torch.uint8,
                           generator=generator)
    scales = torch.tensor([1.0, ratio]).repeat(out_features * in_features // 128)
    weight = PackedNF4(packed, scales.view(out_features, -1).t().contiguous(), out_features,
                       in_features, 64)
    codes = torch.tensor(NF4_CODES, dtype=torch.float64)
    flat = packed.view(-1).long()
    values = torch.stack([codes[flat >> 4], codes[flat & 15]], 1).reshape(-1, 64)
    dense = (values * scales.double()[:, None]).reshape(out_features, in_features)
    x = torch.randn(4, in_features, generator=generator)
    x.view(4, -1, 64)[:, 0::2] = 0.0  # the blocks of scale 1
    return weight, dense, (x / ratio).to(torch.bfloat16)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_fp16_weights_hold_blocks_down_to_2_to_the_minus_24_of_the_largest(interpreted_kernel):
    """The blocks of a column's K split share its power of two: a block 2**-20 of the other keeps
    fp16's bits; at 2**-44 its weights round to zero in fp16, where the one-block kernel, which
    scales after the product, stays exact (the bound the docstrings state)."""
    wide, narrow = Tiles(block_n=64, k_blocks=2), Tiles(block_n=64)
    weight, dense, x = far_apart_scales(2.0 ** -20)
    expected = x.double() @ dense.t()
    assert largest_row_error(interpreted_kernel.nf4_matmul(x, weight, None, wide).double(),
                             expected) < 2e-2
    weight, dense, x = far_apart_scales(2.0 ** -44)
    expected = x.double() @ dense.t()
    assert largest_row_error(interpreted_kernel.nf4_matmul(x, weight, None, narrow).double(),
                             expected) < 2e-2
    assert interpreted_kernel.nf4_matmul(x, weight, None, wide).abs().max() == 0


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_projections_that_cannot_share_a_launch_take_one_each(interpreted_kernel):
    """Widths whose second projection starts inside a column tile: a warning, one launch each on
    the same fp16 rows, and the outputs side by side."""
    generator = torch.Generator().manual_seed(5)
    members = [random_nf4(width, 256, True, generator) for width in (96, 32)]
    weights = interpreted_kernel.side_by_side([weight for weight, _ in members])
    x = torch.randn(4, 256, generator=generator).to(torch.bfloat16)
    tiles = Tiles(block_n=64, programs_per_sm=1, k_blocks=2, lane_order=True)
    assert not interpreted_kernel.groupable(weights, None, tiles)
    with pytest.warns(UserWarning, match="can't share a launch"):
        got = interpreted_kernel.nf4_group_matmul(x, weights, None, tiles).double()
    expected = torch.cat([x.double() @ dense.t() for _, dense in members], dim=-1)
    assert largest_row_error(got, expected) < 2e-2


def test_the_operators_fake_gives_bf16_rows_of_the_groups_width():
    """What torch.compile traces `vlmrl::nf4_matmul` as: bf16, x's leading shape, the widths'
    sum."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import vlmrl.training.rollout.nf4_decode  # noqa: F401  (registers the operator)

    with FakeTensorMode():
        x16 = torch.empty(3, 1, 128, dtype=torch.float16)
        row_up = torch.empty(3, 1)
        packed = [torch.empty(64 * 64, 1, dtype=torch.uint8), torch.empty(32 * 64, 1,
                                                                          dtype=torch.uint8)]
        codes = [torch.empty(2, 64, dtype=torch.uint8), torch.empty(2, 32, dtype=torch.uint8)]
        out = torch.ops.vlmrl.nf4_matmul(x16, row_up, packed, codes, [], [], [0.0, 0.0], 256,
                                         [], [], 1.0, [64, 32], 64)
    assert (out.dtype, tuple(out.shape)) == (torch.bfloat16, (3, 1, 96))
