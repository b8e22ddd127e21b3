"""NF4 projections for decode steps. A decode step multiplies a few rows by each 4-bit weight;
bitsandbytes does it by writing the whole weight out in bf16 (`dequantize_4bit`, after dequantizing
the nested block scales) and reading it back for a bf16 matrix product, and PEFT adds the adapter
in float32 with a clone, two casts, two products, a scale and an add: about ten kernels and five
times the weight's bytes per projection. Here two Triton launches do it: the first reads the packed
4-bit weight once and decodes it in registers, with K split over the SMs so that a few rows still
keep the GPU busy, and its first column tile also computes the adapter's `x A^T`; the second adds
the splits in a fixed order (replays give equal bits) plus `s (x A^T) B^T` and rounds once to bf16
(the splits' partial sums are stored in between as `Tiles.partials` says).
A K step takes `Tiles.k_blocks` scale blocks. The codes become fp16 NF4 values by byte permutes
(`prmt`, a table lookup in registers; with bitsandbytes' selects the kernel's loop had about twice
the instructions), and the product runs in fp16 with the weight as the tensor cores' register
operand: the values are tf32's rounding of the float32 code book, and x comes in as fp16 rows
(`fp16_rows`), each scaled by a power of two that puts its largest element near fp16's largest
(exact in fp16 but for elements 2**-29 of it or smaller), undone on the partial sums. Those are
plain tensor operations before the operator, which torch.compile can fuse into the kernel
that computed x (the norms before q, k, v and gate, up; after the decode attention's own
operator they are a kernel of their own, and without torch.compile a few); converting x inside
the kernel cost every program every K step, and the programs of a projection each converted the
same x. With one block a step (`nf4_lora_matmul`) the block scale
multiplies the float32 product, so the weights are never rounded; with several
(`nf4_lora_matmul_wide`, the shipped tiles) each weight, its NF4 value times its block scale, is
rounded to fp16 before the product: 11 significant bits where bitsandbytes rounds the same
product to bf16's 8, for blocks whose scale is at least 2**-24 of the largest of its column in
the program's share of K (smaller ones lose bits, down to zero at 2**-40; bitsandbytes' block
scales of one weight row are nowhere near that apart). The block scales (8-bit codes with nested quantization,
undone in the kernel) are copied once in K-tile-major order, next to bitsandbytes' own, so that a
program reads its columns' scales in one coalesced load. The adapter is read where it lives
(`lora_A.weight`, `lora_B.weight`), so a CUDA graph captured over it sees every optimizer step; it
is added in float32 before the one rounding (PEFT rounds it first). The operator
`vlmrl::nf4_matmul` wraps it for torch.compile; the kernels themselves are in
`vlmrl.training.rollout.nf4_kernels`, imported where they run. Up to three projections of one input (q, k,
v; gate, up) go side by side through one launch of each kernel (`nf4_group_matmul`), each program
picking its projection's weight, scales and adapter by its columns: one projection of a decode
step is too small to fill the GPU, and each launch has fixed costs; which layers are grouped is
`vlmrl.training.rollout.nf4_projections`' business. Its share of a decode step's time:
docs/benchmarks.md ("Where a decode step's time goes"); its error against bitsandbytes + PEFT:
tests/gpu/test_graph_decode_gpu.py. Dropout is not applied (as in `MergedLoRA` and vLLM): with `train.lora.dropout`
above 0 the layers of a module in training mode keep PEFT's forward."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

MAX_ROWS = 64  # rows per call served by the kernel; more rows (prefill) take bitsandbytes' path
MAX_GROUP = 3  # projections of one input in one launch (q, k, v)


def kernel_available() -> bool:
    """Whether this machine can run the kernel: CUDA, Triton and bitsandbytes present."""
    from importlib.util import find_spec

    return (torch.cuda.is_available() and find_spec("triton") is not None
            and find_spec("bitsandbytes") is not None)


@functools.cache
def _kernel():
    import triton

    from vlmrl.training.rollout import nf4_kernels

    return triton, nf4_kernels.nf4_lora_matmul, nf4_kernels.sum_splits, \
        nf4_kernels.nf4_lora_matmul_wide


# The types `Tiles.partials` names, for the K splits' partial sums between the two launches.
PARTIALS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Tiles:
    """The kernel's tile shape (its K step `k_blocks` scale blocks); `programs_per_sm` is how many
    programs per SM it aims for when it splits K. The sum of the splits takes `sum_rows` rows by
    `sum_block_n` columns a program: a small tile, so that even a projection of 1024 columns
    spreads its partial sums over most SMs. `pdl`: both launches use programmatic dependent
    launch (Hopper and later), so that each is on the GPU, waiting, before the kernel before it
    ends (ignored before Hopper). `xa_chunk`: columns of x per product of the adapter's x A^T
    (the scale block where it is larger). `max_registers`: a cap on the first kernel's
    registers per thread (Triton's maxnreg), for more programs per SM. The last two apply
    where a program takes several K steps only: with one, the adapter's tile is not loaded
    ahead, and ptxas takes the cap as a target, so it would raise the registers instead.
    `k_blocks`: scale blocks a K step (above 1, `nf4_lora_matmul_wide`: the weights rounded to
    fp16 before the product, larger loads, fewer steps; fewer blocks where the input width has
    no whole steps of that many; `xa_chunk` does not apply). `xa_precision`:
    the adapter's x A^T as `tl.dot` takes it: "ieee" (float32 on CUDA cores, whose registers then
    set the kernel's), "tf32" (tensor cores; x's fp16 rows are exact in tf32, A rounded to 11
    significant bits), "tf32x3", or "fp16" (tensor cores on x's fp16 rows as they are and A
    rounded to fp16: tf32's 11 significant bits in fp16's range, and no float32 copy of x in
    registers). `lane_order` (with K steps of 2 or 4 blocks): `fp16_rows` lays each K step's
    columns out in the order the tensor cores' register operand gives its lanes, so that the
    kernel reads a lane's packed bytes as one contiguous quarter of the step (16-byte loads where
    K's own order gives single bytes four apart); the sums are the same. `partials`: the type
    the K splits' partial sums are stored in between the two launches ("bfloat16": half the
    bytes, each partial rounded to 8 significant bits; the second launch adds them in float32)."""

    block_n: int = 64
    warps: int = 4
    stages: int = 3
    programs_per_sm: float = 4
    sum_block_n: int = 16
    sum_rows: int = 16
    pdl: bool = False
    xa_chunk: int = 64
    max_registers: int | None = None
    k_blocks: int = 1
    xa_precision: str = "ieee"
    lane_order: bool = False
    partials: str = "float32"

    def __post_init__(self) -> None:
        if self.partials not in PARTIALS:
            raise ValueError(f"Tiles.partials is {self.partials!r}, not one of "
                             f"{', '.join(map(repr, PARTIALS))}")
        for name in ("block_n", "sum_block_n", "sum_rows", "xa_chunk", "k_blocks"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Tiles.{name} is {value}: Triton's tiles are powers of two")
        if self.xa_chunk < 16:
            raise ValueError(f"Tiles.xa_chunk is {self.xa_chunk}: tl.dot's K is 16 or more")
        if self.xa_precision not in ("ieee", "tf32", "tf32x3", "fp16"):
            raise ValueError(f"Tiles.xa_precision is {self.xa_precision!r}, not 'ieee' (float32 "
                             "on CUDA cores), 'tf32', 'tf32x3' or 'fp16' (tensor cores)")
        if self.lane_order and self.k_blocks > 4:
            raise ValueError(f"Tiles.lane_order takes K steps of 2 or 4 blocks, not "
                             f"k_blocks={self.k_blocks}")
        if self.max_registers is not None and not 32 <= self.max_registers <= 255:
            raise ValueError(f"Tiles.max_registers is {self.max_registers}, not 32 to 255")


# The tiles measured fastest over the decode step's projections of both shapes
# (`benchmarks/decode_profile.py --sweep` times tile shapes per projection), with the partial sums
# in bfloat16: the 8B recipe's GSPO step measured shorter with them, their error at most twice
# bitsandbytes + PEFT's (tests/gpu/test_graph_decode_gpu.py).
TILES = Tiles(block_n=128, k_blocks=2, xa_precision="fp16", partials="bfloat16")


def k_splits(out_features: int, in_features: int, tiles: Tiles, sms: int,
             blocksize: int = 64) -> int:
    """The fewest splits of K (a divisor of its count of K steps, `step_blocks` scale blocks
    each) that give every SM `programs_per_sm` programs, or all of them."""
    column_blocks = -(-out_features // tiles.block_n)
    k_steps = in_features // (blocksize * step_blocks(in_features, tiles, blocksize))
    divisors = [d for d in range(1, k_steps + 1) if k_steps % d == 0]
    wanted = tiles.programs_per_sm * sms
    return next((d for d in divisors if column_blocks * d >= wanted), divisors[-1])


def step_blocks(in_features: int, tiles: Tiles, blocksize: int = 64) -> int:
    """Scale blocks a K step: `tiles.k_blocks`, halved until it divides the input width's
    blocks."""
    blocks = tiles.k_blocks
    while (in_features // blocksize) % blocks:
        blocks //= 2
    return blocks


@dataclass(frozen=True)
class PackedNF4:
    """What the kernel reads of a Linear4bit: the packed 4-bit weight (bitsandbytes' own tensor,
    not its Parameter subclass), the block scales (`absmax`: float32, or with nested
    quantization 8-bit codes that `code2`, `absmax2` per `block2` blocks and `offset` undo) and
    the shape. `absmax` is a copy of bitsandbytes' in K-tile-major order ([in / blocksize,
    out]; with nested quantization a byte per 64 weights, kept as long as the `NF4Decode`), so
    that a program reads its columns' scales of one K tile in one coalesced load; the nested
    tensors are bitsandbytes' own."""

    packed: torch.Tensor
    absmax: torch.Tensor
    out_features: int
    in_features: int
    blocksize: int
    absmax2: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    offset: float = 0.0
    block2: int = 256

    @classmethod
    def of(cls, layer) -> PackedNF4:
        state = layer.weight.quant_state
        out_features, in_features = tuple(state.shape)
        by_k_tile = state.absmax.view(out_features, in_features // state.blocksize).t().contiguous()
        if not state.nested:
            return cls(layer.weight.data, by_k_tile.float(), out_features, in_features,
                       state.blocksize)
        nested = state.state2
        return cls(layer.weight.data, by_k_tile, out_features, in_features,
                   state.blocksize, nested.absmax.contiguous(),
                   nested.code.to(device=layer.weight.device, dtype=torch.float32).contiguous(),
                   float(state.offset), nested.blocksize)

    @classmethod
    def group(cls, layers: Sequence) -> list[PackedNF4]:
        """`of` each Linear4bit of a group (one input width and kind of scales), their block scale
        codes adjacent columns of one K-tile-major copy, as `nf4_group_matmul` reads them in one
        launch."""
        return side_by_side([cls.of(layer) for layer in layers])

    def scales(self) -> torch.Tensor:
        """The float32 scale of every block in bitsandbytes' order, as it dequantizes them (for
        tests)."""
        codes = self.absmax.t().reshape(-1)
        if self.absmax2 is None:
            return codes
        return (self.code2[codes.long()]
                * self.absmax2.repeat_interleave(self.block2)[:codes.numel()] + self.offset)


def side_by_side(weights: Sequence[PackedNF4]) -> list[PackedNF4]:
    """The weights with their block scale codes moved into one K-tile-major copy, adjacent
    columns in order (what `groupable` asks of a group)."""
    codes = torch.cat([weight.absmax for weight in weights], dim=1)
    starts = [0, *column_starts([weight.out_features for weight in weights])]
    return [replace(weight, absmax=codes[:, start:start + weight.out_features])
            for weight, start in zip(weights, starts)]


def column_starts(widths: Sequence[int]) -> list[int]:
    """Where each projection after the first starts among projections of these widths side by
    side."""
    return list(itertools.accumulate(widths))[:-1]


def adapter_kind(lora: tuple | None) -> tuple | None:
    """What a group's adapters must share, (A, B, s) -> rank, dtypes and scale; no adapter (None
    or ()) as it is."""
    if not lora:
        return lora
    a, b, scaling = lora
    return a.shape[0], a.dtype, b.dtype, float(scaling)


def nf4_matmul(x: torch.Tensor, weight: PackedNF4, lora: tuple | None = None,
               tiles: Tiles | None = None) -> torch.Tensor:
    """`x @ W^T (+ s (x A^T) B^T)` for x of at most MAX_ROWS rows (any leading shape), bf16 out.
    `lora` is (A [r, in] float32, B [out, r] float32, s); `tiles` defaults to the module's
    TILES as it is at the call (a benchmark may set it)."""
    return nf4_group_matmul(x, (weight,), None if lora is None else (lora,), tiles)


def groupable(weights: Sequence[PackedNF4], loras: Sequence[tuple] | None, tiles: Tiles) -> bool:
    """Whether `nf4_group_matmul` takes these projections in one launch: at most three of one
    input width and kind of scales, their block scale codes adjacent columns of one K-tile-major
    copy (`PackedNF4.group`), each starting at a multiple of both column tiles, and adapters of
    one rank, scale and dtype."""
    first = weights[0]
    widths = [w.out_features for w in weights]
    size = first.absmax.element_size()
    adjacent = all(
        w.absmax.data_ptr() == first.absmax.data_ptr() + start * size
        and w.absmax.stride() == first.absmax.stride() and w.absmax.dtype == first.absmax.dtype
        for w, start in zip(weights[1:], column_starts(widths)))
    alike = all((w.in_features, w.blocksize, w.absmax2 is None, w.block2)
                == (first.in_features, first.blocksize, first.absmax2 is None, first.block2)
                for w in weights)
    adapters = loras is None or len({adapter_kind(lora) for lora in loras}) == 1
    return adjacent and alike and adapters and starts_fit(widths, tiles)


def starts_fit(widths: Sequence[int], tiles: Tiles) -> bool:
    """Whether projections of these widths side by side can share a launch: at most MAX_GROUP,
    each starting at a multiple of both column tiles (a program's columns are one projection's)."""
    tile = max(tiles.block_n, tiles.sum_block_n)
    return len(widths) <= MAX_GROUP and all(start % tile == 0 for start in column_starts(widths))


def fp16_rows(x: torch.Tensor, tiles: Tiles | None = None,
              blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """x (bf16, [..., K]) as the kernel reads it: each row in fp16, scaled by the power of two
    that puts its largest element in [2**14, 2**15) (exact but for elements 2**-29 of it or
    smaller; down for rows beyond fp16's range, up for small ones), with `tiles.lane_order` each
    K step's columns in `lane_order_index`'s order, and the float32 power of two that undoes the
    scaling, [...]. Plain tensor operations, so that under torch.compile they can join the
    kernel that computed x (a norm, the MLP's product) instead of running once per column tile
    inside the NF4 kernel; after a custom operator (the decode attention's) and without
    torch.compile they are kernels of their own. `tiles` and `blocksize`: the launch's (default
    TILES as it is at the call, and bitsandbytes' blocks of 64)."""
    largest = x.abs().amax(-1).float()
    exponent = ((largest.view(torch.int32) >> 23) & 0xFF) - 127
    shift = torch.clamp(exponent - 14, min=-126)
    down = ((127 - shift) << 23).view(torch.float32)
    x16 = (x.float() * down[..., None]).to(torch.float16)
    step = lane_step(x.shape[-1], tiles or TILES, blocksize)
    if step is not None:
        x16 = x16[..., lane_order_index(x.shape[-1], step, x.device)]
    return x16, ((127 + shift) << 23).view(torch.float32)


def lane_step(in_features: int, tiles: Tiles, blocksize: int = 64) -> int | None:
    """The K step whose columns the kernel takes in lane order (`Tiles.lane_order`, where the wide
    kernel runs), or None."""
    blocks = step_blocks(in_features, tiles, blocksize)
    return blocks * blocksize if tiles.lane_order and blocks > 1 else None


def lane_order_index(in_features: int, step: int, device: torch.device) -> torch.Tensor:
    """For each column of x as the kernel reads it in lane order, the column of x it holds: in
    each step, columns 2l, 2l + 1, 2l + 8 and 2l + 9 of every 16 (lane l of a quad of the tensor
    cores' register operand) come from the l-th quarter of the step, in order
    (`nf4_kernels.lane_order`)."""
    k = torch.arange(in_features, device=device)
    within = k % step
    return (k - within + (within // 2) % 4 * (step // 4) + within // 16 * 4
            + (within // 8) % 2 * 2 + within % 2)


def nf4_group_matmul(x: torch.Tensor, weights: Sequence[PackedNF4],
                     loras: Sequence[tuple] | None = None,
                     tiles: Tiles | None = None) -> torch.Tensor:
    """`nf4_matmul` of several projections of one input (q, k, v; gate, up), their outputs side
    by side in one tensor, in one launch of each kernel where `groupable` (else one per
    projection, concatenated): a decode step's projections are too small to fill the GPU one by
    one, and their launches' fixed costs add up. `loras`: one (A, B, s) per projection, or None."""
    return nf4_rows_matmul(*fp16_rows(x, tiles, weights[0].blocksize), weights, loras, tiles)


def nf4_rows_matmul(x16: torch.Tensor, row_up: torch.Tensor, weights: Sequence[PackedNF4],
                    loras: Sequence[tuple] | None = None,
                    tiles: Tiles | None = None) -> torch.Tensor:
    """`nf4_group_matmul` of x given as `fp16_rows` gives it for the same tiles."""
    if x16.dtype != torch.float16 or row_up.dtype != torch.float32:
        raise TypeError(f"the NF4 kernel takes x as fp16_rows gives it (fp16 rows, float32 "
                        f"powers of two), not {x16.dtype} and {row_up.dtype}")
    tiles = tiles or TILES
    if len(weights) > 1 and not groupable(weights, loras, tiles):
        warnings.warn(f"NF4 projections of widths {[w.out_features for w in weights]} can't "
                      f"share a launch with {tiles}: one launch each", stacklevel=2)
        return torch.cat([nf4_rows_matmul(x16, row_up, [w], None if loras is None else [lora],
                                          tiles)
                          for w, lora in zip(weights, loras or [None] * len(weights))], dim=-1)
    triton, kernel, sum_splits, wide_kernel = _kernel()
    first = weights[0]
    in_features = first.in_features
    out_features = sum(w.out_features for w in weights)
    starts = column_starts([w.out_features for w in weights])
    starts += [out_features] * (MAX_GROUP - 1 - len(starts))
    flat = x16.reshape(-1, in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    row_up = row_up.reshape(-1).contiguous()
    rows = flat.shape[0]
    splits = k_splits(out_features, in_features, tiles, _sm_count(x16.device), first.blocksize)
    parts = torch.empty(splits, rows, out_features, dtype=PARTIALS[tiles.partials],
                        device=x16.device)
    adapters = loras or [(flat, flat, 1.0)] * len(weights)
    rank = adapters[0][0].shape[0] if loras is not None else 1
    r_tile = max(16, triton.next_power_of_2(rank))
    xa_parts = torch.empty(splits, rows, len(weights) * r_tile, dtype=torch.float32,
                           device=x16.device)
    block_m = max(16, triton.next_power_of_2(rows))
    nested = first.absmax2 is not None

    def each(values: list) -> list:  # three of them: the kernels' arguments for a group
        return [*values, *[values[0]] * (MAX_GROUP - len(values))]

    packed = each([w.packed for w in weights])
    absmax2 = each([w.absmax2 if nested else w.absmax for w in weights])
    code2 = each([w.code2 if nested else w.absmax for w in weights])
    offsets = each([float(w.offset) for w in weights])
    a, b = each([lora[0] for lora in adapters]), each([lora[1] for lora in adapters])
    use_pdl = tiles.pdl and _hopper(x16.device)
    pdl = {"PDL": use_pdl, "launch_pdl": use_pdl}
    options = _step_options(tiles, in_features // splits, first.blocksize,
                            step_blocks(in_features, tiles, first.blocksize))
    (wide_kernel if "KB" in options else kernel)[(triton.cdiv(out_features, tiles.block_n),
                                                  splits)](
        flat, row_up, packed[0], first.absmax, absmax2[0], code2[0], offsets[0], a[0], parts, xa_parts,
        rows, out_features, in_features, rank, flat.stride(0), first.absmax.stride(0),
        packed[1], packed[2], absmax2[1], absmax2[2], code2[1], code2[2], offsets[1],
        offsets[2], a[1], a[2], starts[0], starts[1],
        K_SPLIT=in_features // splits, NESTED=nested, BLOCK2=first.block2,
        HAS_LORA=loras is not None, QBLOCK=first.blocksize, R=r_tile, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, num_warps=tiles.warps, num_stages=tiles.stages, **pdl,
        SEGMENTS=len(weights), XA_PRECISION=tiles.xa_precision, **options)
    out = torch.empty(rows, out_features, dtype=torch.bfloat16, device=x16.device)
    sum_rows = min(block_m, tiles.sum_rows)
    sum_splits[(triton.cdiv(out_features, tiles.sum_block_n), triton.cdiv(rows, sum_rows))](
        parts, xa_parts, b[0], out, rows, out_features, rank, float(adapters[0][2]), b[1], b[2],
        starts[0], starts[1], SPLITS=splits, HAS_LORA=loras is not None, R=r_tile,
        BLOCK_M=sum_rows, BLOCK_N=tiles.sum_block_n, SEGMENTS=len(weights), **pdl)
    return out.view(*x16.shape[:-1], out_features)


def _step_options(tiles: Tiles, k_split: int, blocksize: int, blocks: int) -> dict:
    """The first kernel's step options: scale blocks a step (`KB`, the wide kernel's) or the
    one-block kernel's adapter chunk, and the register cap, which applies to programs of several
    K steps only (see Tiles)."""
    from triton import next_power_of_2

    step = blocksize * blocks
    if blocks > 1:
        options = {"KB": blocks, "LANE_ORDER": tiles.lane_order,
                   "SPLIT_TILES": min(next_power_of_2(k_split // blocksize), 16)}
    else:
        options = {"XA_CHUNK": blocksize if k_split <= step else min(tiles.xa_chunk, blocksize)}
    if k_split > step and tiles.max_registers is not None:
        options["maxnreg"] = tiles.max_registers
    return options


@torch.library.custom_op("vlmrl::nf4_matmul", mutates_args=())
def nf4_matmul_op(x16: torch.Tensor, row_up: torch.Tensor, packed: list[torch.Tensor],
                  absmax: list[torch.Tensor],
                  absmax2: list[torch.Tensor], code2: list[torch.Tensor], offsets: list[float],
                  block2: int, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                  scaling: float, out_features: list[int], blocksize: int) -> torch.Tensor:
    """`nf4_rows_matmul` of one projection or a group, with the module's TILES, as one operator,
    which torch.compile calls as it is (it does not trace into the Triton launches) and a CUDA
    graph captures (with the TILES of the capture). Per projection: its packed weight, block
    scale codes, nested scales (`absmax2`, `code2`: empty without), offset, adapter (`lora_a`,
    `lora_b`: empty without; one `scaling`) and output width."""
    weights = [PackedNF4(weight, codes, width, x16.shape[-1], blocksize,
                         absmax2[i] if absmax2 else None, code2[i] if code2 else None,
                         offsets[i], block2)
               for i, (weight, codes, width) in enumerate(zip(packed, absmax, out_features))]
    loras = [(a, b, scaling) for a, b in zip(lora_a, lora_b)] or None
    return nf4_rows_matmul(x16, row_up, weights, loras)


@nf4_matmul_op.register_fake
def _(x16, row_up, packed, absmax, absmax2, code2, offsets, block2, lora_a, lora_b, scaling,
      out_features, blocksize):
    return x16.new_empty(*x16.shape[:-1], sum(out_features), dtype=torch.bfloat16)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _hopper(device: torch.device) -> bool:
    """Whether the device has programmatic dependent launch (compute capability 9 or more)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
