"""The NF4 decode kernel adding its own K splits (`Tiles.fused_sums`): the last program of each
column tile to finish adds the splits' partial sums in their order and the adapter's product,
the work of the second launch (`nf4_kernels.sum_splits`), so that a projection group is one
launch. A decode step makes one such launch per group, and each launch's fixed cost and the
gap before it were a large share of the step (docs/benchmarks.md, the kernel table).

Only the first column tile of each projection computes the adapter's x A^T, which every tile's
last program adds, so those programs wait for it. Programs take their (column tile, K split)
from a ticket counter that hands out the first tiles' first: a program waits only on programs
with earlier tickets, which already run, so the wait always ends (a grid's programs are not
promised to start in any order; the argument is decoupled look-back's). Each counter is reset
by the program that uses it last, so the next launch, and a CUDA graph's replay, find zeros.
Imported by nf4_kernels (Triton needed)."""

from __future__ import annotations

import triton
import triton.language as tl

# The counters (int32, `nf4_decode.fused_counters`): the ticket, one per column tile, then per
# projection of a group the splits that stored its x A^T and the tiles that finished.
MAX_TILES = 4096
COUNTERS = 1 + MAX_TILES + 6
TILE_COUNTS = tl.constexpr(1)
READY = tl.constexpr(1 + MAX_TILES)
DONE = tl.constexpr(1 + MAX_TILES + 3)


@triton.jit
def take_place(counts_ptr, N, start1, start2, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
               SEGMENTS: tl.constexpr):
    """The program's column tile and K split: its grid position where SPLITS is 0 (the two
    launches), else its ticket's, the first column tile of each projection first, split by
    split, then the other tiles in order."""
    if SPLITS == 0:
        tile = tl.program_id(0)
        split = tl.program_id(1)
    else:
        tiles = tl.cdiv(N, BLOCK_N)
        ticket = tl.atomic_add(counts_ptr, 1, sem="relaxed")
        if ticket == tiles * SPLITS - 1:  # the last ticket: every program holds its own
            tl.atomic_xchg(counts_ptr, 0, sem="relaxed")
        place = ticket // SPLITS
        split = ticket % SPLITS
        first1 = start1 // BLOCK_N
        first2 = start2 // BLOCK_N
        other = place - SEGMENTS + 1  # the others, counted past tile 0
        if SEGMENTS > 1:
            other += (other >= first1).to(tl.int32)
        if SEGMENTS > 2:
            other += (other >= first2).to(tl.int32)
        tile = tl.where(place == 0, 0, tl.where(place == 1, first1, first2))
        tile = tl.where(place < SEGMENTS, tile, other)
    return tile, split


@triton.jit
def finish_tile(counts_ptr, part_ptr, xa_part_ptr, b_ptr, b1_ptr, b2_ptr, out_ptr, M, N, rank,
                scaling, tile, segment, start, start1, start2, first_tile, rows, cols, row_ok,
                col_ok, SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, SEGMENTS: tl.constexpr,
                R: tl.constexpr, BLOCK_N: tl.constexpr):
    """After a program stored its partial sums: count it in its tile, and if it is the tile's
    last, write the tile's output as `nf4_kernels.sum_splits` does (the splits added in order in
    float32, then s (x A^T) B^T once its projection's x A^T is whole), the same bits."""
    tl.debug_barrier()  # every thread's stores before the count that publishes them
    if HAS_LORA:  # noqa: SIM102  (a compile-time branch around a run-time one)
        if first_tile:
            tl.atomic_add(counts_ptr + READY + segment, 1, sem="release")
    count = tl.atomic_add(counts_ptr + TILE_COUNTS + tile, 1, sem="acq_rel")
    if count == SPLITS - 1:
        tl.atomic_xchg(counts_ptr + TILE_COUNTS + tile, 0, sem="relaxed")
        ok = row_ok[:, None] & col_ok[None, :]
        where = rows[:, None] * N + cols[None, :]
        total = tl.load(part_ptr + where, mask=ok, other=0.0, cache_modifier=".cg")
        total = total.to(tl.float32)
        for split in tl.static_range(1, SPLITS):
            total += tl.load(part_ptr + split * M * N + where, mask=ok, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
        if HAS_LORA:
            ready = tl.atomic_add(counts_ptr + READY + segment, 0, sem="acquire")
            while ready < SPLITS:
                ready = tl.atomic_add(counts_ptr + READY + segment, 0, sem="acquire")
            total += adapter_sum(xa_part_ptr, b_ptr, b1_ptr, b2_ptr, M, rank, segment, start,
                                 rows, cols, row_ok, col_ok, SPLITS, SEGMENTS, R) * scaling
        tl.store(out_ptr + where, total.to(tl.bfloat16), mask=ok)
        if HAS_LORA:
            end = tl.where(segment == 0, start1, tl.where(segment == 1, start2, N))
            done = tl.atomic_add(counts_ptr + DONE + segment, 1, sem="acq_rel")
            if done == tl.cdiv(end - start, BLOCK_N) - 1:  # the projection's last tile
                tl.atomic_xchg(counts_ptr + READY + segment, 0, sem="relaxed")
                tl.atomic_xchg(counts_ptr + DONE + segment, 0, sem="relaxed")


@triton.jit
def adapter_sum(xa_part_ptr, b_ptr, b1_ptr, b2_ptr, M, rank, segment, start, rows, cols, row_ok,
                col_ok, SPLITS: tl.constexpr, SEGMENTS: tl.constexpr, R: tl.constexpr):
    """(x A^T) B^T of the tile's projection, x A^T added over the splits in their order."""
    if SEGMENTS > 1:
        b_ptr = tl.where(segment == 0, b_ptr, tl.where(segment == 1, b1_ptr, b2_ptr))
    ranks = tl.arange(0, R)
    xa_width = SEGMENTS * R
    at = rows[:, None] * xa_width + segment * R + ranks[None, :]
    xa = tl.load(xa_part_ptr + at, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLITS):
        xa += tl.load(xa_part_ptr + split * M * xa_width + at, mask=row_ok[:, None], other=0.0,
                      cache_modifier=".cg")
    b = tl.load(b_ptr + (cols - start)[:, None] * rank + ranks[None, :],
                mask=col_ok[:, None] & (ranks[None, :] < rank), other=0.0).to(tl.float32)
    return tl.dot(xa, tl.trans(b), input_precision="ieee")
