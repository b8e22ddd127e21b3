"""`vlmrl.training.rollout.nf4_decode` on the CPU: how K is split over the SMs, when the kernel is taken,
the code lookup's PTX (run by a small interpreter of its instructions), and the kernels under
Triton's interpreter with the lookup by selects. Speed and the real lookup on a GPU:
tests/gpu/test_graph_decode_gpu.py."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vlmrl.training.rollout.nf4_decode import TILES, Tiles, k_splits, kernel_available, step_blocks
from vlmrl.training.rollout.nf4_projections import servable


@pytest.mark.parametrize(("out_features", "in_features"),
                         [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144), (12288, 4096)])
def test_k_splits_divide_k_and_fill_the_sms(out_features, in_features):
    sms = 132
    splits = k_splits(out_features, in_features, TILES, sms)
    # bitsandbytes' block size of 64, step_blocks of them a K step
    k_steps = in_features // (64 * step_blocks(in_features, TILES))
    assert k_steps % splits == 0
    programs = -(-out_features // TILES.block_n) * splits
    assert programs >= TILES.programs_per_sm * sms or splits == k_steps
    if splits > 1:  # the fewest such splits: one fewer divisor would not fill the SMs
        smaller = max(d for d in range(1, splits) if k_steps % d == 0)
        assert -(-out_features // TILES.block_n) * smaller < TILES.programs_per_sm * sms


def test_one_split_when_the_columns_alone_fill_the_sms():
    assert k_splits(65536, 2048, Tiles(block_n=64), sms=132) == 1


@pytest.mark.parametrize("field", ["block_n", "sum_block_n", "sum_rows", "xa_chunk", "k_blocks"])
def test_tiles_that_are_not_powers_of_two_are_refused_by_name(field) -> None:
    with pytest.raises(ValueError, match=f"Tiles.{field} is 24"):
        Tiles(**{field: 24})


def test_partial_sums_of_another_type_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Tiles.partials is 'float16'"):
        Tiles(partials="float16")


def test_an_adapter_chunk_below_tl_dots_k_is_refused() -> None:
    with pytest.raises(ValueError, match="Tiles.xa_chunk is 8"):
        Tiles(xa_chunk=8)


def test_no_kernel_without_cuda_or_for_a_plain_linear():
    if not torch.cuda.is_available():
        assert not kernel_available()
    assert not servable(torch.nn.Linear(256, 256, bias=False))  # no quant_state


class TwoProjections(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def with_quant_state(layer: torch.nn.Linear) -> torch.nn.Linear:
    """A plain Linear posing as a Linear4bit to `PackedNF4.of`: its weight carries the quant state
    (shape, block size, block scales) that the kernel's operator receives."""
    out_features, in_features = layer.weight.shape
    layer.weight.quant_state = SimpleNamespace(
        shape=(out_features, in_features), blocksize=64, nested=False,
        absmax=torch.rand(out_features * in_features // 64))
    return layer


@pytest.fixture
def lora_model(monkeypatch):
    """`up` under a real PEFT LoRA layer, `down` bare; the kernel (CUDA only) replaced by a fake
    that records what the operator passes it and returns zeros."""
    from peft import LoraConfig, get_peft_model

    from vlmrl.training.rollout import nf4_decode
    from vlmrl.training.rollout.nf4_projections import NF4Decode

    torch.manual_seed(0)
    model = get_peft_model(TwoProjections(), LoraConfig(r=4, lora_alpha=8, target_modules=["up"]))
    model = model.to(torch.bfloat16).eval()
    lora_up = model.get_submodule("base_model.model.up")
    down = model.get_submodule("base_model.model.down")
    layers = [(lora_up, with_quant_state(lora_up.base_layer)), (down, with_quant_state(down))]
    calls = []

    def fake_kernel(x, row_up, weights, loras=None, tiles=None):
        calls.extend((w.out_features, lora) for w, lora in zip(weights, loras or [None]))
        return torch.zeros(*x.shape[:-1], sum(w.out_features for w in weights),
                           dtype=torch.bfloat16)

    monkeypatch.setattr(nf4_decode, "nf4_rows_matmul", fake_kernel)
    return model, NF4Decode(model, layers), calls


def test_active_puts_wrappers_in_the_layers_places_and_restores_them(lora_model):
    from vlmrl.training.rollout.nf4_projections import NF4DecodeLinear

    model, nf4, calls = lora_model
    paths = ("base_model.model.up", "base_model.model.down")
    originals = [model.get_submodule(path) for path in paths]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        for _ in range(2):
            with nf4.active():
                wrappers = [model.get_submodule(path) for path in paths]
                assert all(isinstance(w, NF4DecodeLinear) for w in wrappers)
                assert [w.layer for w in wrappers] == originals
                assert torch.equal(model(x), torch.zeros_like(expected))  # both by the kernel
            assert [model.get_submodule(path) for path in paths] == originals
            assert torch.equal(model(x), expected)
    assert nf4.swaps is not None and [w for _, _, w in nf4.swaps] == wrappers  # kept, reused
    lora_up = originals[0]
    a, b, s = lora_up.lora_A["default"].weight, lora_up.lora_B["default"].weight, \
        lora_up.scaling["default"]
    assert len(calls) == 4
    for out_features, lora in calls[0::2]:
        assert out_features == 128 and torch.equal(lora[0], a) and torch.equal(lora[1], b)
        assert lora[2] == s
    assert [(o, lora) for o, lora in calls[1::2]] == [(64, None)] * 2


def test_what_the_kernel_does_not_serve_goes_to_the_layer(lora_model):
    model, nf4, calls = lora_model
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        many_rows = torch.randn(65, 64, dtype=torch.bfloat16)  # more than MAX_ROWS: a prefill
        expected = model(many_rows)
        with nf4.active():
            got = model(many_rows)
        assert torch.equal(got, expected) and calls == []
        model.get_submodule("base_model.model.up").lora_dropout["default"] = torch.nn.Dropout(0.5)
        model.eval()
        with nf4.active():
            model(x)
        assert [lora is None for _, lora in calls] == [False, True]
        model.train()
        calls.clear()
        with nf4.active():
            model.get_submodule("base_model.model.up")(x)  # dropout in training: PEFT's forward
        assert calls == []


def test_active_restores_the_layers_when_the_step_fails(lora_model):
    model, nf4, _ = lora_model
    up = model.get_submodule("base_model.model.up")
    with pytest.raises(RuntimeError, match="step failed"), nf4.active():
        raise RuntimeError("step failed")
    assert model.get_submodule("base_model.model.up") is up


def run_ptx(asm: str, registers: dict[str, int]) -> dict[str, int]:
    """The straight-line b32 PTX the NF4 lookup uses (mov, and, or, shr, prmt), run on Python
    ints: `prmt.b32 d, a, b, c` puts in byte i of d the byte of (b:a) that selector nibble i of c
    picks, its sign replicated where the nibble's top bit is set (PTX ISA, prmt, default mode)."""
    registers = dict(registers)

    def value(operand: str) -> int:
        return registers[operand] if operand in registers else int(operand, 0)

    for line in asm.strip("{}\n").splitlines():
        op, _, operands = line.rstrip(";").partition(" ")
        if op.startswith(".reg"):
            continue
        out, *args = [part.strip() for part in operands.split(",")]
        a, *rest = [value(arg) for arg in args]
        if op == "mov.b32":
            result = a
        elif op == "and.b32":
            result = a & rest[0]
        elif op == "or.b32":
            result = a | rest[0]
        elif op == "shr.b32":
            result = a >> rest[0]
        elif op == "prmt.b32":
            source, selector = a | rest[0] << 32, rest[1]
            result = 0
            for i in range(4):
                nibble = selector >> 4 * i & 0xF
                byte = source >> 8 * (nibble & 7) & 0xFF
                if nibble & 8:
                    byte = 0xFF if byte & 0x80 else 0
                result |= byte << 8 * i
        else:
            raise AssertionError(f"unexpected instruction {line!r}")
        registers[out] = result & 0xFFFFFFFF
    return registers


def test_the_nf4_lookup_gives_every_bytes_two_fp16_values():
    """Every byte value in each of the four places of the packed word: the high nibble's NF4 value
    lands in the first output's fp16 of that place, the low nibble's in the second's."""
    from vlmrl.training.rollout.nf4_codes import NF4_CODES, nf4_lookup_asm

    asm = nf4_lookup_asm()
    fp16_bits = [int(v) & 0xFFFF for v in
                 torch.tensor(NF4_CODES, dtype=torch.float16).view(torch.int16)]
    generator = torch.Generator().manual_seed(0)
    for place in range(4):
        for byte in range(256):
            others = torch.randint(0, 256, (4,), generator=generator).tolist()
            others[place] = byte
            word = sum(b << 8 * i for i, b in enumerate(others))
            out = run_ptx(asm, {"$4": word})
            high = (out["$0"] | out["$1"] << 32) >> 16 * place & 0xFFFF
            low = (out["$2"] | out["$3"] << 32) >> 16 * place & 0xFFFF
            assert (high, low) == (fp16_bits[byte >> 4], fp16_bits[byte & 0xF]), (place, byte)



def random_nf4(out_features: int, in_features: int, nested: bool, generator: torch.Generator,
               offset: float = 0.01):
    """A PackedNF4 of random codes and block scales, and its float64 dense weight."""
    from vlmrl.training.rollout.nf4_codes import NF4_CODES
    from vlmrl.training.rollout.nf4_decode import PackedNF4

    blocks = out_features * in_features // 64
    packed = torch.randint(0, 256, (out_features * in_features // 2, 1), dtype=torch.uint8,
                           generator=generator)
    if nested:
        codes = torch.randint(0, 256, (blocks,), dtype=torch.uint8, generator=generator)
        code2 = torch.sort(torch.rand(256, generator=generator)).values
        absmax2 = torch.rand(-(-blocks // 256), generator=generator) * 0.1
        scales = code2[codes.long()] * absmax2.repeat_interleave(256)[:blocks] + offset
        by_k_tile = codes.view(out_features, -1).t().contiguous()
        weight = PackedNF4(packed, by_k_tile, out_features, in_features, 64, absmax2, code2,
                           offset)
    else:
        scales = torch.rand(blocks, generator=generator) * 0.1
        weight = PackedNF4(packed, scales.view(out_features, -1).t().contiguous(), out_features,
                           in_features, 64)
    assert torch.equal(weight.scales(), scales)  # bitsandbytes' order back from K-tile-major
    codes_of = torch.tensor(NF4_CODES, dtype=torch.float64)
    flat = packed.view(-1).long()
    values = torch.stack([codes_of[flat >> 4], codes_of[flat & 15]], 1).reshape(-1, 64)
    return weight, (values * scales.double()[:, None]).reshape(out_features, in_features)


@pytest.mark.parametrize(("rows", "out_features", "in_features", "nested", "lora", "tiles",
                          "row_scales"), [
    (3, 128, 256, True, True, Tiles(block_n=64, programs_per_sm=1), {0: 2.0 ** 17, 2: 2.0 ** -20}),
    (17, 192, 128, False, False, Tiles(block_n=64, programs_per_sm=8), {5: 2.0 ** -30, 6: 0.0}),
    (32, 256, 256, True, False, TILES, {1: 2.0 ** 40}),
    (19, 192, 768, True, True, Tiles(block_n=64, programs_per_sm=2, sum_block_n=32, sum_rows=16),
     {4: 2.0 ** -20}),
    # 5 steps a split, where columns' nested scales change block of 256 inside a split;
    # the sum in tiles of 8 rows, x A^T in products of 16 columns
    (19, 192, 640, True, True, Tiles(block_n=64, programs_per_sm=1, sum_rows=8, xa_chunk=16),
     {4: 2.0 ** -20}),
    # float32 scales over 4 steps, no adapter
    (5, 128, 512, False, False, Tiles(block_n=64, programs_per_sm=1, pdl=True), {1: 2.0 ** 20}),
    # the partial sums in float32 between the launches on the shipped tiles; in bfloat16 (as
    # shipped) over 6 splits
    (32, 256, 256, True, True, dataclasses.replace(TILES, partials="float32"), {1: 2.0 ** 40}),
    (19, 192, 768, True, True, Tiles(block_n=64, programs_per_sm=2, partials="bfloat16"),
     {4: 2.0 ** -20})])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # the interpreter's word for an unmasked read
def test_the_kernel_matches_a_float64_product_under_the_interpreter(
        interpreted_kernel, rows, out_features, in_features, nested, lora, tiles, row_scales):
    """The whole kernel (scale codes read K tile by K tile and one step ahead, x's rows scaled
    into fp16 and back, the transposed product, the splits' sum in row blocks, the adapter)
    against float64 row by row, for column counts that are not a multiple of the tile, rows far
    above and below fp16's range and a row of zeros; the interpreter rounds bf16 by truncation,
    hence 2e-2 of a row's largest value."""
    weight, x, adapter, expected = product_case(rows, out_features, in_features, nested, lora,
                                                row_scales)
    got = interpreted_kernel.nf4_matmul(x, weight, adapter, tiles).double()
    assert largest_row_error(got, expected) < 2e-2


def product_case(rows: int, out_features: int, in_features: int, nested: bool, lora: bool,
                 row_scales: dict[int, float]):
    """(weight, x, adapter or None, float64 x W^T + s (x A^T) B^T) of random NF4 codes and scales,
    x's rows scaled by `row_scales`."""
    generator = torch.Generator().manual_seed(rows)
    weight, dense = random_nf4(out_features, in_features, nested, generator)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    for row, scale in row_scales.items():
        x[row] *= scale
    expected = x.double() @ dense.t()
    adapter = None
    if lora:
        a = torch.randn(16, in_features, generator=generator) * 0.05
        b = torch.randn(out_features, 16, generator=generator) * 0.05
        expected += 0.5 * (x.double() @ a.double().t()) @ b.double().t()
        adapter = (a, b, 0.5)
    return weight, x, adapter, expected


def largest_row_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error of a row over that row's largest expected value; rows of 0 must be 0."""
    worst = 0.0
    for row in range(expected.shape[0]):
        largest = expected[row].abs().max()
        if largest == 0:
            assert torch.equal(got[row], expected[row]), row
        else:
            worst = max(worst, ((got[row] - expected[row]).abs().max() / largest).item())
    return worst


@pytest.mark.parametrize(("widths", "in_features", "nested", "lora", "tiles", "one_launch"), [
    # q, k, v: three projections, several K steps a split
    ((128, 64, 64), 256, True, True, Tiles(block_n=64, programs_per_sm=1), True),
    # gate, up: two, one K step a split, float32 scales
    ((192, 192), 128, False, True, Tiles(block_n=64, programs_per_sm=8, sum_block_n=32), True),
    ((128, 64, 64), 128, True, False, Tiles(block_n=64, programs_per_sm=2), True),
    # the second starts inside a column tile: one launch per projection
    ((96, 64), 128, True, True, Tiles(block_n=64, programs_per_sm=2), False)])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_group_matches_float64_products_of_its_projections_under_the_interpreter(
        interpreted_kernel, widths, in_features, nested, lora, tiles, one_launch):
    """Several projections of one input in one launch, each with its own weight, nested scales
    (their own code book, scales and offset) and adapter, against float64 projection by
    projection."""
    generator = torch.Generator().manual_seed(len(widths) + in_features)
    members = [random_nf4(width, in_features, nested, generator, offset=0.01 * (index + 1))
               for index, width in enumerate(widths)]
    weights = interpreted_kernel.side_by_side([weight for weight, _ in members])
    x = torch.randn(7, in_features, generator=generator).to(torch.bfloat16)
    x[2] *= 2.0 ** 17
    loras = [(torch.randn(16, in_features, generator=generator) * 0.05,
              torch.randn(width, 16, generator=generator) * 0.05, 0.5)
             for width in widths] if lora else None
    assert interpreted_kernel.groupable(weights, loras, tiles) == one_launch
    apart = pytest.warns(UserWarning, match="one launch each")
    with contextlib.nullcontext() if one_launch else apart:
        got = interpreted_kernel.nf4_group_matmul(x, weights, loras, tiles).double()
    assert got.shape == (7, sum(widths))
    start = 0
    for index, ((_, dense), width) in enumerate(zip(members, widths)):
        expected = x.double() @ dense.t()
        if lora:
            a, b, scaling = loras[index]
            expected += scaling * (x.double() @ a.double().t()) @ b.double().t()
        part = got[:, start:start + width]
        for row in range(7):
            assert (part[row] - expected[row]).abs().max() < 2e-2 * expected[row].abs().max(), \
                (index, row)
        start += width


class Attention(torch.nn.Module):
    """q, k and v of one input, as a decoder layer calls them (`order`: the order of the
    calls)."""

    def __init__(self, widths: tuple[int, int, int] = (256, 128, 128),
                 order: str = "qkv") -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, width, bias=False)
                                                 for width in widths)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = {name: getattr(self, f"{name}_proj")(x) for name in self.order}
        return torch.cat([out["q"], 2 * out["k"], 3 * out["v"]], dim=-1)


def grouped_model(monkeypatch, **attention):
    """q, k, v under PEFT LoRA layers; the kernel replaced by a fake that records the widths of
    each call and returns each column's index."""
    from peft import LoraConfig, get_peft_model

    from vlmrl.training.rollout import nf4_decode
    from vlmrl.training.rollout.nf4_projections import NF4Decode

    torch.manual_seed(0)
    model = get_peft_model(Attention(**attention), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]))
    model = model.to(torch.bfloat16).eval()
    layers = [model.get_submodule(f"base_model.model.{name}")
              for name in ("q_proj", "k_proj", "v_proj")]
    layers = [(layer, with_quant_state(layer.base_layer)) for layer in layers]
    calls = []

    def fake_kernel(x, row_up, weights, loras=None, tiles=None):
        calls.append(tuple(w.out_features for w in weights))
        width = sum(w.out_features for w in weights)
        return (torch.arange(width) + 0 * x[..., :1]).to(torch.bfloat16)

    monkeypatch.setattr(nf4_decode, "nf4_rows_matmul", fake_kernel)
    return model, NF4Decode(model, layers), calls


def grouped_output(rows: int) -> torch.Tensor:
    """What `Attention` gives when q, k and v come from one call of the fake kernel."""
    columns = torch.arange(512).to(torch.bfloat16)
    return torch.cat([columns[:256], 2 * columns[256:384], 3 * columns[384:]]).expand(rows, -1)


@pytest.mark.parametrize("order", ["qkv", "vqk"])
def test_a_group_is_one_call_and_each_projection_gets_its_columns(monkeypatch, order):
    model, nf4, calls = grouped_model(monkeypatch, order=order)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad(), nf4.active():
        got = model(x)
        assert [group.widths for group in nf4.groups] == [[256, 128, 128]]
        assert nf4.groups[0].pending is None  # each member took its output
        model.get_submodule("base_model.model.q_proj")(x)
        assert nf4.groups[0].pending is not None
    assert nf4.groups[0].pending is None  # nothing kept past the step
    assert calls == [(256, 128, 128)] * 2
    assert torch.equal(got, grouped_output(3))


def test_a_compiled_step_makes_one_call_per_group_and_compiles_once(monkeypatch):
    model, nf4, calls = grouped_model(monkeypatch)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # no graph break
    with (torch.no_grad(), nf4.active(),
          torch._dynamo.config.patch(error_on_recompile=True)):
        for _ in range(3):
            got = compiled(x)
    assert calls == [(256, 128, 128)] * 3
    assert torch.equal(got, grouped_output(2))


def test_a_projection_the_kernel_cannot_serve_splits_the_group(monkeypatch):
    model, nf4, calls = grouped_model(monkeypatch)
    k_proj = model.get_submodule("base_model.model.k_proj")
    k_proj.lora_dropout["default"] = torch.nn.Dropout(0.5)  # in training: PEFT's forward
    model.train()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad(), nf4.active():
        got = model(x)
    assert calls == [(256,), (128,)]  # q and v one by one, k by its layer
    assert torch.equal(got[:, 256:384], 2 * k_proj(x))


def test_adapters_of_another_rank_or_scale_split_the_group(monkeypatch):
    model, nf4, calls = grouped_model(monkeypatch)
    model.get_submodule("base_model.model.v_proj").scaling["default"] = 0.5
    with torch.no_grad(), nf4.active():
        model(torch.randn(3, 64, dtype=torch.bfloat16))
    assert calls == [(256,), (128,), (128,)]


def test_projections_that_start_inside_a_column_tile_are_not_grouped(monkeypatch):
    model, nf4, calls = grouped_model(monkeypatch, widths=(128, 64, 64))  # TILES: 128 columns
    with torch.no_grad(), nf4.active():
        model(torch.randn(3, 64, dtype=torch.bfloat16))
    assert nf4.groups == [] and calls == [(128,), (64,), (64,)]


def packed_group(widths: list[int], generator: torch.Generator) -> list:
    return [random_nf4(width, 128, True, generator)[0] for width in widths]


def test_groupable_asks_for_adjacent_codes_alike_adapters_and_whole_tiles():
    from vlmrl.training.rollout.nf4_decode import groupable, side_by_side

    generator = torch.Generator().manual_seed(0)
    tiles = Tiles(block_n=64)
    weights = side_by_side(packed_group([128, 64, 64], generator))

    def adapters(ranks=(16, 16, 16), scales=(2.0, 2.0, 2.0), dtype=torch.float32):
        return [(torch.zeros(r, 128, dtype=dtype), torch.zeros(w.out_features, r), s)
                for r, s, w in zip(ranks, scales, weights)]

    assert groupable(weights, adapters(), tiles) and groupable(weights, None, tiles)
    assert not groupable(weights, adapters(ranks=(16, 8, 16)), tiles)
    assert not groupable(weights, adapters(scales=(2.0, 2.0, 1.0)), tiles)
    mixed = adapters()
    mixed[1] = (mixed[1][0].to(torch.bfloat16), *mixed[1][1:])
    assert not groupable(weights, mixed, tiles)
    assert not groupable(packed_group([128, 64, 64], generator), None, tiles)  # codes apart
    assert not groupable(weights, None, Tiles(block_n=128))  # k starts inside a column tile
    assert not groupable(weights, None, Tiles(block_n=64, sum_block_n=128))  # or a sum tile
    four = side_by_side(packed_group([64, 64, 64, 64], generator))
    assert not groupable(four, None, tiles)
