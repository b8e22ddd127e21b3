"""The training forward and backward of a GSPO step on a GPU wait on the host: each text decoder
layer launches dozens of small kernels from Python (LoRA's scaling and adds, RMSNorm's float32
steps, the rotary embedding, bitsandbytes' dequantisation), so a faster attention kernel barely
moves the step (benchmarks/gspo_step.py, `training_kernels`). Compiled, a layer's element-wise
work is fused and launched from one graph (`train.compile_layers`).

Generation keeps the layers eager: its decode step is compiled and captured as a whole
(vlmrl.training.rollout.graph_decode), with the cache's attention swapped in. A layer is compiled through
its public `forward`, set on the instance over the class's method while the layers are on, and
removed for generation (`CompiledLayers.eager()`) and after training: an instance `forward` is
bound to its own layer, so a copy or pickle of the model made while it is set would run the
original's layers. Each layer gets its own `torch.compile`, and they share dynamo's cache of
traces through the class's `forward` code (a layer's weights are the trace's inputs); shapes are
dynamic from the first call, since each generation batch brings its own prompt length."""

from __future__ import annotations

import contextlib
import gc
import types
from collections.abc import Iterable, Iterator

import torch
from transformers import TrainerCallback

from vlmrl.errors import ParamsError
from vlmrl.training.trainer.nf4_linear import is_nf4_linear, nf4_linear


def text_decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of `model`'s text model (under a PEFT wrapper too), in order."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ParamsError(f"params.yaml train.compile_layers: {type(base).__name__} has no text "
                          "decoder layers to compile (get_decoder().layers); set "
                          "train.compile_layers: false for it")
    return list(layers)


class CompiledLayers:
    """Each of `layers` runs its forward through `torch.compile` (with `backend`) between `on()`
    and `off()`, except inside `eager()`; with `nf4_linears` (`train.nf4_linears`), so do their
    bitsandbytes NF4 projections through `nf4_linear` (each its own `forward` on the instance,
    as the layers)."""

    def __init__(self, layers: Iterable[torch.nn.Module], *, backend: str = "inductor",
                 nf4_linears: bool = False) -> None:
        self.layers = tuple(layers)
        self.compiled = tuple(torch.compile(type(layer).forward.__get__(layer), dynamic=True,
                                            backend=backend) for layer in self.layers)
        self.linears = tuple(module for layer in self.layers for module in layer.modules()
                             if is_nf4_linear(module)) if nf4_linears else ()
        if nf4_linears and not self.linears:
            raise ParamsError("params.yaml train.nf4_linears: true, but the text decoder layers "
                              "have no bitsandbytes NF4 projections (model.load_in_4bit: false?); "
                              "set train.nf4_linears: false for this model")
        # one function bound to each module: dynamo guards a callable made per module by
        # identity, which would fail in every layer and recompile the layers' shared trace
        self.linear_forwards = tuple(types.MethodType(nf4_linear, module)
                                     for module in self.linears)

    def on(self) -> None:
        modules = tuple(zip(self.layers + self.linears, self.compiled + self.linear_forwards,
                            strict=True))
        for module, forward in modules:
            own = vars(module).get("forward")
            if own is not None and own is not forward:
                raise ParamsError(f"params.yaml train.compile_layers: {type(module).__name__} "
                                  "already has a forward of its own on the instance (another "
                                  "trainer's compiled layers, or a hook): set "
                                  "train.compile_layers: false for this model")
        for module, forward in modules:
            module.forward = forward

    def off(self) -> None:
        for layer in self.layers + self.linears:
            vars(layer).pop("forward", None)

    @property
    def compiling(self) -> bool:
        return all(vars(layer).get("forward") is forward
                   for layer, forward in zip(self.layers, self.compiled, strict=True))

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """The class's own forward for every layer while it lasts (re-entrant)."""
        was_on = self.compiling
        self.off()
        try:
            yield
        finally:
            if was_on:
                self.on()


class FrozenHeapAfterFirstStep(TrainerCallback):
    """Python's full garbage collections walk every object the process holds; after the first
    optimizer step those include the compiled graphs' and kernels' (the layers', the decode
    step's), and such a collection is long enough to show inside later steps (the `gc` phase of
    benchmarks/gspo_step.py). After the run's first step (also of a resumed run) the heap is
    collected once and frozen (`gc.freeze`: its objects leave the collector's generations, so
    those of them that become cyclic garbage later wait until the thaw), and thawed when training
    ends, so that a later run in the same process collects them again."""

    def __init__(self) -> None:
        self.frozen = False

    def on_step_end(self, args, state, control, **kwargs):
        if not self.frozen:
            gc.collect()
            gc.freeze()
            self.frozen = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
