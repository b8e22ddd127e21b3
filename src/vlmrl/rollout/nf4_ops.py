"""The NF4 projections as operators torch.compile can take (it does not trace into Triton
launches). `vlmrl::nf4_matmul` is the whole product, both launches of `nf4_decode`; CUDA graphs
of an eager step capture it as it is. Under torch.compile the second launch, which only adds the
K splits' partial sums and the adapter's `s (x A^T) B^T`, is one small kernel per projection
group of a decode step, each a few microseconds long and fixed in cost (docs/benchmarks.md,
the kernel table's `sum of the splits`): so a compiled step calls `vlmrl::nf4_partials`, the
first launch alone, and adds the splits as tensor operations (`sum_partials`), which inductor
fuses into the kernels that read the projection (the norms of q and k, the MLP's product, the
residual's add). Same arithmetic as the second launch: the splits in float32 in split order,
the adapter in float32, one rounding to bf16."""

from __future__ import annotations

import torch

from vlmrl.rollout import nf4_decode
from vlmrl.rollout.nf4_decode import PackedNF4

# The operators' arguments after x: per projection its packed weight, block scale codes, nested
# scales (`absmax2`, `code2`: empty without), offset, adapter (`lora_a`, `lora_b`: empty
# without; one `scaling`) and output width.


def _weights(x16, packed, absmax, absmax2, code2, offsets, block2, out_features,
             blocksize) -> list[PackedNF4]:
    return [PackedNF4(weight, codes, width, x16.shape[-1], blocksize,
                      absmax2[i] if absmax2 else None, code2[i] if code2 else None,
                      offsets[i], block2)
            for i, (weight, codes, width) in enumerate(zip(packed, absmax, out_features))]


@torch.library.custom_op("vlmrl::nf4_matmul", mutates_args=())
def nf4_matmul_op(x16: torch.Tensor, row_up: torch.Tensor, packed: list[torch.Tensor],
                  absmax: list[torch.Tensor],
                  absmax2: list[torch.Tensor], code2: list[torch.Tensor], offsets: list[float],
                  block2: int, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                  scaling: float, out_features: list[int], blocksize: int) -> torch.Tensor:
    """`nf4_decode.nf4_rows_matmul` of one projection or a group, with the module's TILES (a
    CUDA graph keeps those of its capture)."""
    weights = _weights(x16, packed, absmax, absmax2, code2, offsets, block2, out_features,
                       blocksize)
    loras = [(a, b, scaling) for a, b in zip(lora_a, lora_b)] or None
    return nf4_decode.nf4_rows_matmul(x16, row_up, weights, loras)


@nf4_matmul_op.register_fake
def _(x16, row_up, packed, absmax, absmax2, code2, offsets, block2, lora_a, lora_b, scaling,
      out_features, blocksize):
    return x16.new_empty(*x16.shape[:-1], sum(out_features), dtype=torch.bfloat16)


@torch.library.custom_op("vlmrl::nf4_partials", mutates_args=())
def nf4_partials_op(x16: torch.Tensor, row_up: torch.Tensor, packed: list[torch.Tensor],
                    absmax: list[torch.Tensor], absmax2: list[torch.Tensor],
                    code2: list[torch.Tensor], offsets: list[float], block2: int,
                    lora_a: list[torch.Tensor], out_features: list[int],
                    blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`nf4_decode.nf4_rows_partials` of one projection or a `groupable` group, with the
    module's TILES: the splits' parts of x W^T and of x A^T."""
    weights = _weights(x16, packed, absmax, absmax2, code2, offsets, block2, out_features,
                       blocksize)
    loras = [(a, a, 1.0) for a in lora_a] or None  # B is read by `sum_partials`
    if len(weights) > 1 and not nf4_decode.groupable(weights, loras, nf4_decode.TILES):
        raise ValueError(f"NF4 projections of widths {out_features} can't share a launch with "
                         f"{nf4_decode.TILES}: call vlmrl::nf4_partials for each")
    return nf4_decode.nf4_rows_partials(x16, row_up, weights, loras)


@nf4_partials_op.register_fake
def _(x16, row_up, packed, absmax, absmax2, code2, offsets, block2, lora_a, out_features,
      blocksize):
    tiles = nf4_decode.TILES
    width = sum(out_features)
    splits = nf4_decode.k_splits(width, x16.shape[-1], tiles, nf4_decode._sm_count(x16.device),
                                 blocksize)
    rows = x16.numel() // x16.shape[-1]
    loras = [(a, a, 1.0) for a in lora_a] or None  # B is read by `sum_partials`
    return (x16.new_empty(splits, rows, width, dtype=nf4_decode.PARTIALS[tiles.partials]),
            x16.new_empty(splits, rows, len(packed) * nf4_decode.rank_tile(loras),
                          dtype=torch.float32))


def sum_partials(parts: torch.Tensor, xa_parts: torch.Tensor, lora_b: list[torch.Tensor],
                 scaling: float, widths: list[int]) -> list[torch.Tensor]:
    """Each projection's output [rows, width] in bf16 from `nf4_partials`: the splits added in
    float32 in split order, plus `scaling (x A^T) B^T` in float32 where `lora_b` (one B
    [width, rank] per projection) is given, rounded once. Elementwise operations only (the
    adapter's rank unrolled), so that inductor inlines them into the kernels that read the
    outputs."""
    total = parts[0].float()
    for split in range(1, parts.shape[0]):
        total = total + parts[split].float()
    xa = xa_parts[0]
    for split in range(1, xa_parts.shape[0]):
        xa = xa + xa_parts[split]
    r_tile = xa_parts.shape[-1] // len(widths)
    outputs, start = [], 0
    for index, width in enumerate(widths):
        out = total[:, start:start + width]
        if lora_b:
            b = lora_b[index].float()
            at = index * r_tile
            adapter = xa[:, at:at + 1] * b[:, 0]
            for rank in range(1, b.shape[1]):
                adapter = adapter + xa[:, at + rank:at + rank + 1] * b[:, rank]
            out = out + adapter * scaling
        outputs.append(out.to(torch.bfloat16))
        start += width
    return outputs
