"""The Triton kernels of `vlmrl.training.rollout.nf4_decode` (see there), apart so that importing that
module needs no Triton: this one is imported where the kernel runs. Under Triton's interpreter
(TRITON_INTERPRET=1 when this module is imported, the CPU tests), which runs no PTX, the codes
are looked up by selects instead of by byte permutes."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from vlmrl.training.rollout.nf4_codes import NF4_CODES, nf4_lookup_asm

LOOKUP = tl.constexpr(nf4_lookup_asm())
C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13, C14, C15 = (
    tl.constexpr(value) for value in NF4_CODES)


@triton.jit
def by_selects(code):
    """The fp16 NF4 value of each 4-bit code by a tree of selects."""
    b1, b2, b4, b8 = (code & 1) != 0, (code & 2) != 0, (code & 4) != 0, (code & 8) != 0
    low = tl.where(b4, tl.where(b2, tl.where(b1, C7, C6), tl.where(b1, C5, C4)),
                   tl.where(b2, tl.where(b1, C3, C2), tl.where(b1, C1, C0)))
    high = tl.where(b4, tl.where(b2, tl.where(b1, C15, C14), tl.where(b1, C13, C12)),
                    tl.where(b2, tl.where(b1, C11, C10), tl.where(b1, C9, C8)))
    return tl.where(b8, high, low).to(tl.float16)


if os.environ.get("TRITON_INTERPRET") != "1":
    @triton.jit
    def nf4_values(packed):
        """The fp16 NF4 values of the high (even) and low (odd) nibbles of each byte."""
        return tl.inline_asm_elementwise(LOOKUP, "=r,=r,=r,=r,r", [packed],
                                         dtype=(tl.float16, tl.float16), is_pure=True,
                                         pack=4)

    @triton.jit
    def after_the_kernel_before():
        """With programmatic dependent launch (PDL): wait until the kernel before has finished and
        its writes are visible, then let the kernel after launch (it waits the same way)."""
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
else:  # Triton's interpreter (on the CPU, for tests) runs no PTX: the same values by selects
    @triton.jit
    def nf4_values(packed):
        return by_selects(packed >> 4), by_selects(packed & 0xF)

    @triton.jit
    def after_the_kernel_before():  # the interpreter runs one kernel at a time
        pass


@triton.jit
def fp16_shift(largest):
    """The exponent of the power of two that brings `largest` into [2**14, 2**15): down for
    large rows, up for small ones (so that their small elements stay normal in fp16), at
    most 2**126 either way (a zero row)."""
    exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.maximum(exponent - 14, -126)


@triton.jit
def power_of_two(exponent):
    """2**exponent in float32, for exponents of normal floats."""
    return ((127 + exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def adapter_product(x, a, XA_PRECISION: tl.constexpr):
    """x A^T in float32 of x's fp16 rows and the adapter's A (float32): "fp16", tensor cores on
    A rounded to fp16 (the 11 significant bits of tf32, in fp16's range); "ieee", "tf32" and
    "tf32x3", `tl.dot`'s precisions in float32."""
    if XA_PRECISION == "fp16":
        product = tl.dot(x, tl.trans(a.to(tl.float16)))
    else:
        product = tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)),
                         input_precision=XA_PRECISION)
    return product


@triton.jit
def pick(segment, first, second, third):
    """The value of a program's projection among up to three (pointers or scalars)."""
    return tl.where(segment == 0, first, tl.where(segment == 1, second, third))


@triton.jit
def segment_of(column, start1, start2, SEGMENTS: tl.constexpr):
    """Which projection of a group a column is in, and the group's column where it starts."""
    if SEGMENTS == 1:
        segment = 0
        start = 0
    else:
        segment = (column >= start1).to(tl.int32) + (column >= start2).to(tl.int32)
        start = pick(segment, 0, start1, start2)
    return segment, start


