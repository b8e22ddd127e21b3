"""NF4 projections for decode steps. A decode step multiplies a few rows by each 4-bit weight;
bitsandbytes does it by writing the whole weight out in bf16 (`dequantize_4bit`, after dequantizing
the nested block scales) and reading it back for a bf16 matrix product, and PEFT adds the adapter
in float32 with a clone, two casts, two products, a scale and an add: about ten kernels and five
times the weight's bytes per projection. Here two Triton launches do it: the first reads the packed
4-bit weight once and decodes it in registers, with K split over the SMs so that a few rows still
keep the GPU busy, and its first column tile also computes the adapter's `x A^T`; the second adds
the splits in a fixed order (replays give equal bits) plus `s (x A^T) B^T` and rounds once to bf16.
Each K tile is one scale block. The codes become fp16 NF4 values by byte permutes (`prmt`, a table
lookup in registers; with bitsandbytes' selects the kernel's loop had about twice the
instructions), and the product runs in fp16 with the weight as the tensor cores' register operand:
the values are tf32's rounding of the float32 code book, each row of x's K tile is scaled by a
power of two that puts its largest element near fp16's largest (exact in fp16 but for elements
2**-29 of it or smaller), and the block scale and that power of two multiply the float32 product,
so the weights are never rounded to bf16. The block scales (8-bit codes with nested quantization,
undone in the kernel) are copied once in K-tile-major order, next to bitsandbytes' own, so that a
program reads its columns' scales in one coalesced load. The adapter is read where it lives
(`lora_A.weight`, `lora_B.weight`), so a CUDA graph captured over it sees every optimizer step; it
is added in float32 before the one rounding (PEFT rounds it first). The operator
`vlmrl::nf4_matmul` wraps it for torch.compile; the kernels themselves are in
`vlmrl.rollout.nf4_kernels`, imported where they run. Measured speed and exactness:
docs/benchmarks.md. Dropout is not applied (as in `MergedLoRA` and vLLM): with `train.lora.dropout`
above 0 the layers of a module in training mode keep PEFT's forward."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MAX_ROWS = 64  # rows per call served by the kernel; more rows (prefill) take bitsandbytes' path


def kernel_available() -> bool:
    """Whether this machine can run the kernel: CUDA, Triton and bitsandbytes present."""
    from importlib.util import find_spec

    return (torch.cuda.is_available() and find_spec("triton") is not None
            and find_spec("bitsandbytes") is not None)


@functools.cache
def _kernel():
    import triton

    from vlmrl.rollout import nf4_kernels

    return triton, nf4_kernels.nf4_lora_matmul, nf4_kernels.sum_splits


@dataclass(frozen=True)
class Tiles:
    """The kernel's tile shape (its K tile is one scale block); `programs_per_sm` is how many
    programs per SM it aims for when it splits K. The sum of the splits takes `sum_rows` rows by
    `sum_block_n` columns a program: a small tile, so that even a projection of 1024 columns
    spreads its partial sums over most SMs. `pdl`: both launches use programmatic dependent
    launch (Hopper and later), so that each is on the GPU, waiting, before the kernel before it
    ends (ignored before Hopper). `xa_chunk`: columns of x per product of the adapter's x A^T
    (the scale block where it is larger). `max_registers`: a cap on the first kernel's
    registers per thread (Triton's maxnreg), for more programs per SM. The last two apply
    where a program takes several K steps only: with one, the adapter's tile is not loaded
    ahead, and ptxas takes the cap as a target, so it would raise the registers instead."""

    block_n: int = 64
    warps: int = 4
    stages: int = 3
    programs_per_sm: float = 4
    sum_block_n: int = 16
    sum_rows: int = 16
    pdl: bool = False
    xa_chunk: int = 64
    max_registers: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_n", "sum_block_n", "sum_rows", "xa_chunk"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Tiles.{name} is {value}: Triton's tiles are powers of two")
        if self.xa_chunk < 16:
            raise ValueError(f"Tiles.xa_chunk is {self.xa_chunk}: tl.dot's K is 16 or more")
        if self.max_registers is not None and not 32 <= self.max_registers <= 255:
            raise ValueError(f"Tiles.max_registers is {self.max_registers}, not 32 to 255")


# The tiles the sweeps of earlier kernels chose (NF4 decode kernel in docs/benchmarks-history.md);
# on this kernel, the tile shapes timed per projection shape of both models found none clearly
# faster but on the 2B shape's k and v projections (tests/gpu/README.md, 2026-11-27).
TILES = Tiles(block_n=128)


def k_splits(out_features: int, in_features: int, tiles: Tiles, sms: int,
             blocksize: int = 64) -> int:
    """The fewest splits of K (a divisor of its count of scale blocks) that give every SM
    `programs_per_sm` programs, or all of them."""
    column_blocks = -(-out_features // tiles.block_n)
    k_tiles = in_features // blocksize
    divisors = [d for d in range(1, k_tiles + 1) if k_tiles % d == 0]
    wanted = tiles.programs_per_sm * sms
    return next((d for d in divisors if column_blocks * d >= wanted), divisors[-1])


def servable(layer) -> bool:
    """Whether a bitsandbytes Linear4bit can take the kernel: NF4, bf16 compute, no bias, the block
    size of 64 the kernel is tested with (bitsandbytes' default), dividing its input width."""
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or state.quant_type != "nf4" or getattr(layer, "bias", None) is not None:
        return False
    in_features = tuple(state.shape)[1]
    return (state.dtype == torch.bfloat16 and state.blocksize == 64
            and in_features % state.blocksize == 0 and weight.is_cuda
            and (not state.nested or state.state2.absmax.dtype == torch.float32))


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

    def scales(self) -> torch.Tensor:
        """The float32 scale of every block in bitsandbytes' order, as it dequantizes them (for
        tests)."""
        codes = self.absmax.t().reshape(-1)
        if self.absmax2 is None:
            return codes
        return (self.code2[codes.long()]
                * self.absmax2.repeat_interleave(self.block2)[:codes.numel()] + self.offset)


def nf4_matmul(x: torch.Tensor, weight: PackedNF4, lora: tuple | None = None,
               tiles: Tiles | None = None) -> torch.Tensor:
    """`x @ W^T (+ s (x A^T) B^T)` for x of at most MAX_ROWS rows (any leading shape), bf16 out.
    `lora` is (A [r, in] float32, B [out, r] float32, s); `tiles` defaults to the module's
    TILES as it is at the call (a benchmark may set it)."""
    tiles = tiles or TILES
    triton, kernel, sum_splits = _kernel()
    out_features, in_features = weight.out_features, weight.in_features
    flat = x.reshape(-1, in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    splits = k_splits(out_features, in_features, tiles, _sm_count(x.device), weight.blocksize)
    parts = torch.empty(splits, rows, out_features, dtype=torch.float32, device=x.device)
    a, b, scaling = lora if lora is not None else (flat, flat, 1.0)
    rank = a.shape[0] if lora is not None else 1
    r_tile = max(16, triton.next_power_of_2(rank))
    xa_parts = torch.empty(splits, rows, r_tile, dtype=torch.float32, device=x.device)
    block_m = max(16, triton.next_power_of_2(rows))
    nested = weight.absmax2 is not None
    use_pdl = tiles.pdl and _hopper(x.device)
    pdl = {"PDL": use_pdl, "launch_pdl": use_pdl}
    kernel[(triton.cdiv(out_features, tiles.block_n), splits)](
        flat, weight.packed, weight.absmax,
        weight.absmax2 if nested else weight.absmax, weight.code2 if nested else weight.absmax,
        float(weight.offset), a, parts, xa_parts, rows, out_features, in_features, rank,
        flat.stride(0), K_SPLIT=in_features // splits, NESTED=nested, BLOCK2=weight.block2,
        HAS_LORA=lora is not None, QBLOCK=weight.blocksize, R=r_tile, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, num_warps=tiles.warps, num_stages=tiles.stages, **pdl,
        **_step_options(tiles, in_features // splits, weight.blocksize))
    out = torch.empty(rows, out_features, dtype=torch.bfloat16, device=x.device)
    sum_rows = min(block_m, tiles.sum_rows)
    sum_splits[(triton.cdiv(out_features, tiles.sum_block_n), triton.cdiv(rows, sum_rows))](
        parts, xa_parts, b, out, rows, out_features, rank, float(scaling), SPLITS=splits,
        HAS_LORA=lora is not None, R=r_tile, BLOCK_M=sum_rows, BLOCK_N=tiles.sum_block_n, **pdl)
    return out.view(*x.shape[:-1], out_features)


def _step_options(tiles: Tiles, k_split: int, blocksize: int) -> dict:
    """The first kernel's adapter chunk and register cap, which apply to programs of several K
    steps only (see Tiles)."""
    if k_split <= blocksize:
        return {"XA_CHUNK": blocksize}
    options = {"XA_CHUNK": min(tiles.xa_chunk, blocksize)}
    if tiles.max_registers is not None:
        options["maxnreg"] = tiles.max_registers
    return options


@torch.library.custom_op("vlmrl::nf4_matmul", mutates_args=())
def nf4_matmul_op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                  absmax2: torch.Tensor | None, code2: torch.Tensor | None, offset: float,
                  block2: int, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                  scaling: float, out_features: int, blocksize: int) -> torch.Tensor:
    """`nf4_matmul` with the module's TILES as one operator, which torch.compile calls as it is
    (it does not trace into the Triton launches) and a CUDA graph captures (with the TILES of
    the capture)."""
    weight = PackedNF4(packed, absmax, out_features, x.shape[-1], blocksize, absmax2, code2,
                       offset, block2)
    return nf4_matmul(x, weight, None if lora_a is None else (lora_a, lora_b, scaling))


@nf4_matmul_op.register_fake
def _(x, packed, absmax, absmax2, code2, offset, block2, lora_a, lora_b, scaling,
      out_features, blocksize):
    return x.new_empty(*x.shape[:-1], out_features)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _hopper(device: torch.device) -> bool:
    """Whether the device has programmatic dependent launch (compute capability 9 or more)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _adapter(module) -> tuple | None:
    """(A, B, s) of a PEFT LoRA layer's one active adapter, None where the kernel can't add it."""
    names = list(module.active_adapters)
    if module.disable_adapters or not names:
        return ()
    if len(names) > 1 or names[0] not in module.lora_A or module.use_dora.get(names[0]):
        return None
    name = names[0]
    dropout = module.lora_dropout[name]
    if module.training and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
        return None
    a, b = module.lora_A[name].weight, module.lora_B[name].weight
    return a, b, module.scaling[name]


class NF4DecodeLinear(torch.nn.Module):
    """An NF4 projection (a bare Linear4bit, or a LoRA layer over one) that decode steps call:
    at most MAX_ROWS bf16 rows go to `nf4_matmul_op` with the layer's weight and active adapter,
    anything else (more rows, other arguments, dropout in training, several adapters) to the
    layer itself."""

    def __init__(self, layer: torch.nn.Module, weight: PackedNF4, bare: bool) -> None:
        super().__init__()
        self.layer = layer
        self.packed = weight
        self.bare = bare

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        lora = () if self.bare else _adapter(self.layer)
        rows = x.numel() // x.shape[-1]
        if lora is None or args or kwargs or rows > MAX_ROWS or x.dtype != torch.bfloat16:
            return self.layer(x, *args, **kwargs)
        a, b, scaling = lora or (None, None, 1.0)
        weight = self.packed
        return torch.ops.vlmrl.nf4_matmul(x, weight.packed, weight.absmax,
                                          weight.absmax2, weight.code2, weight.offset,
                                          weight.block2, a, b, float(scaling),
                                          weight.out_features, weight.blocksize)


def nf4_layers(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(layer, its Linear4bit) for each NF4 projection the kernel serves: LoRA layers over a
    Linear4bit (the pair) and bare Linear4bit layers (the layer twice)."""
    import bitsandbytes as bnb

    wrapped = {module: module.base_layer for module in model.modules()
               if isinstance(getattr(module, "base_layer", None), bnb.nn.Linear4bit)
               and hasattr(module, "lora_A")}
    bases = set(wrapped.values())
    bare = [module for module in model.modules()
            if isinstance(module, bnb.nn.Linear4bit) and module not in bases]
    return [(module, base) for module, base in [*wrapped.items(), *((m, m) for m in bare)]
            if servable(base)]


class NF4Decode:
    """The model's NF4 projections, each put in its parent's place as an `NF4DecodeLinear` while
    `active()` (through `nn.Module.set_submodule`) and put back on exit. The wrappers (and the
    weights' `PackedNF4`, the block scales) are made on first use and kept: the same modules on
    every activation, so torch.compile's guards on them hold and a compiled decode step is traced
    once. `layers` defaults to `nf4_layers(model)`."""

    def __init__(self, model, layers: list | None = None) -> None:
        self.model = model
        self.layers = nf4_layers(model) if layers is None else layers
        self.swaps: list[tuple[str, torch.nn.Module, NF4DecodeLinear]] | None = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _make_swaps(self) -> list[tuple[str, torch.nn.Module, NF4DecodeLinear]]:
        """(path in the model, layer, its wrapper) for every path that reaches a layer."""
        wrappers = {module: NF4DecodeLinear(module, PackedNF4.of(base), module is base)
                    for module, base in self.layers}
        return [(path, module, wrappers[module])
                for path, module in self.model.named_modules(remove_duplicate=False)
                if module in wrappers]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.swaps is None:
            self.swaps = self._make_swaps()
        for path, layer, _ in self.swaps:
            if self.model.get_submodule(path) is not layer:
                raise RuntimeError(f"NF4 decoding: {path} is no longer the layer it wrapped")
        done = []
        try:
            for path, _, wrapper in self.swaps:
                self.model.set_submodule(path, wrapper, strict=True)
                done.append(path)
            yield
        finally:
            originals = {path: layer for path, layer, _ in self.swaps}
            for path in done:
                self.model.set_submodule(path, originals[path], strict=True)
