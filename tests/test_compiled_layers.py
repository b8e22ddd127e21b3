"""`vlmrl.training.trainer.compiled_layers` on the tiny Qwen3-VL with a LoRA adapter and gradient checkpointing:
the compiled layers give eager's logits and adapter gradients, one trace serves every layer (with
the rolled training attention too: no break in the layer),
`eager()` runs the class's forward, and the GRPO subclass trains with compiled layers and
generates with eager ones."""

from __future__ import annotations

import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_batches import padded_vl_batch, with_completions
from transformers import AutoModelForImageTextToText

from vlmrl.errors import ParamsError
from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.models.processor import load_processor
from vlmrl.training.trainer.compiled_layers import (
    CompiledLayers,
    FrozenHeapAfterFirstStep,
    text_decoder_layers,
)


class CountingBackend:
    """A torch.compile backend that runs dynamo's graph as traced, counting traces and runs."""

    def __init__(self) -> None:
        self.traces = 0
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        self.traces += 1

        def run(*args):
            self.runs += 1
            return graph.forward(*args)

        return run


@pytest.fixture(scope="module")
def tiny_policy():
    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                             target_modules=["q_proj", "v_proj", "gate_proj"]))
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.enable_input_require_grads()
    return model.train(), padded_vl_batch(load_processor(str(path)))


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits
    real = batch["attention_mask"].bool()
    loss = logits[real].float().logsumexp(-1).mean()
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()
             if param.requires_grad}
    return logits.detach(), grads


def test_text_decoder_layers_are_the_text_models_under_peft(tiny_policy) -> None:
    model, _ = tiny_policy
    layers = text_decoder_layers(model)
    assert len(layers) == model.config.text_config.num_hidden_layers >= 2
    assert all(type(layer).__name__ == "Qwen3VLTextDecoderLayer" for layer in layers)
    with pytest.raises(ParamsError, match=r"^params\.yaml train\.compile_layers: Linear has no "
                                          r"text decoder layers"):
        text_decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("attention", ["sdpa", "rolled"])
def test_compiled_layers_give_eagers_logits_and_gradients_from_one_trace(tiny_policy,
                                                                         attention) -> None:
    """Against eager layers with SDPA's padding mask; with the rolled attention
    (`train.training_attention: rolled`) each compiled layer is still one trace, run once per
    call: the rows' runs come from the mask function, not from a host synchronisation inside."""
    from vlmrl.training.rollout.decode_attention import set_text_attention
    from vlmrl.training.trainer.attention import rolled_attention_name

    model, batch = tiny_policy
    layers = text_decoder_layers(model)
    eager_logits, eager_grads = loss_and_grads(model, batch)
    backend = CountingBackend()
    compiled = CompiledLayers(layers, backend=backend)
    tolerance = 1e-5 if attention == "sdpa" else 1e-4  # rolled: another order of the sums
    set_text_attention(model, rolled_attention_name() if attention == "rolled" else "sdpa")
    compiled.on()
    try:
        logits, grads = loss_and_grads(model, batch)
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(logits[real], eager_logits[real], atol=tolerance,
                                   rtol=tolerance)
        assert grads.keys() == eager_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], atol=tolerance, rtol=tolerance,
                                       msg=name)
        # checkpointing runs each layer twice: its forward and its recompute in backward
        assert backend.runs == 2 * len(layers)
        assert backend.traces == 1  # the layers share it: their weights are its inputs
        tail = batch["input_ids"][:, -3:]
        tail_mask = torch.ones_like(tail)
        tail_mask[1] = 0  # the second row's completion stays right-padded: one run a row
        loss_and_grads(model, with_completions(batch, tail, tail_mask))
        assert backend.traces == 1  # dynamic from the first call: another length, no retrace
    finally:
        compiled.off()
        set_text_attention(model, "sdpa")
    assert all("forward" not in vars(layer) for layer in layers)


