"""The model's NF4 projections in the decode step: each Linear4bit the kernel serves (with its
LoRA layer) swapped for a module that calls `vlmrl::nf4_matmul`, and the projections a layer
calls on one input in turn (q, k, v; gate, up) computed in one launch, since a decode step's
projections are too small to fill the GPU one by one. Swapped in for the decode step only;
training and scoring run bitsandbytes' and PEFT's own layers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from vlmrl.training.rollout import nf4_decode
from vlmrl.training.rollout.nf4_decode import MAX_ROWS, PackedNF4, adapter_kind, starts_fit

# The projections of one input a decoder layer calls in turn, by name, each set taken as an
# `NF4Group` where a module has them all (Qwen3's attention and MLP; a benchmark may set it)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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
    at most MAX_ROWS bf16 rows go to `nf4_matmul_op` with the layer's weight and active adapter
    (with the rest of its `NF4Group` where it is in one), anything else (more rows, other
    arguments, dropout in training, several adapters) to the layer itself."""

    def __init__(self, layer: torch.nn.Module, weight: PackedNF4, bare: bool) -> None:
        super().__init__()
        self.layer = layer
        self.packed = weight
        self.bare = bare
        self.group: NF4Group | None = None
        self.index = 0

    def adapter(self) -> tuple | None:
        """(A, B, s), () for a bare layer or a disabled adapter, None where the kernel can't
        add it."""
        return () if self.bare else _adapter(self.layer)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        lora = self.adapter()
        rows = x.numel() // x.shape[-1]
        if lora is None or args or kwargs or rows > MAX_ROWS or x.dtype != torch.bfloat16:
            return self.layer(x, *args, **kwargs)
        if self.group is not None:
            return self.group.output(self.index, x)
        return call_nf4_op([self], x, [lora])


def call_nf4_op(members: Sequence[NF4DecodeLinear], x: torch.Tensor,
                loras: Sequence[tuple]) -> torch.Tensor:
    """`vlmrl::nf4_matmul` of these projections (all with an adapter of one scale, or none)."""
    weights = [member.packed for member in members]
    nested = weights[0].absmax2 is not None
    adapted = len(loras[0]) > 0
    return torch.ops.vlmrl.nf4_matmul(
        *nf4_decode.fp16_rows(x, blocksize=weights[0].blocksize), [w.packed for w in weights],
        [w.absmax for w in weights],
        [w.absmax2 for w in weights] if nested else [],
        [w.code2 for w in weights] if nested else [], [float(w.offset) for w in weights],
        weights[0].block2, [lora[0] for lora in loras] if adapted else [],
        [lora[1] for lora in loras] if adapted else [],
        float(loras[0][2]) if adapted else 1.0, [w.out_features for w in weights],
        weights[0].blocksize)


class NF4Group:
    """Projections of one input that a layer calls in turn (q, k, v; gate, up): the first call
    computes all of them in one `vlmrl::nf4_matmul` and keeps the others' outputs for their
    calls with the same input tensor, in any order, until each member has taken its own; a call
    with another input, or where the adapters differ (in rank, dtype or scale, or one the kernel
    can't serve), computes its own. Under torch.compile the kept outputs are traced like any
    Python state, so the step's graph holds one launch per group."""

    def __init__(self, members: Sequence[NF4DecodeLinear]) -> None:
        self.members = list(members)
        self.widths = [member.packed.out_features for member in members]
        # (input, the group's outputs, the members that took theirs)
        self.pending: tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[int, ...]] | None = None
        for index, member in enumerate(members):
            member.group, member.index = self, index

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        pending = self.pending
        if pending is None or pending[0] is not x:
            loras = [member.adapter() for member in self.members]
            kinds = {adapter_kind(lora) for lora in loras}
            if len(kinds) > 1 or None in kinds:
                return call_nf4_op([self.members[index]], x, [loras[index]])
            outputs = torch.split(call_nf4_op(self.members, x, loras), self.widths, dim=-1)
            pending = (x, outputs, ())
        served = pending[2] if index in pending[2] else (*pending[2], index)
        self.pending = None if len(served) == len(self.members) else (x, pending[1], served)
        return pending[1][index]


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
    `active()` (through `nn.Module.set_submodule`) and put back on exit; those a module holds
    under the names of one of `groups` (default GROUPS) in an `NF4Group`. The wrappers (and the
    weights' `PackedNF4`, the block scales) are made on first use and kept: the same modules on
    every activation, so torch.compile's guards on them hold and a compiled decode step is traced
    once. `layers` defaults to `nf4_layers(model)`."""

    def __init__(self, model, layers: list | None = None,
                 groups: Sequence[Sequence[str]] | None = None) -> None:
        self.model = model
        self.layers = nf4_layers(model) if layers is None else layers
        self.group_names = GROUPS if groups is None else groups
        self.swaps: list[tuple[str, torch.nn.Module, NF4DecodeLinear]] | None = None
        self.groups: list[NF4Group] = []

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _grouped(self) -> list[list[torch.nn.Module]]:
        """The served layers a module holds under the names of one group, of one input width
        and kind of block scales, each starting where the module's TILES can split columns."""
        bases = dict(self.layers)
        found, taken = [], set()
        for parent in self.model.modules():
            for names in self.group_names:
                members = [getattr(parent, name, None) for name in names]
                if not all(isinstance(m, torch.nn.Module) and m in bases and m not in taken
                           for m in members) or len(set(members)) < len(members):
                    continue
                states = [bases[m].weight.quant_state for m in members]
                if (len({_scales_kind(state) for state in states}) == 1
                        and starts_fit([int(state.shape[0]) for state in states],
                                       nf4_decode.TILES)):
                    found.append(members)
                    taken.update(members)
        return found

    def _make_swaps(self) -> list[tuple[str, torch.nn.Module, NF4DecodeLinear]]:
        """(path in the model, layer, its wrapper) for every path that reaches a layer."""
        bases = dict(self.layers)
        grouped = self._grouped()
        packs = {}
        for members in grouped:
            packs.update(zip(members, PackedNF4.group([bases[m] for m in members])))
        wrappers = {module: NF4DecodeLinear(module, packs.get(module) or PackedNF4.of(base),
                                            module is base)
                    for module, base in self.layers}
        self.groups = [NF4Group([wrappers[m] for m in members]) for members in grouped]
        return [(path, module, wrappers[module])
                for path, module in self.model.named_modules(remove_duplicate=False)
                if module in wrappers]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The NF4 projections swapped in, each put back on the way out."""
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
            for group in self.groups:  # no outputs kept past the step
                group.pending = None


def _scales_kind(state) -> tuple:
    """What must be alike in a group's quant states: input width, block size, nested scales."""
    return (tuple(state.shape)[1], state.blocksize, state.nested,
            state.state2.blocksize if state.nested else None)
