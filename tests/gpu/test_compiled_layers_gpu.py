"""`vlmrl.compiled_layers` on a GPU, on the model with Qwen3-VL-2B's shapes in NF4 with a LoRA
adapter and gradient checkpointing, as train_gspo trains it: with the text decoder layers
compiled by inductor, the loss and the adapter's gradients stay within bf16 rounding of eager
ones (all of them together, and each within looser bounds: the rounding compounds over 28
layers), and a batch of another length runs without error."""

from __future__ import annotations

import pytest
import torch
from test_graph_decode_gpu import inputs, load

pytestmark = pytest.mark.gpu


def with_completions(batch: dict, length: int) -> dict:
    """`batch` with `length` completion tokens per row, the last row's right-padded by half."""
    rows = batch["input_ids"].shape[0]
    completion = torch.randint(10, 5000, (rows, length), device="cuda",
                               generator=torch.Generator("cuda").manual_seed(length))
    mask = torch.ones_like(completion)
    mask[-1, length // 2:] = 0
    longer = {**batch, "input_ids": torch.cat([batch["input_ids"], completion], 1),
              "attention_mask": torch.cat([batch["attention_mask"], mask], 1)}
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in batch:
            longer[key] = torch.cat([batch[key], torch.zeros_like(completion)], 1)
    return longer


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits
    real = batch["attention_mask"].bool()
    loss = logits[real].float().log_softmax(-1).amax(-1).mean()
    loss.backward()
    return loss.detach(), {name: param.grad.float().clone()
                           for name, param in model.named_parameters() if param.requires_grad}


def test_compiled_layers_train_within_bf16_rounding_of_eager_ones():
    from vlmrl.compiled_layers import CompiledLayers, text_decoder_layers

    model, processor = load(four_bit=True)
    model.train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.enable_input_require_grads()
    batch = with_completions(inputs(processor), 96)
    eager_loss, eager_grads = loss_and_grads(model, batch)
    compiled = CompiledLayers(text_decoder_layers(model))
    try:
        loss, grads = loss_and_grads(model, batch)
        other_loss, _ = loss_and_grads(model, with_completions(inputs(processor, 2), 160))
    finally:
        compiled.off()
    assert other_loss.isfinite()
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=0.0)
    assert grads.keys() == eager_grads.keys() and grads
    names = sorted(grads)
    whole = cosine(torch.cat([grads[n].flatten() for n in names]),
                   torch.cat([eager_grads[n].flatten() for n in names]))
    assert whole > 0.99, whole
    for name in names:  # bf16 rounding moves each a little; a wrong layer moves one far
        assert cosine(grads[name].flatten(), eager_grads[name].flatten()) > 0.95, name
        assert abs(grads[name].norm() / eager_grads[name].norm() - 1) < 0.1, name


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()