def test_reentrant_checkpointing_gives_eagers_gradients_with_a_no_grad_trace(tiny_policy) -> None:
    """With `use_reentrant: true` a checkpointed layer's first forward runs without autograd
    (a trace of its own, no saved-tensor hooks) and its backward recomputes it with autograd
    (the other trace): the adapter's gradients are eager's."""
    model, batch = tiny_policy
    layers = text_decoder_layers(model)
    eager_logits, eager_grads = loss_and_grads(model, batch)
    backend = CountingBackend()
    compiled = CompiledLayers(layers, backend=backend)
    model.gradient_checkpointing_enable({"use_reentrant": True})
    compiled.on()
    try:
        logits, grads = loss_and_grads(model, batch)
    finally:
        compiled.off()
        model.gradient_checkpointing_enable({"use_reentrant": False})
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[real], eager_logits[real], atol=1e-5, rtol=1e-5)
    assert grads.keys() == eager_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    first_layer = next(name for name in grads if ".layers.0." in name)
    assert grads[first_layer].abs().sum() > 0  # the inputs' grads reach the first layer
    assert backend.runs == 2 * len(layers)
    assert backend.traces == 2  # without autograd, and with it


def test_eager_runs_the_class_forward_and_restores_the_compiled_one(tiny_policy) -> None:
    model, batch = tiny_policy
    layers = text_decoder_layers(model)
    backend = CountingBackend()
    compiled = CompiledLayers(layers, backend=backend)
    assert not compiled.compiling
    compiled.on()
    try:
        assert compiled.compiling
        with torch.no_grad(), compiled.eager():
            assert not compiled.compiling
            with compiled.eager():
                pass
            assert not compiled.compiling  # re-entered: still eager until the outer one ends
            model(**batch)
        assert backend.runs == 0 and compiled.compiling
        with torch.no_grad():
            model(**batch)
        assert backend.runs == len(layers)
        with pytest.raises(ParamsError, match=r"^params\.yaml train\.compile_layers: "
                                              r"Qwen3VLTextDecoderLayer already has a forward"):
            CompiledLayers(layers, backend=backend).on()  # a second trainer's, say
    finally:
        compiled.off()


def test_the_grpo_subclass_trains_compiled_and_generates_eager(monkeypatch, capsys) -> None:
    from vlmrl.training.trainer import mixins

    layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    monkeypatch.setattr(mixins, "text_decoder_layers", lambda model: layers)
    seen = []

    def installed() -> list[bool]:
        return ["forward" in vars(layer) for layer in layers]

    class Base:
        def __init__(self, *args, **kwargs):
            self.model = object()

        def train(self):
            seen.append(("train", installed()))
            return self._generate_single_turn(1, 2)

        def _generate_single_turn(self, *args, **kwargs):
            seen.append(("generate", installed()))
            return args

    class Trainer(mixins.CompiledTrainingLayers, Base):
        pass

    trainer = Trainer(compile_layers=True)
    assert installed() == [False] * 3  # not before `train`
    assert trainer.train() == (1, 2)
    assert seen == [("train", [True] * 3), ("generate", [False] * 3)]
    assert installed() == [False] * 3  # nor after it
    assert "text decoder layers compiled for training" in capsys.readouterr().out
    untouched = Trainer()
    assert untouched.compiled_layers is None and untouched.train() == (1, 2)
    assert "compiled" not in capsys.readouterr().out


def test_the_heap_is_frozen_after_the_first_step_and_thawed_when_training_ends(monkeypatch) -> None:
    """Frozen once: the frozen count may only fall after it (frozen objects freed by their
    reference counts, as other threads of the test process free theirs), never grow by a second
    freeze."""
    from transformers import TrainerControl, TrainerState

    freezes = []
    freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1) or freeze())
    callback, state, control = FrozenHeapAfterFirstStep(), TrainerState(), TrainerControl()
    assert gc.get_freeze_count() == 0
    try:
        callback.on_train_end(None, state, control)  # nothing frozen: nothing to thaw
        state.global_step = 7  # a resumed run's first step
        callback.on_step_end(None, state, control)
        frozen = gc.get_freeze_count()
        assert frozen > 0
        state.global_step = 8
        callback.on_step_end(None, state, control)
        assert gc.get_freeze_count() <= frozen and len(freezes) == 1
        callback.on_train_end(None, state, control)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
