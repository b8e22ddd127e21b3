"""`Tiles.fused_sums` on the GPU, where the programs of a launch race: the 2B shape's
projection groups, each tile's last program adding its splits, give the second launch's bits on
every one of many launches, eager and replayed in a CUDA graph, and leave the counters at zero;
and the compiled decode graph draws the shipped tiles' tokens with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu


def random_nf4(out_features: int, in_features: int):
    from vlmrl.rollout.nf4_decode import PackedNF4

    packed = torch.randint(0, 256, (out_features * in_features // 2, 1), dtype=torch.uint8,
                           device="cuda")
    scales = torch.rand(in_features // 64, out_features, device="cuda") * 0.05
    return PackedNF4(packed, scales, out_features, in_features, 64)


def adapter(in_features: int, out_features: int) -> tuple:
    return (torch.randn(16, in_features, device="cuda") * 0.05,
            torch.randn(out_features, 16, device="cuda") * 0.05, 2.0)


@pytest.mark.parametrize("rows", [32, 7])
def test_fused_sums_give_the_second_launchs_bits_on_every_launch(rows):
    from vlmrl.rollout import nf4_decode
    from vlmrl.rollout.nf4_decode import TILES, nf4_group_matmul

    fused = dataclasses.replace(TILES, fused_sums=True)
    torch.manual_seed(0)
    groups = []  # the 2B shape's: q, k, v; gate, up; o; down
    for widths, in_features in (((2048, 1024, 1024), 2048), ((6144, 6144), 2048),
                                ((2048,), 2048), ((2048,), 6144)):
        weights = nf4_decode.side_by_side([random_nf4(width, in_features) for width in widths])
        loras = [adapter(in_features, width) for width in widths]
        assert len(widths) == 1 or nf4_decode.groupable(weights, loras, fused)
        x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda")
        groups.append((x, weights, loras))
    for x, weights, loras in groups:
        expected = nf4_group_matmul(x, weights, loras, TILES)
        for _ in range(50):
            assert torch.equal(nf4_group_matmul(x, weights, loras, fused), expected)
    counters = nf4_decode.fused_counters(torch.device("cuda"), 1)
    assert not counters.any()

    def chain(tiles) -> list[torch.Tensor]:
        return [nf4_group_matmul(x, weights, loras, tiles) for x, weights, loras in groups]

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain(fused)
    for _ in range(20):
        for x, _, _ in groups:
            x.copy_(torch.randn_like(x))
        expected = chain(TILES)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(replayed, expected, strict=True))
    assert not counters.any()


def test_fused_sums_decode_the_shipped_tiles_tokens(monkeypatch):
    """The compiled decode graph over the float8 cache (the recipes' path), with and without the
    fused sums: the same bits, so the same greedy tokens and logits."""
    from test_graph_decode_gpu import decode_and_record, inputs, load

    from vlmrl.rollout import nf4_decode

    model, processor = load(four_bit=True)
    batch = inputs(processor)
    run = {"fp8": ({"kv_cache_dtype": "fp8"}, True)}
    tokens, logits = decode_and_record(model, batch, run)
    monkeypatch.setattr(nf4_decode, "TILES", dataclasses.replace(nf4_decode.TILES,
                                                                 fused_sums=True))
    fused_tokens, fused_logits = decode_and_record(model, batch, run)
    assert torch.equal(fused_tokens["fp8"], tokens["fp8"])
    assert all(torch.equal(a, b) for a, b in zip(fused_logits["fp8"], logits["fp8"], strict=True))
