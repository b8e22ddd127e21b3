"""The CPU log-probability function must equal plain autograd over a log-softmax, outputs and
gradients, for every output TRL asks for."""

from __future__ import annotations

import pytest
import torch

from vlmrl.training.trainer.logprob_fallback import TorchChunkedLogProb, _autograd_outputs

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def inputs(tokens: int, vocab: int, bias: bool):
    generator = torch.Generator().manual_seed(tokens + vocab)
    hidden = torch.randn(tokens, 16, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, 16, generator=generator) * 0.5).requires_grad_()
    bias_ = (torch.randn(vocab, generator=generator) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    return hidden, weight, bias_, targets


@pytest.mark.parametrize("tokens,vocab,temperature,scale,bias", [
    (300, 3000, 1.0, 1.0, False),   # two chunks of tokens
    (40, 2000, 0.7, 1.3, True),
])
def test_outputs_and_gradients_match_autograd(tokens, vocab, temperature, scale, bias) -> None:
    hidden, weight, bias_, targets = inputs(tokens, vocab, bias)
    ours = TorchChunkedLogProb.apply(hidden, weight, bias_, targets, temperature, 256, None,
                                     scale, OUTPUTS)
    reference = _autograd_outputs(hidden, weight, bias_, targets, temperature, None, scale,
                                  OUTPUTS)
    for name, got, want in zip(OUTPUTS, ours, reference):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.allclose(got.float(), want.float(), atol=1e-4), name
    params = [hidden, weight] + ([bias_] if bias else [])
    mix_lp, mix_h = torch.linspace(-1, 1, tokens), torch.linspace(2, -1, tokens)
    grads = [torch.autograd.grad((out[0] * mix_lp).sum() + (out[1] * mix_h).sum(), params)
             for out in (ours, reference)]
    for got, want in zip(*grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_unrequested_outputs_are_none_and_empty_input_stays_connected() -> None:
    hidden, weight, _, targets = inputs(5, 100, False)
    _log_probs, entropy, *extras = TorchChunkedLogProb.apply(hidden, weight, None, targets, 1.0,
                                                            256, None, 1.0, ("log_probs",))
    assert entropy is None and extras == [None, None, None]
    empty = TorchChunkedLogProb.apply(hidden[:0], weight, None, targets[:0], 1.0, 256, None,
                                      1.0, ("log_probs", "entropy"))[0]
    assert empty.shape == (0,) and empty.requires_grad
    empty.sum().backward()
    assert hidden.grad is not None and not hidden.grad.any()


def test_soft_capped_logits_take_the_autograd_path() -> None:
    hidden, weight, _, targets = inputs(8, 200, False)
    ours = TorchChunkedLogProb.apply(hidden, weight, None, targets, 1.0, 256, 30.0, 1.0,
                                     ("log_probs",))
    reference = _autograd_outputs(hidden, weight, None, targets, 1.0, 30.0, 1.0, ("log_probs",))
    assert torch.equal(ours[0], reference[0])


def test_gradients_match_when_the_logits_are_recomputed(monkeypatch) -> None:
    import vlmrl.training.trainer.logprob_fallback as compat

    hidden, weight, _, targets = inputs(300, 3000, False)
    kept = torch.autograd.grad(TorchChunkedLogProb.apply(hidden, weight, None, targets, 1.0, 256,
                                                         None, 1.0, OUTPUTS)[0].sum(), hidden)
    monkeypatch.setattr(compat, "KEEP_LOGITS_BYTES", 0)
    recomputed = torch.autograd.grad(TorchChunkedLogProb.apply(
        hidden, weight, None, targets, 1.0, 256, None, 1.0, OUTPUTS)[0].sum(), hidden)
    assert torch.allclose(kept[0], recomputed[0], atol=1e-6)


def test_a_second_backward_recomputes_instead_of_reusing_consumed_logits() -> None:
    hidden, weight, _, targets = inputs(50, 500, False)
    loss = TorchChunkedLogProb.apply(hidden, weight, None, targets, 1.0, 256, None, 1.0,
                                     OUTPUTS)[0].sum()
    first = torch.autograd.grad(loss, hidden, retain_graph=True)[0]
    assert torch.allclose(torch.autograd.grad(loss, hidden)[0], first, atol=1e-6)
