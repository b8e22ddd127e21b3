"""TRL 1.15's trainers compute per-token log-probabilities through a Triton kernel
(`trl.kernels.ChunkedLogProbFunction`), and Triton only ships with CUDA builds of torch; on a
machine without a GPU the kernel fails too ("0 active drivers"). `TorchChunkedLogProb` is a
plain-torch function with the same call signature and outputs, chunked over tokens so the
[tokens, vocab] logits never exist all at once; the trainer subclasses (vlmrl.training.trainer.trainers) use it
where `kernel_cannot_run`. No torch at import: the autograd function is built on first use."""

from __future__ import annotations

import functools
from typing import Any

TOKEN_CHUNK = 256


class TorchChunkedLogProb:
    """Same contract as trl.kernels.ChunkedLogProbFunction.apply. Without logit soft-capping it
    runs `_fused_log_prob_function`: per chunk of tokens one matmul and a log-sum-exp forward, and
    in backward the logits only (kept up to 1 GiB, recomputed beyond), so no log-softmax, softmax
    or entropy graph over [tokens, vocab] is kept for autograd: with
    the 151,936-token vocabulary the passes over those tensors cost more than the matmul
    (`python benchmarks/cpu_kernels.py`)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        if final_logit_softcapping is not None:
            return _autograd_outputs(hidden, weight, bias, targets, temperature,
                                     final_logit_softcapping, logit_scale, outputs)
        extras = tuple(name for name in EXTRA_OUTPUTS if name in outputs)
        log_probs, entropy, *rest = _fused_log_prob_function().apply(
            hidden, weight, bias, targets, logit_scale / temperature, "entropy" in outputs,
            extras)
        named = dict(zip(extras, rest))
        return (log_probs, entropy if "entropy" in outputs else None,
                *(named.get(name) for name in EXTRA_OUTPUTS))


EXTRA_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")
KEEP_LOGITS_BYTES = 1 << 30


@functools.cache
def _fused_log_prob_function():
    """The autograd.Function, built on first use: this module imports no torch at import."""
    import torch

    def chunk_logits(hidden, weight, bias, scale):
        logits = torch.nn.functional.linear(hidden.float(), weight.float(),
                                            None if bias is None else bias.float())
        return logits.mul_(scale) if scale != 1.0 else logits

    class FusedLogProb(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, scale, with_entropy, extras):
            n = hidden.shape[0]
            log_probs = hidden.new_empty(n, dtype=torch.float32)
            lse = hidden.new_empty(n, dtype=torch.float32)
            entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
            extra = {name: hidden.new_empty(n, dtype=torch.bool if name == "is_top1" else torch.float32)
                     for name in extras}
            # Kept for backward where they fit (recomputing them costs a matmul), else recomputed
            keep = any(ctx.needs_input_grad[:3]) and n * weight.shape[0] * 4 <= KEEP_LOGITS_BYTES
            ctx.kept = [] if keep else None
            for start in range(0, n, TOKEN_CHUNK):
                part = slice(start, start + TOKEN_CHUNK)
                logits = chunk_logits(hidden[part], weight, bias, scale)
                if keep:
                    ctx.kept.append(logits)
                chunk_lse = torch.logsumexp(logits, -1)
                lse[part] = chunk_lse
                log_probs[part] = logits.gather(-1, targets[part, None]).squeeze(-1) - chunk_lse
                if "mean_logits" in extra:
                    extra["mean_logits"][part] = logits.mean(-1)
                if "is_top1" in extra:
                    extra["is_top1"][part] = logits.argmax(-1) == targets[part]
                if "log_sum_sq_probs" in extra:
                    extra["log_sum_sq_probs"][part] = torch.logsumexp(2 * logits, -1) - 2 * chunk_lse
                if with_entropy:  # H = lse - sum(p * logits)
                    probs = (logits - chunk_lse[:, None]).exp_()
                    entropy[part] = chunk_lse - torch.linalg.vecdot(probs, logits)
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
            ctx.scale = scale
            for value in extra.values():
                ctx.mark_non_differentiable(value)
            return (log_probs, entropy, *extra.values())

        @staticmethod
        def backward(ctx, grad_log_probs, grad_entropy, *_):
            hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
            need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
            grad_hidden = torch.zeros_like(hidden) if need_hidden else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
            kept, ctx.kept = ctx.kept, None  # used up in place: a second backward recomputes
            for index, start in enumerate(range(0, hidden.shape[0], TOKEN_CHUNK)):
                part = slice(start, start + TOKEN_CHUNK)
                logits = (kept[index] if kept is not None
                          else chunk_logits(hidden[part], weight, bias, ctx.scale))
                log_p = logits.sub_(lse[part, None])  # in place: the logits are not needed again
                probs = log_p.exp()
                g_lp = (grad_log_probs[part, None] if grad_log_probs is not None
                        else log_p.new_zeros(()))
                if grad_entropy is not None and entropy.numel():
                    # d lp/dz = onehot - p;  dH/dz = -p (log p + H):  grad = -p (g_lp + g_H (log p + H))
                    weight_of_p = log_p.add_(entropy[part, None]).mul_(grad_entropy[part, None])
                    grad = probs.mul_(weight_of_p.add_(g_lp)).neg_()
                else:
                    grad = probs.mul_(g_lp).neg_()
                if grad_log_probs is not None:
                    grad.scatter_add_(-1, targets[part, None], grad_log_probs[part, None])
                if ctx.scale != 1.0:
                    grad.mul_(ctx.scale)
                if need_hidden:
                    grad_hidden[part] = (grad @ weight.float()).to(hidden.dtype)
                if need_weight:
                    grad_weight.addmm_(grad.T, hidden[part].float())
                if need_bias:
                    grad_bias.add_(grad.sum(0))
            return (grad_hidden,
                    None if grad_weight is None else grad_weight.to(weight.dtype),
                    None if grad_bias is None else grad_bias.to(bias.dtype),
                    None, None, None, None)

    return FusedLogProb


def _autograd_outputs(hidden, weight, bias, targets, temperature, final_logit_softcapping,
                      logit_scale, outputs):
    """The plain-autograd version, for soft-capped logits (Gemma-style)."""
    import torch

    parts = [_chunk_outputs(hidden[start:start + TOKEN_CHUNK], weight, bias,
                            targets[start:start + TOKEN_CHUNK], temperature,
                            final_logit_softcapping, logit_scale, outputs)
             for start in range(0, hidden.shape[0], TOKEN_CHUNK)]
    if not parts:
        empty = hidden.new_zeros((0,), dtype=torch.float32) + hidden.sum() * 0
        parts = [(empty, *(empty.detach() if name in outputs else None
                           for name in ("entropy", "log_sum_sq_probs", "mean_logits",
                                        "is_top1")))]
    return tuple(None if part[0] is None else torch.cat(part) for part in zip(*parts))


def _chunk_outputs(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    import torch

    logits = torch.nn.functional.linear(hidden, weight, bias).float() * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    target_log_probs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = (-(log_probs.exp() * log_probs).sum(-1)) if "entropy" in outputs else None
    with torch.no_grad():
        log_sum_sq = (torch.logsumexp(2 * log_probs, dim=-1)
                      if "log_sum_sq_probs" in outputs else None)
        mean_logits = logits.mean(-1) if "mean_logits" in outputs else None
        is_top1 = (logits.argmax(-1) == targets) if "is_top1" in outputs else None
    return target_log_probs, entropy, log_sum_sq, mean_logits, is_top1


def kernel_cannot_run(kernel: Any, cuda_available: bool) -> bool:
    """Whether TRL's log-prob kernel (`kernel`: trl.trainer.utils' import of it, None without
    Triton) cannot run here: Triton is missing, or there is no GPU for it. A CUDA build of torch
    ships Triton, so on a machine without a GPU the kernel exists but fails."""
    return kernel is not TorchChunkedLogProb and (kernel is None or not cuda_available)
