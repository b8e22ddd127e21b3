"""Evaluation and the before/after report: aggregation recomputed by hand, flips, responses that
break the scorer, clear errors for missing inputs, generation on the embedded tiny Qwen3-VL, and
the baseline_eval/post_eval stages through DVC."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, dvc_repro, run
from PIL import Image

from vlmrl.errors import run_stage
from vlmrl.evaluation.evaluate import (
    IMAGE_PLACEHOLDER,
    EvalError,
    Generation,
    aggregate,
    count_generated_tokens,
    generate_responses,
    generation_kwargs,
    render_prompt,
    run_evaluation,
    score_records,
)
from vlmrl.evaluation.report import (
    PLOT_BEFORE_AFTER,
    PLOT_BY_CATEGORY,
    find_flips,
    read_records,
    truncate,
    write_report,
)
from vlmrl.params import DataParams, EvalParams, Params, ParamsError, RewardsParams
from vlmrl.reporting.tables import markdown_cell

PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
TYPED = Params(PARAMS)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REWARDS = {"weights": {"format_reward": 0.5, "correctness_reward": 1.0, "length_penalty": 1.0},
           "length_penalty": {"min_chars": 10, "max_chars": 100}}
GOOD = "<REASONING>Count the bars.</REASONING><SOLUTION>7</SOLUTION>"


def load_stage_module():
    spec = importlib.util.spec_from_file_location("evaluate_stage", ROOT / "stages" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(pid: str, answer: str = "7", **extra) -> dict:
    base = {"pid": pid, "answer": answer, "question_type": "free_form", "answer_type": "integer",
            "choices": None, "precision": None, "unit": None, "source": "src-a", "category": "cat-a"}
    return {**base, **extra}


def record(pid: str, correct: bool, **extra) -> dict:
    base = {"pid": pid, "correct": correct, "format_ok": correct, "reward_total": 1.0 if correct else 0.0,
            "gold": "7", "response": f"response {pid}", "category": "cat-a",
            "answer_type": "integer", "source": "src-a"}
    return {**base, **extra}


# ------------------------------------------------------------------- settings


def test_eval_settings_from_params_and_unknown_key_named():
    settings = EvalParams.from_params(PARAMS["eval"])
    assert settings.max_new_tokens == PARAMS["eval"]["max_new_tokens"]
    assert settings.batch_size == PARAMS["eval"]["batch_size"]
    with pytest.raises(ParamsError, match="max_new_tokns"):
        EvalParams.from_params({**PARAMS["eval"], "max_new_tokns": 3})
    with pytest.raises(ParamsError, match="eval.batch_size"):
        EvalParams.from_params({**PARAMS["eval"], "batch_size": 0})
    with pytest.raises(ParamsError, match="eval.top_p"):
        EvalParams.from_params({**PARAMS["eval"], "top_p": 1.5})
    with pytest.raises(ParamsError, match="eval.top_k"):
        EvalParams.from_params({**PARAMS["eval"], "top_k": -1})


def test_sampling_settings_reach_generate_and_greedy_ignores_them():
    class Processor:
        class tokenizer:
            pad_token_id = unk_token_id = 0
            convert_tokens_to_ids = staticmethod(lambda token: 1)

    sampled = generation_kwargs(Processor, EvalParams(do_sample=True, temperature=0.7, top_p=0.8,
                                                      top_k=20))
    [sampler] = sampled["logits_processor"]  # drawn with common random numbers (on any device)
    settings = sampler.settings
    assert (settings.temperature, settings.top_p, settings.top_k) == (0.7, 0.8, 20)
    # without a top-k cut transformers samples: 0 switches the cut off; None would let generate
    # fall back to its default of 50
    no_cut = generation_kwargs(Processor, EvalParams(do_sample=True, temperature=0.7))
    assert (no_cut["temperature"], no_cut["top_k"]) == (0.7, 0)
    greedy = generation_kwargs(Processor, EvalParams(do_sample=False, top_k=20))
    assert "top_k" not in greedy and greedy["do_sample"] is False


# ---------------------------------------------------------------- aggregation


def test_aggregate_matches_hand_computation():
    records = [
        record("a", True, reward_total=3.0, reward_format_reward=2.0, reward_correctness_reward=2.0,
               answer_type="integer", category="table", source="s1", tier="read"),
        record("b", False, format_ok=True, reward_total=1.0, reward_format_reward=2.0,
               reward_correctness_reward=0.0, answer_type="integer", category="table", source="s2"),
        record("c", True, format_ok=False, reward_total=1.5, reward_format_reward=0.0,
               reward_correctness_reward=1.5, answer_type="float", category="bar chart", source="s1"),
        record("d", False, reward_total=-2.0, reward_format_reward=-2.0,
               reward_correctness_reward=None, answer_type="float", category="table", source="s2",
               score_error="ValueError: boom"),
    ]
    metrics = aggregate(records, seconds=4.0, generated_tokens=100)
    assert metrics["n"] == 4
    assert metrics["accuracy"] == 0.5
    assert metrics["format_compliance"] == 0.5  # a and b
    assert metrics["mean_reward"] == (3.0 + 1.0 + 1.5 - 2.0) / 4
    assert metrics["rewards"]["format_reward"] == (2.0 + 2.0 + 0.0 - 2.0) / 4
    assert metrics["rewards"]["correctness_reward"] == (2.0 + 0.0 + 1.5) / 3  # None carries no signal
    assert metrics["accuracy_by_answer_type"] == {"float": 0.5, "integer": 0.5}
    assert metrics["accuracy_by_category"] == {"bar chart": 1.0, "table": 1 / 3}
    assert metrics["accuracy_by_source"] == {"s1": 1.0, "s2": 0.0}
    assert metrics["accuracy_by_tier"] == {"read": 1.0}  # records without a tier are in no group
    assert metrics["score_errors"] == 1
    assert metrics["samples_per_second"] == 1.0
    assert metrics["generated_tokens_per_second"] == 25.0
    assert metrics["mean_generated_tokens"] == 25.0


def test_aggregate_refuses_empty_records_and_bad_time():
    with pytest.raises(EvalError, match="no records"):
        aggregate([], seconds=1.0, generated_tokens=0)
    with pytest.raises(EvalError, match="seconds"):
        aggregate([record("a", True)], seconds=0.0, generated_tokens=1)


def test_count_generated_tokens_stops_at_first_eos_and_ignores_padding():
    import torch

    eos, pad = 9, 8
    tokens = torch.tensor([[5, 6, eos, pad, pad], [1, 2, 3, 4, 5], [eos, pad, pad, pad, pad]])
    assert count_generated_tokens(tokens, {eos, pad}) == [3, 5, 1]


# -------------------------------------------------------------------- scoring


def test_score_records_uses_the_training_rewards_and_weights():
    rows = [row("good"), row("short"), row("wrong", answer="8")]
    texts = [GOOD, "7", GOOD]
    generations = [Generation(r["pid"], t, 5) for r, t in zip(rows, texts)]
    good, short, wrong = score_records(rows, generations, RewardsParams.from_params(REWARDS))

    assert good["correct"] and good["format_ok"] and good["extracted"] == "7"
    assert (good["reward_format_reward"], good["reward_correctness_reward"],
            good["reward_length_penalty"]) == (2.0, 2.0, 0.0)
    assert good["reward_total"] == 0.5 * 2.0 + 2.0
    assert not short["correct"] and short["extracted"] is None
    assert short["reward_length_penalty"] == -1.0  # "7" is under min_chars=10
    assert short["reward_total"] == -1.0
    assert not wrong["correct"] and wrong["gold"] == "8" and wrong["normalized"] == "7"
    assert wrong["reward_total"] == 0.5 * 2.0
    assert all(r["generated_tokens"] == 5 and r["score_error"] is None for r in (good, short, wrong))
    json.dumps([good, short, wrong])


def test_scorer_breaking_responses_are_scored_wrong_not_crashed(monkeypatch):
    from vlmrl.evaluation import evaluate as evaluation

    garbage = bytes(range(256)).decode("latin-1") * 50 + "\x00\ud800"
    responses = {
        "huge": "<SOLUTION>" * 200_000 + "7" * 1_000_000,
        "garbage": garbage,
        "no-tags": "The answer is 7.",
        "degenerate": "addCriterion\n" * 500 + "<REASONING>r</REASONING><SOLUTION>7</SOLUTION>",
        "huge-answer": f"<REASONING>r</REASONING><SOLUTION>{'7' * 5000}</SOLUTION>",
        "scorer-bug": GOOD,
    }
    real_score = evaluation.score_completion

    def score_completion(text, *args, **kwargs):
        if text == GOOD:
            raise RecursionError("scorer bug")
        return real_score(text, *args, **kwargs)

    monkeypatch.setattr(evaluation, "score_completion", score_completion)
    rows = [row(pid) for pid in responses]
    generations = [Generation(pid, text, 48) for pid, text in responses.items()]
    records = {r["pid"]: r for r in score_records(rows, generations, TYPED.rewards)}

    broken = ("huge", "garbage", "no-tags", "huge-answer", "scorer-bug")
    assert not any(records[pid]["correct"] for pid in broken)
    assert records["degenerate"]["reward_format_reward"] == 0.0  # 2 tag points - 2
    assert records["scorer-bug"]["score_error"] == "RecursionError: scorer bug"
    assert records["scorer-bug"]["reward_total"] == 0.0
    assert all(records[p]["score_error"] is None for p in responses if p != "scorer-bug")
    json.dumps(list(records.values()))
    metrics = aggregate(list(records.values()), seconds=1.0, generated_tokens=48 * len(records))
    assert metrics["accuracy"] == records["degenerate"]["correct"] / len(records)
    assert metrics["score_errors"] == 1


def test_score_records_refuses_misaligned_generations():
    with pytest.raises(EvalError, match="pid=b"):
        score_records([row("a")], [Generation("b", GOOD, 1)],
                      RewardsParams.from_params(REWARDS))


# ---------------------------------------------------------------------- flips


def test_find_flips_by_pid_and_reports_unmatched():
    baseline = [record("a", False), record("b", True), record("c", True), record("d", False),
                record("gone", True)]
    post = [record("d", False), record("c", True), record("b", False), record("a", True),
            record("new", True)]
    assert find_flips(baseline, post) == {
        "wrong_to_right": ["a"], "right_to_wrong": ["b"],
        "only_in_baseline": ["gone"], "only_in_post": ["new"],
    }


def test_markdown_cell_escapes_pipes_newlines_tags_and_truncates():
    cell = markdown_cell(truncate("a | b\n<SOLUTION>7</SOLUTION>\r\n" + "x" * 1000))
    assert "\n" not in cell and "\r" not in cell
    assert "a \\| b<br>&lt;SOLUTION&gt;7&lt;/SOLUTION&gt;<br>" in cell
    assert len(cell) < 400 and "more chars" in cell


def test_write_report_lists_flips_with_responses_plots_and_thumbnails(tmp_path):
    baseline = [record("p1", False, category="table"), record("p2", True, category="table"),
                record("p3", True, category="bar chart"), record("only-base", True)]
    post = [record("p1", True, category="table", response="fixed | now\nyes"),
            record("p2", False, category="table"), record("p3", True, category="bar chart")]
    baseline_metrics = {"accuracy": 0.75, "format_compliance": 0.75, "mean_reward": 0.75}
    post_metrics = {"accuracy": 2 / 3, "format_compliance": 2 / 3, "mean_reward": 2 / 3}
    images = {pid: Image.new("RGB", (300, 200), "red") for pid in ("p1", "p2", "p3")}

    write_report(tmp_path, baseline, post, baseline_metrics, post_metrics, images)

    flips = json.loads((tmp_path / "flips.json").read_text())
    assert flips == find_flips(baseline, post)
    markdown = (tmp_path / "report.md").read_text()
    fixed, broken = markdown.split("## Right → wrong")
    assert "| p1 | 7 | response p1 | fixed \\| now<br>yes |" in fixed
    assert "| p2 | 7 | response p2 | response p2 |" in broken
    assert "| Accuracy | 0.750 | 0.667 | -0.083 |" in markdown
    assert "| table | 2 | 0.500 | 0.500 | +0.000 |" in markdown
    assert "only-base" in markdown
    page = (tmp_path / "report.html").read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert page.count('<img alt="p') == 2  # thumbnails for the two flipped records only
    assert page.count("data:image/png;base64,") == 4  # plus the two plots
    for name in (PLOT_BEFORE_AFTER, PLOT_BY_CATEGORY):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)


def test_report_of_records_without_a_category_leaves_categories_out(tmp_path):
    baseline = [record("a", False, category=None), record("b", True, category=None)]
    post = [record("a", True, category=None), record("b", True, category=None)]
    metrics = {"accuracy": 0.5, "format_compliance": 0.5, "mean_reward": 0.5}
    write_report(tmp_path, baseline, post, metrics, metrics)
    markdown = (tmp_path / "report.md").read_text()
    assert "The eval set's records have no category." in markdown and "| None |" not in markdown
    assert "Baseline: the model GSPO starts from" in markdown
    page = (tmp_path / "report.html").read_text()
    assert "have no category" in page and ">None</td>" not in page


# ------------------------------------------------------------- missing inputs


def test_missing_eval_set_names_path_and_stage_before_loading_the_model(tmp_path, monkeypatch):
    from vlmrl.evaluation import evaluate as evaluation

    monkeypatch.setattr(evaluation, "load_model", _must_not_load)
    missing = tmp_path / "prepared" / "eval"
    with pytest.raises(FileNotFoundError) as error:
        run_evaluation(missing, TYPED.model, TYPED.eval, TYPED.rewards)
    assert str(missing) in str(error.value) and "prepare_data" in str(error.value)


def test_missing_adapter_names_path_and_stage_before_loading_the_model(eval_set, tmp_path,
                                                                      monkeypatch):
    from vlmrl.evaluation import evaluate as evaluation

    monkeypatch.setattr(evaluation, "load_model", _must_not_load)
    missing = tmp_path / "models" / "adapter"
    with pytest.raises(FileNotFoundError) as error:
        run_evaluation(eval_set, TYPED.model, TYPED.eval, TYPED.rewards, adapter=missing)
    assert str(missing) in str(error.value) and "train_gspo" in str(error.value)


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the inputs were checked")


def test_stage_failure_keeps_the_earlier_outputs_and_names_the_stage(eval_set, tmp_path, capsys):
    """A failed evaluation leaves the outputs of the run before it as they were."""
    stage = load_stage_module()
    out, metrics, report = tmp_path / "post", tmp_path / "post_eval.json", tmp_path / "report"
    details, by_category = tmp_path / "details.json", tmp_path / "by_category.json"
    stale = [out / "records.jsonl", metrics, details, by_category, report / "report.md"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("stale")
    baseline = tmp_path / "baseline.jsonl"
    baseline.write_text("")
    argv = ["post", "--eval-set", str(eval_set), "--adapter", str(tmp_path / "no-adapter"),
            "--out", str(out), "--metrics", str(metrics), "--baseline", str(baseline),
            "--details", str(details), "--by-category", str(by_category),
            "--timings", str(tmp_path / "timings.json"),
            "--baseline-metrics", str(tmp_path / "no-baseline.json"), "--report",
            str(report), "--params", str(ROOT / "params.yaml")]
    rc = run_stage("post_eval", lambda: stage.main(argv))  # as the script's entry point runs it
    assert rc == 1
    error = capsys.readouterr().err
    assert "no-baseline.json" in error and "baseline_eval" in error
    assert all(path.read_text() == "stale" for path in stale)
    assert sorted(path.name for path in report.iterdir()) == ["report.md"]


def test_stage_post_requires_its_inputs():
    stage = load_stage_module()
    with pytest.raises(SystemExit):
        stage.parse_args(["post", "--eval-set", "e", "--out", "o", "--metrics", "m.json",
                          "--details", "d.json", "--by-category", "c.json", "--timings", "t.json"])
    with pytest.raises(SystemExit):
        stage.parse_args(["baseline", "--eval-set", "e", "--out", "o", "--metrics", "m.json",
                          "--details", "d.json", "--by-category", "c.json", "--timings", "t.json",
                          "--adapter", "a"])


# ------------------------------------------------------------ tiny model


@pytest.fixture(scope="module")
def eval_set(tmp_path_factory) -> Path:
    """A small prepared eval set (small images keep generation cheap)."""
    from vlmrl.data.prepare import load_raw_records, prepare, to_dataset

    settings = DataParams(synthetic_size=30, eval_size=4, image_size=96, seed=3)
    prepared = prepare(load_raw_records(settings), settings)
    path = tmp_path_factory.mktemp("eval_set") / "eval"
    to_dataset(prepared.eval).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_model():
    from vlmrl.models.loading import load_model

    model, processor, _backend = load_model(TYPED.model)
    return model, processor


def test_chat_template_renders_one_image_placeholder_per_image(eval_set, tiny_model):
    from datasets import load_from_disk

    _model, processor = tiny_model
    rows = load_from_disk(str(eval_set))
    assert all(render_prompt(processor, r).count(IMAGE_PLACEHOLDER) == 1 for r in rows)
    prompt, image = rows[0]["prompt"], rows[0]["image"]
    user = prompt[1]
    doubled = [prompt[0], {**user, "content": [user["content"][0], *user["content"]]}]
    with pytest.raises(EvalError, match="2 image placeholders.*expected 1"):
        render_prompt(processor, {"pid": "x", "prompt": doubled, "image": image})
    text_only = [prompt[0], {**user, "content": user["content"][1:]}]
    with pytest.raises(EvalError, match="0 image placeholders.*expected 1"):
        render_prompt(processor, {"pid": "x", "prompt": text_only, "image": image})
    # a text-only record (no image) renders without a placeholder
    assert IMAGE_PLACEHOLDER not in render_prompt(processor, {"pid": "t", "prompt": text_only,
                                                              "image": None})


def test_batched_generation_matches_one_by_one(eval_set, tiny_model):
    from datasets import load_from_disk

    model, processor = tiny_model
    rows = load_from_disk(str(eval_set)).select(range(3))
    batched = generate_responses(model, processor, rows, EvalParams(max_new_tokens=6, batch_size=3))
    single = generate_responses(model, processor, rows, EvalParams(max_new_tokens=6, batch_size=1))
    assert processor.tokenizer.padding_side == "left"
    assert batched == single
    suppressed = generation_kwargs(processor, EvalParams())["suppress_tokens"]
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") in suppressed
    assert [g.pid for g in batched] == rows["pid"]
    assert all(1 <= g.generated_tokens <= 6 for g in batched)


def test_sampling_is_reproducible_with_its_seed(eval_set, tiny_model):
    from datasets import load_from_disk

    model, processor = tiny_model
    rows = load_from_disk(str(eval_set)).select(range(2))
    settings = EvalParams(max_new_tokens=5, batch_size=2, do_sample=True, temperature=1.0, seed=7)
    first = generate_responses(model, processor, rows, settings)
    assert generate_responses(model, processor, rows, settings) == first


def test_top_k_sampling_on_cpu_repeats_with_its_seed(eval_set, tiny_model):
    from datasets import load_from_disk

    model, processor = tiny_model
    rows = load_from_disk(str(eval_set)).select(range(2))
    settings = EvalParams(max_new_tokens=6, batch_size=2, do_sample=True, temperature=1.0,
                          top_k=20, top_p=0.8, seed=7)
    first = generate_responses(model, processor, rows, settings)
    assert generate_responses(model, processor, rows, settings) == first
    assert all(0 < g.generated_tokens <= 6 for g in first)


# ------------------------------------------------------------------ stages


def recompute_from_records(records: list[dict]) -> dict:
    n = len(records)
    return {"n": n, "accuracy": sum(r["correct"] for r in records) / n,
            "format_compliance": sum(r["format_ok"] for r in records) / n,
            "mean_reward": sum(r["reward_total"] for r in records) / n,
            "generated_tokens": sum(r["generated_tokens"] for r in records)}


def assert_metrics_match_records(metrics: dict, records: list[dict], timings_path: Path) -> None:
    for key, value in recompute_from_records(records).items():
        assert math.isclose(metrics[key], value), key
    for name in PARAMS["rewards"]["weights"]:
        values = [r[f"reward_{name}"] for r in records if r[f"reward_{name}"] is not None]
        assert math.isclose(metrics["rewards"][name], sum(values) / len(values)), name
    categories = {r["category"] for r in records}
    assert set(metrics["accuracy_by_category"]) == categories
    assert not {"seconds", "samples_per_second", "generated_tokens_per_second"} & set(metrics)
    timings = json.loads(timings_path.read_text())
    assert math.isclose(timings["generated_tokens_per_second"],
                        metrics["generated_tokens"] / timings["seconds"])
    assert max(r["generated_tokens"] for r in records) <= PARAMS["eval"]["max_new_tokens"]


@pytest.mark.slow
def test_baseline_eval_through_dvc(pipeline_repo):
    from datasets import load_from_disk

    dvc_repro(pipeline_repo, "baseline_eval")
    records = read_records(pipeline_repo / "data/eval/baseline/records.jsonl")
    metrics = json.loads((pipeline_repo / "data/reports/details/baseline_eval.json").read_text())
    eval_rows = load_from_disk(str(pipeline_repo / "data/prepared/eval"))
    assert [r["pid"] for r in records] == eval_rows["pid"]
    assert metrics["n"] == len(eval_rows)
    expected_keys = {"pid", "question_type", "answer_type", "category", "source", "gold",
                     "response", "extracted", "normalized", "correct", "format_ok",
                     "reward_total", "generated_tokens", "score_error",
                     *(f"reward_{name}" for name in PARAMS["rewards"]["weights"])}
    assert all(expected_keys <= set(r) for r in records)
    assert_metrics_match_records(metrics, records,
                                 pipeline_repo / "data/reports/timings/baseline_eval.json")
    status = run(["dvc", "status", "baseline_eval"], pipeline_repo).stdout
    assert "changed" not in status


def make_adapter(target: Path) -> Path:
    """LoRA on q_proj/v_proj of the tiny model with non-zero lora_B, so it changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    from vlmrl.models.loading import load_model

    model, _processor, _backend = load_model(TYPED.model)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                  target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in peft_model.named_parameters():
            if "lora_B" in name:
                weight.copy_(0.5 * torch.randn(weight.shape, generator=generator))
    peft_model.save_pretrained(str(target))
    return target


