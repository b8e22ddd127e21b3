"""`vlmrl.compiled_layers` on a GPU, on the model with Qwen3-VL-2B's shapes in NF4 with a LoRA
adapter and gradient checkpointing, as train_gspo trains it but computing in float32: with the
text decoder layers compiled by inductor, the loss and every adapter gradient equal eager's
within float32 rounding (in bf16 the rounding of 28 layers' backward moves single gradients by
several percent either way, too much to tell a wrong layer from noise), and a batch of another
length runs without error."""

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


def test_compiled_layers_train_within_float32_rounding_of_eager_ones(monkeypatch):
    from vlmrl.compiled_layers import CompiledLayers, text_decoder_layers

    model, processor = load(four_bit=True, dtype=torch.float32)
    model.train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.enable_input_require_grads()
    batch = completed(inputs(processor), 96)
    eager_loss, eager_grads = loss_and_grads(model, batch)
    compiled = CompiledLayers(text_decoder_layers(model))
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
