"""The text-only path: a model without a vision tower (the embedded tiny Qwen3, built like the
tiny Qwen3-VL) and GSM8K-style data without images, through the same library calls the stages
make. tests/test_recipes.py runs all seven stages on it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vlmrl.data.prepare import load_raw_records, prepare, render_report
from vlmrl.data.synth.arithmetic import generate_arithmetic
from vlmrl.evaluation.evaluate import generate_responses, render_prompt
from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.models.loading import load_model, load_policy
from vlmrl.models.processor import chat_messages, has_vision, is_text_checkpoint, model_inputs
from vlmrl.params import DataParams, EvalParams, LoraParams, ModelParams
from vlmrl.verification.lora import LoraModule, check_language_model_only

TEXT_MODEL = ModelParams(name="embedded:tiny-qwen3")
ARITHMETIC = DataParams(source="embedded:arithmetic", answer_pattern="after_hashes",
                        synthetic_size=20, eval_size=4, answer_types=("integer",))


@pytest.fixture(scope="module")
def text_model():
    model, tokenizer, _backend = load_model(TEXT_MODEL)
    return model, tokenizer


def test_arithmetic_rows_are_gsm8k_shaped_and_repeat() -> None:
    rows = list(generate_arithmetic(10, seed=3))
    assert rows == list(generate_arithmetic(10, seed=3)) and rows != list(generate_arithmetic(10))
    for row in rows:
        assert set(row) == {"question", "answer"}
        working, value = row["answer"].rsplit("\n#### ", 1)
        assert value.isdigit() and value in working  # the worked solution ends at the answer


def test_prepared_arithmetic_has_integer_gold_derived_ids_and_no_images() -> None:
    prepared = prepare(load_raw_records(ARITHMETIC), ARITHMETIC)
    rows = prepared.train + prepared.eval
    assert len(prepared.eval) == 4 and len(rows) == 20
    for row in rows:
        assert re.fullmatch(r"\d+", row["answer"]) and row["answer_type"] == "integer"
        assert row["pid"].startswith("auto-") and row["image"] is None
        assert all(part["type"] == "text" for m in row["prompt"] for part in m["content"])


def test_text_records_are_labelled_with_what_the_data_says(tmp_path) -> None:
    """Source: the file's name (or the built-in set's); no category or tier where the data has
    none, and the report leaves those groupings out instead of counting "unknown"."""
    path = tmp_path / "my_gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in generate_arithmetic(12)))
    local = DataParams(source="local", path=str(path), answer_pattern="after_hashes",
                       eval_size=2, answer_types=("integer",))
    for settings, source in ((local, "my_gsm8k.jsonl"), (ARITHMETIC, "embedded:arithmetic")):
        prepared = prepare(load_raw_records(settings), settings)
        rows = prepared.train + prepared.eval
        assert {(row["source"], row["category"], row["tier"]) for row in rows} == {
            (source, None, None)}
        report = render_report(prepared, settings)
        assert f"| {source} | {len(prepared.train)} | {len(prepared.eval)} |" in report
        assert "unknown" not in report and "## By category" not in report
        assert "## By tier" not in report
    report = render_report(prepare(load_raw_records(local), local), local)
    assert f"Source: `{path}` (local);" in report and "testmini" not in report


def test_embedded_text_model_is_a_qwen3_causal_lm_with_its_chat_template(text_model) -> None:
    model, tokenizer = text_model
    assert type(model).__name__ == "Qwen3ForCausalLM" and not has_vision(tokenizer)
    assert is_text_checkpoint(ensure_embedded_model("embedded:tiny-qwen3"))
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "2 + 2?"}]}]
    assert chat_messages(tokenizer, messages)[1] == {"role": "user", "content": "2 + 2?"}
    rendered = render_prompt(tokenizer, {"pid": "p", "prompt": messages, "image": None})
    assert rendered.endswith("<|im_start|>assistant\n") and "Be brief." in rendered
    inputs = model_inputs(tokenizer, [rendered])
    assert set(inputs) == {"input_ids", "attention_mask"}


def test_text_model_generates_and_refuses_an_image_row(text_model) -> None:
    model, tokenizer = text_model
    prepared = prepare(load_raw_records(ARITHMETIC), ARITHMETIC)
    settings = EvalParams(max_new_tokens=4, batch_size=2, do_sample=True, top_k=20, seed=1)
    generations = generate_responses(model, tokenizer, prepared.eval, settings)
    assert [g.pid for g in generations] == [row["pid"] for row in prepared.eval]
    assert generations == generate_responses(model, tokenizer, prepared.eval, settings)
    with pytest.raises(ValueError, match="has an image but the model is a text model"):
        render_prompt(tokenizer, {**prepared.eval[0], "image": object()})


def test_text_policy_adapts_the_decoder_layers_only() -> None:
    lora = LoraParams(r=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj"))
    model, _tokenizer, _backend = load_policy(TEXT_MODEL, lora, seed=0)
    names = [name for name, _ in model.named_modules() if name.endswith(".lora_A")]
    assert names and all(".layers." in name for name in names)
    modules = [LoraModule(name.removesuffix(".lora_A"), torch.zeros(4, 2), torch.zeros(2, 4), 2.0)
               for name in names]
    assert check_language_model_only(modules, vision=False).passed
    assert not check_language_model_only(modules, vision=True).passed


def test_eval_browser_lists_text_items_and_says_they_have_no_image(tmp_path) -> None:
    from starlette.testclient import TestClient

    from vlmrl.data.prepare import to_dataset
    from vlmrl.ui.app import create_app

    prepared = prepare(load_raw_records(ARITHMETIC), ARITHMETIC)
    to_dataset(prepared.eval).save_to_disk(str(tmp_path / "data/prepared/eval"))
    client = TestClient(create_app(tmp_path), base_url="http://127.0.0.1")
    listed = client.get("/api/records").json()
    pid = prepared.eval[0]["pid"]
    assert pid in str(listed)
    response = client.get(f"/api/image/{pid}")
    assert response.status_code == 404 and "text-only" in response.json()["error"]