def expected_flips(baseline: list[dict], post: list[dict]) -> dict[str, list[str]]:
    after = {r["pid"]: r["correct"] for r in post}
    return {"wrong_to_right": [r["pid"] for r in baseline if not r["correct"] and after[r["pid"]]],
            "right_to_wrong": [r["pid"] for r in baseline if r["correct"] and not after[r["pid"]]]}


def assert_report_shows_flips(report: Path, baseline: list[dict], post: list[dict]) -> None:
    expected = expected_flips(baseline, post)
    flips = json.loads((report / "flips.json").read_text())
    assert {k: flips[k] for k in expected} == expected
    markdown = (report / "report.md").read_text()
    fixed, broken = markdown.split("## Right → wrong")
    assert f"## Wrong → right ({len(expected['wrong_to_right'])})" in fixed
    assert f"## Right → wrong ({len(expected['right_to_wrong'])})" in markdown
    listed = {pid for pid in (r["pid"] for r in baseline) if f"| {pid} |" in markdown}
    assert listed == set(expected["wrong_to_right"]) | set(expected["right_to_wrong"])
    assert all(f"| {pid} |" in fixed for pid in expected["wrong_to_right"])
    assert all(f"| {pid} |" in broken for pid in expected["right_to_wrong"])
    for name in (PLOT_BEFORE_AFTER, PLOT_BY_CATEGORY):
        assert (report / name).read_bytes().startswith(PNG_MAGIC)
    assert (report / "report.html").read_text().count('<img alt="') == sum(map(len, expected.values()))


