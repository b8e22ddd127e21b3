"""`vlmrl.training.trainer.attention` on a GPU: at the 2B shape's training micro-batch in bfloat16, the
rolled rows' causal attention against SDPA with transformers' padding mask (outputs and gradients
on the real tokens), and the kernel SDPA takes for each (the masked one cannot take flash)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


class Module:
    num_key_value_groups = 2
    is_causal = True
    training = True


def micro_batch(rows: int = 8, length: int = 1408):
    """Left padding of up to 300 slots and right padding of up to 200, as GRPO's rows have."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randint(0, 300, (rows, 1), generator=generator)
    right = torch.randint(0, 200, (rows, 1), generator=generator)
    slots = torch.arange(length)
    keys = ((slots >= left) & (slots < length - right)).cuda()
    causal = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    return keys, (causal[None] & keys[:, None, :])[:, None]


def attention_kernels(run) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return sorted({event.key for event in profile.key_averages()
                   if "fmha" in event.key or "flash" in event.key})


def test_rolled_attention_matches_the_masked_one_and_takes_the_flash_kernel():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vlmrl.training.trainer.attention import rolled_causal_attention, row_runs

    keys, mask = micro_batch()
    runs = row_runs(keys)  # what the mask function gives the rolled attention for these rows
    torch.manual_seed(1)
    inputs = [torch.randn(8, heads, 1408, 128, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True) for heads in (16, 8, 8)]
    weight = torch.randn(8, 1408, 16, 128, device="cuda") * keys[:, :, None, None]
    results, kernels = {}, {}
    for name, attention, given in (
            ("masked", sdpa_attention_forward, mask),
            ("rolled", rolled_causal_attention(sdpa_attention_forward), runs)):
        def step(attention=attention, given=given):
            out, _ = attention(Module(), *inputs, given, dropout=0.0, scaling=128 ** -0.5)
            loss = (out.float() * weight).sum()
            return out, torch.autograd.grad(loss, inputs)

        out, grads = step()
        assert out.isfinite().all()
        results[name] = (out.float() * keys[:, :, None, None], [g.float() for g in grads])
        kernels[name] = attention_kernels(step)
    print(f"attention kernels: {kernels}")
    for got, expected in zip([results["rolled"][0], *results["rolled"][1]],
                             [results["masked"][0], *results["masked"][1]]):
        assert ((got - expected).norm() / expected.norm()).item() < 1e-2
    assert not any("cutlass" in kernel for kernel in kernels["rolled"])
    assert any("flash" in kernel for kernel in kernels["rolled"])
