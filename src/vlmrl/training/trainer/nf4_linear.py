"""bitsandbytes' 4-bit Linear multiplies through its `gemm_4bit` operator, which sends the
training forward's row counts to a fallback in Python (dequantise the weight, then a plain matrix
product), once per projection and pass: inside a compiled layer an opaque call with several
launches and its Python on the host, which the 2B training micro-batches wait on. `nf4_linear`
is the same product in torch operations that torch.compile fuses into the layer's graph: the
weight dequantised as bitsandbytes dequantises it (nested scales undone in float32, each NF4
value times its block's scale in float32, rounded to the compute dtype), and kept by neither
pass: the backward dequantises it again, as bitsandbytes' does, so a layer holds no dense weight
between its forward and its backward."""

from __future__ import annotations

import torch


def nf4_weight(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
               absmax2: torch.Tensor | None, code2: torch.Tensor | None,
               offset: torch.Tensor | None, layout: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight in `dtype` of bitsandbytes' packed NF4 `packed` (two codes a
    byte, the first in the high nibble, row-major), its block scales `absmax` (float32, or with
    nested quantization 8-bit codes that `code2`, `absmax2` per `block2` blocks and `offset`
    undo) and its code book `code`; `layout` is (blocksize, (out, in), block2)."""
    blocksize, shape, block2 = layout
    if absmax2 is not None:
        block = torch.arange(absmax.numel(), device=absmax.device) // block2
        absmax = code2[absmax.long()] * absmax2[block] + offset
    flat = packed.reshape(-1)
    values = torch.stack([code[(flat >> 4).long()], code[(flat & 15).long()]], dim=-1)
    return (values.reshape(-1, blocksize) * absmax[:, None]).to(dtype).reshape(shape)


class NF4Matmul(torch.autograd.Function):
    """x W^T + b for the NF4 weight `nf4_weight` gives, which it dequantises in the forward and
    again in the backward (the 4-bit weight is frozen: gradients of x and of a bias that takes
    one)."""

    @staticmethod
    def forward(ctx, x, bias, packed, absmax, code, absmax2, code2, offset, layout):
        ctx.save_for_backward(packed, absmax, code, absmax2, code2, offset)
        ctx.layout = layout
        weight = nf4_weight(packed, absmax, code, absmax2, code2, offset, layout, x.dtype)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight = nf4_weight(*ctx.saved_tensors, ctx.layout, grad.dtype)
        grad_bias = (grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1]
                     else None)
        return grad @ weight, grad_bias, None, None, None, None, None, None, None


def nf4_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What bitsandbytes' Linear4bit `layer` gives for `x` (in its compute dtype, the bias added
    in the product as its fallback adds it), through `NF4Matmul`."""
    state = layer.weight.quant_state
    nested = state.state2 if state.nested else None
    dtype = x.dtype
    x = x.to(layer.compute_dtype or dtype)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    out = NF4Matmul.apply(x, bias, layer.weight, state.absmax, state.code,
                          None if nested is None else nested.absmax,
                          None if nested is None else nested.code,
                          None if nested is None else state.offset,
                          (state.blocksize, tuple(state.shape),
                           0 if nested is None else nested.blocksize))
    return out.to(dtype)


def is_nf4_linear(module: torch.nn.Module) -> bool:
    """Whether `module` is a bitsandbytes Linear4bit of NF4 codes (what `nf4_linear` serves): a
    module without children, so not an adapter's wrapper, which shows its base layer's weight."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    return (state is not None and getattr(state, "quant_type", None) == "nf4"
            and hasattr(module, "compute_dtype") and next(module.children(), None) is None)
