"""`vlmrl.training.trainer.compiled_layers` on a GPU, on the model with Qwen3-VL-2B's shapes in NF4 with a LoRA
adapter and gradient checkpointing, as train_gspo trains it but computing in float32: with the
text decoder layers compiled by inductor, the loss and every adapter gradient equal eager's
within float32 rounding (in bf16 the rounding of 28 layers' backward moves single gradients by
several percent either way, too much to tell a wrong layer from noise), and a batch of another
length runs without error; the same with the NF4 projections multiplied through
`vlmrl.training.trainer.nf4_linear`, and that product against bitsandbytes' Linear4bit itself in bf16."""

from __future__ import annotations

import pytest
import torch
from test_graph_decode_gpu import inputs, load
from tiny_batches import with_completions

pytestmark = pytest.mark.gpu


def completed(batch: dict, length: int) -> dict:
    """`batch` with `length` completion tokens per row, the last row's right-padded by half."""
    rows = batch["input_ids"].shape[0]
    completion = torch.randint(10, 5000, (rows, length), device="cuda",
                               generator=torch.Generator("cuda").manual_seed(length))
    mask = torch.ones_like(completion)
    mask[-1, length // 2:] = 0
    return with_completions(batch, completion, mask)


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits
    real = batch["attention_mask"].bool()
    loss = logits[real].float().log_softmax(-1).amax(-1).mean()
    loss.backward()
    return loss.detach(), {name: param.grad.float().clone()
                           for name, param in model.named_parameters() if param.requires_grad}


@pytest.mark.parametrize("nf4_linears", [False, True], ids=["bitsandbytes", "nf4-linears"])
def test_compiled_layers_train_within_float32_rounding_of_eager_ones(monkeypatch, nf4_linears):
    """With `nf4_linears` the NF4 projections multiply through `vlmrl.training.trainer.nf4_linear` inside
    the compiled layers, against bitsandbytes' own eager ones."""
    from vlmrl.training.trainer.compiled_layers import CompiledLayers, text_decoder_layers

    model, processor = load(four_bit=True, dtype=torch.float32)
    model.train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.enable_input_require_grads()
    batch = completed(inputs(processor), 96)
    eager_loss, eager_grads = loss_and_grads(model, batch)
    compiled = CompiledLayers(text_decoder_layers(model), nf4_linears=nf4_linears)
    assert len(compiled.linears) == (7 * len(compiled.layers) if nf4_linears else 0)
    compiled.on()
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)  # never eager unseen
    torch._dynamo.utils.counters.clear()
    try:
        loss, grads = loss_and_grads(model, batch)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it compiled
        other_loss, _ = loss_and_grads(model, completed(inputs(processor, 2), 160))
    finally:
        compiled.off()
    assert other_loss.isfinite()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=0.0)
    assert grads.keys() == eager_grads.keys() and grads
    for name in sorted(grads):
        assert cosine(grads[name].flatten(), eager_grads[name].flatten()) > 0.999, name
        assert abs(grads[name].norm() / eager_grads[name].norm() - 1) < 0.01, name


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.mark.parametrize("nested", [False, True])
def test_nf4_linear_is_bitsandbytes_product_in_bf16(nested: bool) -> None:
    """Against bitsandbytes' Linear4bit at a training forward's row count (its Python
    fallback): the same bits without nested scales; with them, bitsandbytes adds the offset in
    a launch of its own, where a fused kernel may round the scale's multiply-add once."""
    import bitsandbytes as bnb

    from vlmrl.training.trainer.nf4_linear import nf4_linear

    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 768, bias=True, dtype=torch.bfloat16)
    layer = bnb.nn.Linear4bit(1024, 768, bias=True, compute_dtype=torch.bfloat16,
                              compress_statistics=nested, quant_type="nf4")
    layer.load_state_dict(dense.state_dict())
    layer = layer.cuda()
    x = torch.randn(4, 700, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ours_x = x.detach().clone().requires_grad_(True)
    theirs, ours = layer(x), nf4_linear(layer, ours_x)
    grad = torch.randn_like(theirs)
    theirs.backward(grad)
    ours.backward(grad)
    tolerance = {"rtol": 0, "atol": 0} if not nested else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(ours, theirs, **tolerance)
    torch.testing.assert_close(ours_x.grad, x.grad, **tolerance)
    compiled = torch.compile(lambda inputs: nf4_linear(layer, inputs), fullgraph=True)
    torch.testing.assert_close(compiled(ours_x.detach()), theirs.detach(),
                               rtol=1e-2, atol=1e-2)