@pytest.mark.slow
def test_post_stage_on_a_peft_adapter(pipeline_repo, tmp_path):
    """The post path without training: a hand-made adapter, and a baseline with two records
    marked right so the report has right→wrong flips to show."""
    dvc_repro(pipeline_repo, "baseline_eval")
    baseline = read_records(pipeline_repo / "data/eval/baseline/records.jsonl")
    for marked in baseline[:2]:
        marked["correct"] = True
    baseline_path = tmp_path / "baseline.jsonl"
    baseline_path.write_text("".join(json.dumps(r) + "\n" for r in baseline))
    out, metrics_path, report = tmp_path / "post", tmp_path / "post_eval.json", tmp_path / "report"
    run(["python", "stages/evaluate.py", "post", "--eval-set", "data/prepared/eval",
         "--adapter", str(make_adapter(tmp_path / "adapter")), "--out", str(out),
         "--metrics", str(tmp_path / "headline.json"), "--baseline", str(baseline_path),
         "--details", str(metrics_path), "--by-category", str(tmp_path / "by_category.json"),
         "--timings", str(tmp_path / "timings.json"),
         "--baseline-metrics", "data/metrics/baseline_eval.json", "--report", str(report)],
        pipeline_repo)

    post = read_records(out / "records.jsonl")
    metrics = json.loads(metrics_path.read_text())
    assert [r["pid"] for r in post] == [r["pid"] for r in baseline]
    assert any(p["response"] != b["response"] for p, b in zip(post, baseline)), \
        "the adapter did not change a single response"
    assert_metrics_match_records(metrics, post, tmp_path / "timings.json")
    assert_report_shows_flips(report, baseline, post)
    assert len(expected_flips(baseline, post)["right_to_wrong"]) >= 1
    assert metrics["vs_baseline"]["right_to_wrong"] == len(expected_flips(baseline, post)["right_to_wrong"])


@pytest.mark.slow
def test_post_eval_through_dvc(pipeline_repo):
    if not (ROOT / "stages" / "train_gspo.py").is_file():
        pytest.skip("stages/train_gspo.py is not written yet")
    dvc_repro(pipeline_repo, "post_eval")
    baseline = read_records(pipeline_repo / "data/eval/baseline/records.jsonl")
    post = read_records(pipeline_repo / "data/eval/post/records.jsonl")
    metrics = json.loads((pipeline_repo / "data/reports/details/post_eval.json").read_text())
    assert_metrics_match_records(metrics, post,
                                 pipeline_repo / "data/reports/timings/post_eval.json")
    assert_report_shows_flips(pipeline_repo / "data/reports/eval", baseline, post)
    diff = json.loads(run(["dvc", "metrics", "diff", "--json"], pipeline_repo).stdout)
    assert "data/metrics/post_eval.json" in diff
    assert "accuracy" in diff["data/metrics/post_eval.json"]
