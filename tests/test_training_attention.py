"""`vlmrl.training.trainer.attention`: the training forward's attention over rolled rows, causal with no
mask, against transformers' SDPA with its padding mask, on tensors and on the tiny Qwen3-VL with
left-padded prompts, right-padded completions and images (eager, and in compiled decoder layers
traced whole)."""

from __future__ import annotations

import pytest
import torch
from tiny_batches import padded_vl_batch
from transformers import AutoModelForImageTextToText
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.models.processor import load_processor
from vlmrl.training.rollout.decode_attention import set_text_attention
from vlmrl.training.trainer import attention as training_attention
from vlmrl.training.trainer.attention import (
    ROLLED,
    causal_mask_of,
    roll_rows,
    rolled_attention_name,
    rolled_causal_attention,
    rolled_mask,
    row_runs,
)


class Module:
    num_key_value_groups = 2
    is_causal = True
    training = True


def padded(rows: int, length: int) -> torch.Tensor:
    """[rows, length]: each row's tokens one run, after left padding and before right padding."""
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for row, (left, right) in enumerate([(0, 0), (5, 0), (2, 7), (11, 3)][:rows]):
        mask[row, left:length - right] = True
    return mask


def sdpa_mask_of(keys: torch.Tensor) -> torch.Tensor:
    """SDPA's 4D mask as transformers builds it for a forward without a cache."""
    length = keys.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (causal[None] & keys[:, None, :])[:, None]


def test_roll_rows_rolls_each_row_by_its_shift_and_back() -> None:
    states = torch.arange(2 * 5).view(2, 5)
    rolled = roll_rows(states, torch.tensor([0, 2]), dim=1)
    assert rolled.tolist() == [[0, 1, 2, 3, 4], [7, 8, 9, 5, 6]]
    assert torch.equal(roll_rows(rolled, torch.tensor([0, -2]), dim=1), states)


def test_row_runs_are_each_rows_first_slot_and_length_and_none_unless_one_run_a_row() -> None:
    keys = padded(4, 20)
    assert row_runs(keys).tolist() == [[0, 20], [5, 15], [2, 11], [11, 6]]
    assert row_runs(keys.long()).dtype == torch.int64
    holes = keys.clone()
    holes[2, 9] = False
    assert row_runs(holes) is None
    empty = keys.clone()
    empty[1] = False
    assert row_runs(empty) is None


def mask_call(keys: torch.Tensor, **changes):
    """`rolled_mask` called as transformers' create_causal_mask calls a mask function for a
    forward without a cache over `keys`."""
    from transformers.masking_utils import causal_mask_function

    rows, length = keys.shape
    call = {"batch_size": rows, "q_length": length, "kv_length": length, "q_offset": 0,
            "kv_offset": 0, "mask_function": causal_mask_function, "attention_mask": keys,
            "allow_is_causal_skip": True, "dtype": torch.float32, "config": None,
            "use_vmap": False, "device": keys.device}
    return rolled_mask(**{**call, **changes})


def test_the_mask_function_gives_runs_for_a_causal_forward_and_sdpas_mask_otherwise() -> None:
    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

    keys = padded(4, 20)
    assert mask_call(keys).tolist() == row_runs(keys).tolist()
    holes = keys.clone()
    holes[2, 9] = False
    packed = and_masks(causal_mask_function, lambda b, h, q, kv: (q < 10) == (kv < 10))
    step = {"q_length": 1, "kv_length": 21, "q_offset": 20,  # a decode step
            "attention_mask": torch.cat((keys, torch.ones(4, 1, dtype=torch.bool)), dim=1)}
    for changes in ({"attention_mask": holes}, {"mask_function": packed}, step,
                    {"kv_length": 32, "attention_mask": torch.cat(  # a static cache's prefill
                        (keys, torch.zeros(4, 12, dtype=torch.bool)), dim=1)}):
        got = mask_call(keys, **changes)
        expected = sdpa_mask(**{"batch_size": 4, "q_length": 20, "kv_length": 20,
                                "q_offset": 0, "kv_offset": 0,
                                "mask_function": causal_mask_function, "attention_mask": keys,
                                "allow_is_causal_skip": True, "device": keys.device, **changes})
        assert got.dim() == 4 and got.dtype == torch.bool
        assert torch.equal(got, expected)
    assert torch.equal(causal_mask_of(row_runs(keys), 20), sdpa_mask_of(keys))


