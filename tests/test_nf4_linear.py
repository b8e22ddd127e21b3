"""`vlmrl.training.trainer.nf4_linear` on a stand-in for bitsandbytes' Linear4bit (its packed codes and
quant state, made up; bitsandbytes itself is GPU-only here and compared on the device by
tests/gpu/test_compiled_layers_gpu.py): the dense weight is the codes times their block scales,
the product and its input gradient are a dense Linear's, it traces into one graph, keeps no dense
weight for the backward; the compiled layers serve the NF4 projections only when asked and never
an adapter's wrapper, in one trace for every layer, and `train.nf4_linears` is refused where it
cannot act."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlmrl.errors import ParamsError
from vlmrl.training.rollout.nf4_codes import NF4_CODES
from vlmrl.training.trainer.compiled_layers import CompiledLayers
from vlmrl.training.trainer.nf4_linear import is_nf4_linear, nf4_linear, nf4_weight


class FakeLinear4bit(torch.nn.Module):
    """What `nf4_linear` reads of a Linear4bit: the packed weight with its quant state, the
    compute dtype and the bias."""

    def __init__(self, out_features: int, in_features: int, nested: bool, seed: int,
                 bias: bool = False) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        blocks = out_features * in_features // 64
        packed = torch.randint(0, 256, (out_features * in_features // 2, 1), dtype=torch.uint8,
                               generator=generator)
        code = torch.tensor(NF4_CODES, dtype=torch.float32)
        if nested:
            codes = torch.randint(0, 256, (blocks,), dtype=torch.uint8, generator=generator)
            code2 = torch.sort(torch.rand(256, generator=generator)).values
            absmax2 = torch.rand(-(-blocks // 256), generator=generator) * 0.1
            offset = torch.tensor(0.01)
            self.scales = code2[codes.long()] * absmax2.repeat_interleave(256)[:blocks] + offset
            state2 = SimpleNamespace(absmax=absmax2, code=code2, blocksize=256)
            state = SimpleNamespace(absmax=codes, code=code, blocksize=64, quant_type="nf4",
                                    shape=torch.Size([out_features, in_features]), nested=True,
                                    state2=state2, offset=offset)
        else:
            self.scales = torch.rand(blocks, generator=generator) * 0.1
            state = SimpleNamespace(absmax=self.scales, code=code, blocksize=64,
                                    quant_type="nf4", nested=False, state2=None, offset=None,
                                    shape=torch.Size([out_features, in_features]))
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.weight.quant_state = state
        self.compute_dtype = torch.bfloat16
        self.bias = (torch.nn.Parameter(torch.randn(out_features, generator=generator))
                     if bias else None)

    def dense(self) -> torch.Tensor:
        """The weight by the codes' definition: each nibble's NF4 value times its block's scale
        (float32 products, one rounding to bfloat16)."""
        flat = self.weight.reshape(-1).long()
        code = torch.tensor(NF4_CODES, dtype=torch.float32)
        values = torch.stack([code[flat // 16], code[flat % 16]], dim=1).reshape(-1, 64)
        shape = self.weight.quant_state.shape
        return (values * self.scales[:, None]).to(torch.bfloat16).reshape(shape)


@pytest.mark.parametrize("nested", [False, True])
def test_the_weight_is_each_code_times_its_block_scale(nested: bool) -> None:
    layer = FakeLinear4bit(8, 128, nested, seed=1)
    state = layer.weight.quant_state
    nested_state = state.state2
    weight = nf4_weight(layer.weight, state.absmax, state.code,
                        nested_state.absmax if nested else None,
                        nested_state.code if nested else None, state.offset,
                        (64, tuple(state.shape), 256 if nested else 0), torch.bfloat16)
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, layer.dense())


@pytest.mark.parametrize(("nested", "bias"), [(False, True), (True, False)])
def test_the_product_and_its_input_gradient_are_a_dense_linears(nested: bool, bias: bool):
    layer = FakeLinear4bit(16, 192, nested, seed=2, bias=bias)
    x = torch.randn(3, 5, 192, dtype=torch.float32, requires_grad=True)
    dense_x = x.detach().clone().requires_grad_(True)
    out = nf4_linear(layer, x)
    expected = torch.nn.functional.linear(
        dense_x.to(torch.bfloat16), layer.dense(),
        None if layer.bias is None else layer.bias.to(torch.bfloat16)).float()
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(x.grad, dense_x.grad)


def test_it_traces_into_one_graph_and_keeps_no_dense_weight_for_the_backward() -> None:
    layer = FakeLinear4bit(32, 256, True, seed=3)
    x = torch.randn(4, 256, requires_grad=True)
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        eager = nf4_linear(layer, x)
    assert saved and max(saved) < 32 * 256  # the packed bytes (half of that), no dense weight
    compiled = torch.compile(lambda inputs: nf4_linear(layer, inputs), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)


class ToyLayer(torch.nn.Module):
    """A decoder layer's stand-in: one NF4 projection, one adapter-like wrapper around another
    (a module with children, as PEFT's), one plain Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = FakeLinear4bit(64, 64, False, seed=4)
        self.v_proj = torch.nn.Module()
        self.v_proj.base_layer = FakeLinear4bit(64, 64, False, seed=5)
        self.v_proj.weight = self.v_proj.base_layer.weight
        self.v_proj.compute_dtype = torch.bfloat16
        self.o_proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.o_proj(self.q_proj(x))


@pytest.mark.parametrize("served", [False, True])
def test_compiled_layers_serve_the_nf4_projections_only_when_asked(served: bool) -> None:
    layer = ToyLayer()
    assert [is_nf4_linear(m) for m in (layer.q_proj, layer.v_proj, layer.v_proj.base_layer,
                                       layer.o_proj)] == [True, False, True, False]
    compiled = CompiledLayers([layer], backend="eager", nf4_linears=served)
    assert compiled.linears == ((layer.q_proj, layer.v_proj.base_layer) if served else ())
    compiled.on()
    try:
        assert ("forward" in vars(layer.q_proj)) is served
        assert "forward" not in vars(layer.v_proj) and "forward" not in vars(layer.o_proj)
        with compiled.eager():
            assert "forward" not in vars(layer.q_proj)
        assert ("forward" in vars(layer.q_proj)) is served
        x = torch.randn(2, 64)
        if served:
            expected = layer.o_proj(nf4_linear(layer.q_proj, x))
            torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    finally:
        compiled.off()
    assert all("forward" not in vars(m) for m in layer.modules())


def test_a_projection_with_a_forward_of_its_own_is_refused_by_the_param() -> None:
    layer = ToyLayer()
    layer.q_proj.forward = lambda x: x  # another wrapper's, set on the instance
    compiled = CompiledLayers([layer], backend="eager", nf4_linears=True)
    with pytest.raises(ParamsError, match=r"^params\.yaml train\.compile_layers: FakeLinear4bit "
                                          r"already has a forward of its own"):
        compiled.on()
    assert "forward" not in vars(layer)


def test_layers_serving_nf4_projections_share_one_trace() -> None:
    """Each projection's forward is one function bound to its module, so dynamo's guards hold
    for every layer: a callable made per module is guarded by identity, and each layer would
    recompile the class's forward until dynamo's recompile limit left the rest eager."""
    from torch._dynamo.utils import counters

    layers = [ToyLayer() for _ in range(12)]
    compiled = CompiledLayers(layers, backend="aot_eager", nf4_linears=True)
    torch._dynamo.reset()
    counters.clear()
    compiled.on()
    try:
        for length in (3, 5):
            hidden = torch.randn(length, 64, requires_grad=True)
            for layer in layers:
                hidden = layer(hidden)
            hidden.sum().backward()
    finally:
        compiled.off()
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1


def test_the_param_needs_compiled_layers_and_nf4_projections() -> None:
    from vlmrl.training.gspo import make_trainer

    with pytest.raises(ParamsError, match=r"^params\.yaml train\.nf4_linears: true needs "
                                          r"train\.compile_layers: true"):
        make_trainer(None, None, None, None, [], generation_rows=None, callbacks=[],
                     nf4_linears=True)
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ParamsError, match=r"^params\.yaml train\.nf4_linears: true, but the text "
                                          r"decoder layers have no bitsandbytes NF4 projections"):
        CompiledLayers([dense], backend="eager", nf4_linears=True)
    assert CompiledLayers([dense], backend="eager").linears == ()