@triton.jit
def projection_of(segment, SEGMENTS: tl.constexpr, w_ptr, w1_ptr, w2_ptr, absmax2_ptr,
                  absmax2_1_ptr, absmax2_2_ptr, code2_ptr, code2_1_ptr, code2_2_ptr, offset,
                  offset1, offset2, a_ptr, a1_ptr, a2_ptr):
    """The weight, nested scales, offset and adapter of a program's projection in a group."""
    if SEGMENTS > 1:
        w_ptr = pick(segment, w_ptr, w1_ptr, w2_ptr)
        absmax2_ptr = pick(segment, absmax2_ptr, absmax2_1_ptr, absmax2_2_ptr)
        code2_ptr = pick(segment, code2_ptr, code2_1_ptr, code2_2_ptr)
        offset = pick(segment, offset, offset1, offset2)
        a_ptr = pick(segment, a_ptr, a1_ptr, a2_ptr)
    return w_ptr, absmax2_ptr, code2_ptr, offset, a_ptr


@triton.jit
def program_tile(start, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's rows and columns (in the group, and in its projection from `start`), which of
    them exist, and whether its columns are its projection's first tile."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.program_id(0) * BLOCK_N == start, rows, cols, cols - start, rows < M, cols < N


@triton.jit
def program_start(M, N, w_ptr, w1_ptr, w2_ptr, absmax2_ptr, absmax2_1_ptr, absmax2_2_ptr,
                  code2_ptr, code2_1_ptr, code2_2_ptr, offset, offset1, offset2, a_ptr, a1_ptr,
                  a2_ptr, start1, start2, PDL: tl.constexpr, SEGMENTS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What both matmul kernels begin with: with PDL, the wait for the kernel before
    (`after_the_kernel_before`); then the program's K split (program_id 1), its projection's
    segment, weight, nested scales, offset and adapter (`projection_of`) and its tile
    (`program_tile`)."""
    if PDL:
        after_the_kernel_before()
    segment, start = segment_of(tl.program_id(0) * BLOCK_N, start1, start2, SEGMENTS)
    w_ptr, absmax2_ptr, code2_ptr, offset, a_ptr = projection_of(
        segment, SEGMENTS, w_ptr, w1_ptr, w2_ptr, absmax2_ptr, absmax2_1_ptr, absmax2_2_ptr,
        code2_ptr, code2_1_ptr, code2_2_ptr, offset, offset1, offset2, a_ptr, a1_ptr, a2_ptr)
    first_tile, rows, cols, local_cols, row_ok, col_ok = program_tile(start, M, N, BLOCK_M,
                                                                      BLOCK_N)
    return (tl.program_id(1), segment, w_ptr, absmax2_ptr, code2_ptr, offset, a_ptr, first_tile,
            rows, cols, local_cols, row_ok, col_ok)


@triton.jit
def store_partials(part_ptr, xa_part_ptr, row_up_ptr, acc, xa, split, M, N, rows, cols, ranks,
                   segment, first_tile, row_ok, col_ok, HAS_LORA: tl.constexpr,
                   SEGMENTS: tl.constexpr, R: tl.constexpr):
    """A program's partial sums `acc` and `xa`, each times its rows' powers of two (`row_up_ptr`,
    which undo the fp16 scaling of x's rows): the sums (stored as x W^T, in the parts' type:
    `Tiles.partials`) in its split's part, and, for the first column tile of its projection, its
    x A^T in the projection's R columns of xa_part."""
    row_up = tl.load(row_up_ptr + rows, mask=row_ok, other=1.0)
    acc = acc * row_up[None, :]
    xa = xa * row_up[:, None]
    tl.store(part_ptr + split * M * N + rows[None, :] * N + cols[:, None],
             acc.to(part_ptr.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])
    if HAS_LORA:  # noqa: SIM102  (a compile-time branch around a run-time one)
        if first_tile:
            xa_width = SEGMENTS * R
            tl.store(xa_part_ptr + split * M * xa_width + rows[:, None] * xa_width
                     + segment * R + ranks[None, :], xa, mask=row_ok[:, None])


@triton.jit
def scale_codes(codes_ptr, absmax2_ptr, k_tile, cols, local_cols, col_ok, stride_codes,
                k_tiles, NESTED: tl.constexpr, BLOCK2: tl.constexpr):
    """What the block scales of K tile(s) `k_tile` of columns `cols` (broadcast together) are
    read from (`codes_ptr`: [k_tiles, columns], rows `stride_codes` apart): with nested
    quantization their 8-bit codes and the float32 scale of each code's block of BLOCK2 (counted
    in the projection's own columns, `local_cols`); without, their float32 values (twice, so
    that both cases return a pair). `undo_codes` makes them scales."""
    codes = tl.load(codes_ptr + k_tile * stride_codes + cols, mask=col_ok, other=0)
    if NESTED:
        scales2 = tl.load(absmax2_ptr + (local_cols * k_tiles + k_tile) // BLOCK2, mask=col_ok,
                          other=0.0)
    else:
        scales2 = codes
    return codes, scales2


@triton.jit
def undo_codes(codes, scales2, code2_ptr, offset, NESTED: tl.constexpr):
    """The float32 block scales `scale_codes` read: bitsandbytes' double quantization undone (an
    8-bit code per block into `code2`, times its block's scale, plus `offset`), or as read."""
    if NESTED:
        scale = tl.load(code2_ptr + codes.to(tl.int32)) * scales2 + offset
    else:
        scale = codes
    return scale


@triton.jit
def nf4_lora_matmul(x_ptr, row_up_ptr, w_ptr, codes_ptr, absmax2_ptr, code2_ptr, offset,
                    a_ptr, part_ptr, xa_part_ptr, M, N, K, rank, stride_x, stride_codes,
                    w1_ptr, w2_ptr, absmax2_1_ptr, absmax2_2_ptr, code2_1_ptr, code2_2_ptr,
                    offset1, offset2, a1_ptr, a2_ptr, start1, start2,
                    K_SPLIT: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
                    HAS_LORA: tl.constexpr, QBLOCK: tl.constexpr, R: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                    XA_CHUNK: tl.constexpr, SEGMENTS: tl.constexpr,
                    XA_PRECISION: tl.constexpr = "ieee"):
    """One [BLOCK_N, rows] tile of W x^T over K_SPLIT of K (program_id 1 says which), one
    scale block per step, for x given as fp16 rows (`x_ptr`) and the float32 powers of two that
    undo their scaling (`row_up_ptr`, see `nf4_decode.fp16_rows`), in float32 to the partial
    sums part[split] (stored as x W^T);
    the first column tile also writes its split's share of x A^T (float32, as PEFT) to
    xa_part[split]. SEGMENTS above 1: W is a group of projections of one input side by side
    (q, k, v), the second starting at column `start1`, the third at `start2` (multiples of
    BLOCK_N; N where there is no third), each with its own weight, nested scales and adapter (the `*1`, `*2` arguments;
    the block scale codes are one copy of the group's columns); the first column tile of each
    writes its x A^T to its R columns of xa_part. The block scales of each step, and with XA_CHUNK equal to QBLOCK the
    adapter's tile, are loaded one step ahead, so that their latency (a code, then the lookup
    of its value) is off the step's path; a program of one step has nothing to load ahead. PDL:
    launched with programmatic dependent launch, see `after_the_kernel_before`. XA_CHUNK below
    QBLOCK: x A^T in products of XA_CHUNK columns, read where they are needed (an fp32 product
    on CUDA cores holds its whole K in registers, and a kernel gets the registers of its
    costliest path: at a K of 64 that is the adapter's)."""
    (split, segment, w_ptr, absmax2_ptr, code2_ptr, offset, a_ptr, first_tile, rows, cols,
     local_cols, row_ok, col_ok) = program_start(
        M, N, w_ptr, w1_ptr, w2_ptr, absmax2_ptr, absmax2_1_ptr, absmax2_2_ptr, code2_ptr,
        code2_1_ptr, code2_2_ptr, offset, offset1, offset2, a_ptr, a1_ptr, a2_ptr, start1, start2,
        PDL, SEGMENTS, BLOCK_M, BLOCK_N)
    pairs = tl.arange(0, QBLOCK // 2)  # byte j holds weights 2j (high nibble) and 2j + 1
    within = tl.arange(0, QBLOCK)
    ranks = tl.arange(0, R)
    a_ok = (ranks[:, None] < rank) & first_tile & HAS_LORA
    k_tiles = K // QBLOCK
    first_k_tile = split * (K_SPLIT // QBLOCK)
    last_k_tile = first_k_tile + K_SPLIT // QBLOCK - 1
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    codes, scales2 = scale_codes(codes_ptr, absmax2_ptr, first_k_tile, cols, local_cols, col_ok,
                                 stride_codes, k_tiles, NESTED, BLOCK2)
    if XA_CHUNK == QBLOCK:
        a = tl.load(a_ptr + ranks[:, None] * K + (split * K_SPLIT + within)[None, :], mask=a_ok,
                    other=0.0)
    else:  # read in chunks where it is used
        a = tl.zeros((R, QBLOCK), tl.float32)
    for step in range(0, K_SPLIT, QBLOCK):
        k0 = split * K_SPLIT + step
        k_tile = k0 // QBLOCK
        if K_SPLIT > QBLOCK:  # the next step's (at the last, this one's again: in bounds)
            ahead = tl.minimum(k_tile + 1, last_k_tile)
            next_codes, next_scales2 = scale_codes(codes_ptr, absmax2_ptr, ahead, cols,
                                                   local_cols, col_ok, stride_codes, k_tiles,
                                                   NESTED, BLOCK2)
            if XA_CHUNK == QBLOCK:
                next_a = tl.load(a_ptr + ranks[:, None] * K
                                 + (ahead * QBLOCK + within)[None, :], mask=a_ok, other=0.0)
            else:
                next_a = a
        else:
            next_codes, next_scales2, next_a = codes, scales2, a
        x = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + within)[None, :],
                    mask=row_ok[:, None], other=0.0)
        packed = tl.load(w_ptr + local_cols[:, None] * (K // 2) + (k0 // 2 + pairs)[None, :],
                         mask=col_ok[:, None], other=0)
        high, low = nf4_values(packed)
        values = tl.reshape(tl.join(high, low), (BLOCK_N, QBLOCK))  # weights 2j, 2j + 1
        # fp16 NF4 values (tf32's rounding of the code book) against x's fp16 rows, then the
        # block scale (the rows' powers of two after the loop)
        product = tl.dot(values, tl.trans(x))
        acc += product * undo_codes(codes, scales2, code2_ptr, offset, NESTED)[:, None]
        if HAS_LORA:  # noqa: SIM102  (a compile-time branch around a run-time one)
            if first_tile:
                if XA_CHUNK == QBLOCK:
                    xa += adapter_product(x, a, XA_PRECISION)
                else:
                    for chunk in tl.static_range(0, QBLOCK, XA_CHUNK):
                        at = k0 + chunk + tl.arange(0, XA_CHUNK)
                        xk = tl.load(x_ptr + rows[:, None] * stride_x + at[None, :],
                                     mask=row_ok[:, None], other=0.0)
                        ak = tl.load(a_ptr + ranks[:, None] * K + at[None, :],
                                     mask=ranks[:, None] < rank, other=0.0)
                        xa += adapter_product(xk, ak, XA_PRECISION)
        codes, scales2, a = next_codes, next_scales2, next_a
    store_partials(part_ptr, xa_part_ptr, row_up_ptr, acc, xa, split, M, N, rows, cols, ranks,
                   segment, first_tile, row_ok, col_ok, HAS_LORA, SEGMENTS, R)


@triton.jit
def sum_splits(part_ptr, xa_part_ptr, b_ptr, out_ptr, M, N, rank, scaling, b1_ptr, b2_ptr,
               start1, start2, SPLITS: tl.constexpr, HAS_LORA: tl.constexpr, R: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
               SEGMENTS: tl.constexpr):
    """out = bf16(sum of the splits, in float32 whatever their type, + s (x A^T) B^T) for
    BLOCK_M rows (program_id 1) by
    BLOCK_N columns, added in split order (replays give equal bits); in a group (SEGMENTS, as
    `nf4_lora_matmul`) with the x A^T and B of the columns' projection."""
    if PDL:
        after_the_kernel_before()
    segment, start = segment_of(tl.program_id(0) * BLOCK_N, start1, start2, SEGMENTS)
    if SEGMENTS > 1:
        b_ptr = pick(segment, b_ptr, b1_ptr, b2_ptr)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    where = rows[:, None] * N + cols[None, :]
    total = tl.load(part_ptr + where, mask=ok, other=0.0).to(tl.float32)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(part_ptr + split * M * N + where, mask=ok, other=0.0).to(tl.float32)
    if HAS_LORA:
        ranks = tl.arange(0, R)
        xa_width = SEGMENTS * R
        at = rows[:, None] * xa_width + segment * R + ranks[None, :]
        xa = tl.load(xa_part_ptr + at, mask=(rows < M)[:, None], other=0.0)
        for split in tl.static_range(1, SPLITS):
            xa += tl.load(xa_part_ptr + split * M * xa_width + at, mask=(rows < M)[:, None],
                          other=0.0)
        b = tl.load(b_ptr + (cols - start)[:, None] * rank + ranks[None, :],
                    mask=(cols < N)[:, None] & (ranks[None, :] < rank), other=0.0).to(tl.float32)
        total += tl.dot(xa, tl.trans(b), input_precision="ieee") * scaling
    tl.store(out_ptr + where, total.to(tl.bfloat16), mask=ok)


@triton.jit
def nf4_lora_matmul_wide(x_ptr, row_up_ptr, w_ptr, codes_ptr, absmax2_ptr, code2_ptr, offset,
                         a_ptr, part_ptr, xa_part_ptr, M, N, K, rank, stride_x, stride_codes,
                         w1_ptr, w2_ptr, absmax2_1_ptr, absmax2_2_ptr, code2_1_ptr, code2_2_ptr,
                         offset1, offset2, a1_ptr, a2_ptr, start1, start2,
                         K_SPLIT: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
                         HAS_LORA: tl.constexpr, QBLOCK: tl.constexpr, R: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                         SEGMENTS: tl.constexpr, KB: tl.constexpr, SPLIT_TILES: tl.constexpr,
                         XA_PRECISION: tl.constexpr = "ieee", LANE_ORDER: tl.constexpr = False):
    """`nf4_lora_matmul` with KB scale blocks a K step: each weight is its NF4 value times its
    block scale in fp16 (the scale brought near fp16's largest by a power of two per column,
    found once over the program's K_SPLIT before the loop (`split_column_shift`), rounded to fp16, then the product rounded: 11 significant bits, where
    bitsandbytes rounds the weight to bf16's 8, for blocks whose scale is at least 2**-24 of the
    column's largest in the split; smaller ones lose bits, down to zero at 2**-40, where the
    one-block kernel stays exact), so that one product of K = KB x QBLOCK accumulates KB blocks
    in place and each step loads KB blocks of the packed weight at once; the column's and the
    row's powers of two multiply the sums once, after the loop. LANE_ORDER: x's rows come with
    each K step's columns in `lane_order` (`nf4_decode.fp16_rows`), the weights are read to
    match (`lane_weights`) and the adapter's A in the same order. The arguments and outputs are
    `nf4_lora_matmul`'s."""
    (split, segment, w_ptr, absmax2_ptr, code2_ptr, offset, a_ptr, first_tile, rows, cols,
     local_cols, row_ok, col_ok) = program_start(
        M, N, w_ptr, w1_ptr, w2_ptr, absmax2_ptr, absmax2_1_ptr, absmax2_2_ptr, code2_ptr,
        code2_1_ptr, code2_2_ptr, offset, offset1, offset2, a_ptr, a1_ptr, a2_ptr, start1, start2,
        PDL, SEGMENTS, BLOCK_M, BLOCK_N)
    STEP: tl.constexpr = KB * QBLOCK
    blocks = tl.arange(0, KB)
    pairs = tl.arange(0, QBLOCK // 2)
    within = tl.arange(0, STEP)
    if LANE_ORDER:
        a_at = lane_order(STEP)
    else:
        a_at = within
    ranks = tl.arange(0, R)
    a_ok = (ranks[:, None] < rank) & first_tile & HAS_LORA
    k_tiles = K // QBLOCK
    column_shift = split_column_shift(codes_ptr, absmax2_ptr, code2_ptr, offset, split, cols,
                                      local_cols, col_ok, stride_codes, k_tiles, NESTED, BLOCK2,
                                      K_SPLIT // QBLOCK, SPLIT_TILES, BLOCK_N)
    column_down = power_of_two(-column_shift)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for step in range(0, K_SPLIT, STEP):
        k0 = split * K_SPLIT + step
        tiles = k0 // QBLOCK + blocks  # [KB]
        scale = block_scales(codes_ptr, absmax2_ptr, code2_ptr, offset, tiles[None, :],
                             cols[:, None], local_cols[:, None], col_ok[:, None], stride_codes,
                             k_tiles, NESTED, BLOCK2)  # [BLOCK_N, KB]
        if LANE_ORDER:
            scale16 = (scale * column_down[:, None]).to(tl.float16)
            weights = lane_weights(w_ptr, local_cols, col_ok, scale16, k0, K, KB, STEP, BLOCK_N)
        else:
            packed = tl.load(w_ptr + local_cols[:, None, None] * (K // 2)
                             + (k0 // 2 + blocks * (QBLOCK // 2))[None, :, None]
                             + pairs[None, None, :], mask=col_ok[:, None, None], other=0)
            high, low = nf4_values(packed)  # [BLOCK_N, KB, QBLOCK // 2] each
            values = tl.reshape(tl.join(high, low), (BLOCK_N, KB, QBLOCK))
            scale16 = (scale * column_down[:, None]).to(tl.float16)
            weights = tl.reshape(values * scale16[:, :, None], (BLOCK_N, STEP))
        x = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + within)[None, :],
                    mask=row_ok[:, None], other=0.0)
        acc = tl.dot(weights, tl.trans(x), acc)
        if HAS_LORA:  # noqa: SIM102  (a compile-time branch around a run-time one)
            if first_tile:
                a = tl.load(a_ptr + ranks[:, None] * K + (k0 + a_at)[None, :], mask=a_ok,
                            other=0.0)
                xa += adapter_product(x, a, XA_PRECISION)
    store_partials(part_ptr, xa_part_ptr, row_up_ptr, acc * power_of_two(column_shift)[:, None],
                   xa, split, M, N, rows, cols, ranks, segment, first_tile, row_ok, col_ok,
                   HAS_LORA, SEGMENTS, R)


@triton.jit
def split_column_shift(codes_ptr, absmax2_ptr, code2_ptr, offset, split, cols, local_cols,
                       col_ok, stride_codes, k_tiles, NESTED: tl.constexpr,
                       BLOCK2: tl.constexpr, COUNT: tl.constexpr, SPLIT_TILES: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """`fp16_shift` of each column's largest block scale among the COUNT tiles of K split
    `split`, read SPLIT_TILES (a power of two) at a time. A column past the weight's last reads the masked loads' scale (`offset`, or 0), whose
    power of two keeps its discarded weights finite."""
    largest = split_chunk_largest(codes_ptr, absmax2_ptr, code2_ptr, offset, split, 0, cols,
                                  local_cols, col_ok, stride_codes, k_tiles, NESTED, BLOCK2,
                                  COUNT, SPLIT_TILES)
    for first in range(SPLIT_TILES, COUNT, SPLIT_TILES):  # none where one read holds them all
        largest = tl.maximum(largest, split_chunk_largest(
            codes_ptr, absmax2_ptr, code2_ptr, offset, split, first, cols, local_cols, col_ok,
            stride_codes, k_tiles, NESTED, BLOCK2, COUNT, SPLIT_TILES))
    return fp16_shift(largest)


@triton.jit
def split_chunk_largest(codes_ptr, absmax2_ptr, code2_ptr, offset, split, first, cols,
                        local_cols, col_ok, stride_codes, k_tiles, NESTED: tl.constexpr,
                        BLOCK2: tl.constexpr, COUNT: tl.constexpr, SPLIT_TILES: tl.constexpr):
    """Each column's largest block scale among tiles `first` to `first + SPLIT_TILES` of the
    COUNT of K split `split`."""
    at = first + tl.arange(0, SPLIT_TILES)
    in_split = (at < COUNT)[None, :]
    scales = block_scales(codes_ptr, absmax2_ptr, code2_ptr, offset, (split * COUNT + at)[None, :],
                          cols[:, None], local_cols[:, None], col_ok[:, None] & in_split,
                          stride_codes, k_tiles, NESTED, BLOCK2)
    return tl.max(tl.where(in_split, tl.abs(scales), 0.0), 1)


@triton.jit
def block_scales(codes_ptr, absmax2_ptr, code2_ptr, offset, tiles, cols, local_cols, ok,
                 stride_codes, k_tiles, NESTED: tl.constexpr, BLOCK2: tl.constexpr):
    """The float32 block scales of K tiles `tiles` of columns `cols` (broadcast together)."""
    codes, scales2 = scale_codes(codes_ptr, absmax2_ptr, tiles, cols, local_cols, ok,
                                 stride_codes, k_tiles, NESTED, BLOCK2)
    return undo_codes(codes, scales2, code2_ptr, offset, NESTED)


@triton.jit
def lane_order(STEP: tl.constexpr):
    """Which column of a K step of STEP each column of the tensor cores' register operand takes,
    so that each lane's weights are one contiguous quarter of the step: in every 16 columns c,
    lane l of a quad holds columns 2l, 2l + 1, 2l + 8 and 2l + 9 (`nf4_decode.lane_order_index`
    is the same in torch)."""
    k = tl.arange(0, STEP)
    return (k // 2) % 4 * (STEP // 4) + k // 16 * 4 + (k // 8) % 2 * 2 + k % 2


@triton.jit
def lane_weights(w_ptr, local_cols, col_ok, scale16, k0, K, KB: tl.constexpr,
                 STEP: tl.constexpr, BLOCK_N: tl.constexpr):
    """One K step's fp16 weights [BLOCK_N, STEP] in `lane_order`: the packed bytes read as four
    contiguous quarters of the step (a lane's 16-byte loads where K's order gives it single
    bytes four apart), each quarter times its block's fp16 scale (`scale16`, [BLOCK_N, KB], KB
    of 2 or 4)."""
    quarter_scale = tl.reshape(tl.broadcast_to(scale16[:, :, None], (BLOCK_N, KB, 4 // KB)),
                               (BLOCK_N, 4))
    packed = tl.load(w_ptr + local_cols[:, None, None] * (K // 2) + k0 // 2
                     + tl.arange(0, 4)[None, :, None] * (STEP // 8)
                     + tl.arange(0, STEP // 8)[None, None, :], mask=col_ok[:, None, None],
                     other=0)
    high, low = nf4_values(packed)  # [BLOCK_N, 4, STEP // 8] each: weights 2j, 2j + 1
    values = tl.join(high, low) * quarter_scale[:, :, None, None]
    values = tl.reshape(values, (BLOCK_N, 4, STEP // 16, 2, 2))  # quarter, chunk, half, nibble
    return tl.reshape(tl.permute(values, (0, 2, 3, 1, 4)), (BLOCK_N, STEP))