@pytest.mark.parametrize("holes", [False, True])
def test_rolled_attention_equals_masked_sdpa_on_real_tokens_with_their_gradients(holes) -> None:
    torch.manual_seed(0)
    rows, heads, length, dim = 4, 4, 24, 8
    keys = padded(rows, length)
    if holes:  # not one run per row: SDPA's mask from the mask function, and SDPA with it
        keys[1, 9] = False
    mask = mask_call(keys)
    inputs = [torch.randn(rows, h, length, dim, dtype=torch.float64, requires_grad=True)
              for h in (heads, heads // 2, heads // 2)]
    weight = torch.randn(rows, length, heads, dim, dtype=torch.float64) * keys[:, :, None, None]
    calls = []

    def recorded(module, query, key, value, attention_mask, **kwargs):
        calls.append((attention_mask, kwargs.get("is_causal")))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    outputs, grads = [], []
    for attention, given in ((sdpa_attention_forward, sdpa_mask_of(keys)),
                             (rolled_causal_attention(recorded), mask)):
        out, _ = attention(Module(), *inputs, given, dropout=0.0, scaling=dim ** -0.5)
        assert out.isfinite().all()
        real = out * keys[:, :, None, None]
        outputs.append(real.detach())
        grads.append(torch.autograd.grad((real * weight).sum(), inputs))
    torch.testing.assert_close(outputs[1], outputs[0])
    for rolled, masked in zip(grads[1], grads[0]):
        torch.testing.assert_close(rolled, masked)
    assert calls == [(mask, None)] if holes else calls == [(None, True)]


def test_a_module_that_is_not_causal_gets_the_causal_mask_of_the_runs() -> None:
    calls = []

    def original(module, query, key, value, attention_mask, **kwargs):
        calls.append(attention_mask)
        return query.transpose(1, 2), None

    keys = padded(2, 12)
    inputs = [torch.randn(2, h, 12, 8) for h in (4, 2, 2)]

    class Bidirectional(Module):
        is_causal = False

    rolled_causal_attention(original)(Bidirectional(), *inputs, mask_call(keys))
    rolled_causal_attention(original)(Module(), *inputs, mask_call(keys), is_causal=False)
    assert all(torch.equal(mask, sdpa_mask_of(keys)) for mask in calls) and len(calls) == 2


def test_a_decode_step_and_a_cache_go_to_sdpa_unchanged() -> None:
    calls = []

    def original(module, query, key, value, attention_mask, **kwargs):
        calls.append(attention_mask)
        return query.transpose(1, 2), None

    attend = rolled_causal_attention(original)
    step = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    attend(Module(), torch.randn(2, 4, 1, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8),
           step)
    cached = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    attend(Module(), torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8),
           cached)
    assert calls[0] is step and calls[1] is cached


def test_the_tiny_qwen3_vl_gives_the_masked_logits_on_its_real_tokens(monkeypatch) -> None:
    """Left-padded prompts with images, right-padded completions: the logits of every real token
    equal SDPA's with the padding mask, and every logit is finite."""
    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    batch = padded_vl_batch(load_processor(str(path)))
    rolls = []

    def counted(states, shift, dim):
        rolls.append(dim)
        return roll_rows(states, shift, dim)

    monkeypatch.setattr(training_attention, "roll_rows", counted)
    logits = {}
    for name in ("sdpa", rolled_attention_name()):
        set_text_attention(model, name)
        with torch.no_grad():
            logits[name] = model(**batch).logits
    real = batch["attention_mask"].bool()
    layers = model.config.text_config.num_hidden_layers
    assert rolls == [2, 2, 2, 1] * layers  # every layer: query, key, value, and its output back
    assert logits[ROLLED].isfinite().all()
    torch.testing.assert_close(logits[ROLLED][real], logits["sdpa"][real], atol=1e-4, rtol=1e-4)


def test_use_rolled_attention_sets_it_over_sdpa_and_names_the_param_otherwise() -> None:
    from vlmrl.params import ParamsError
    from vlmrl.training.gspo import use_rolled_attention
    from vlmrl.training.rollout.decode_attention import attention_implementation, decode_attention

    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    use_rolled_attention(model)
    assert attention_implementation(model) == ROLLED
    with decode_attention(model, "grouped"):  # graph decoding's steps: the grouped attention
        assert attention_implementation(model) != ROLLED
    assert attention_implementation(model) == ROLLED
    set_text_attention(model, "eager")
    with pytest.raises(ParamsError, match="train.training_attention: rolled needs the model's "
                                          "SDPA attention, not 'eager'"):
        use_rolled_attention(model)
