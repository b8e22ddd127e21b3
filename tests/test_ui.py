"""The JSON endpoints of `vlmrl ui`: scores equal `score_completion` with params.yaml's weights,
bad input is a 4xx naming the field, and the eval browser pairs and filters hand-made records."""

from __future__ import annotations

import io
import json
import socket
import warnings
from pathlib import Path

import pytest
import yaml
from PIL import Image

from vlmrl.params import load_params
from vlmrl.rewards.functions import score_completion
from vlmrl.ui.app import MAX_BODY_BYTES, cli_ui, create_app
from vlmrl.ui.requests import MAX_COMPLETION_BYTES

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette asks for httpx2; httpx works the same here
    from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = {"format_reward": 0.5, "correctness_reward": 2.0, "length_penalty": 0.25}
OPTIONS = {"length_penalty": {"min_chars": 10, "max_chars": 80}}
GOOD = "<REASONING>7 + 5 = 12</REASONING><SOLUTION>12</SOLUTION>"
INTEGER_RECORD = {"answer": "12", "question_type": "free_form", "answer_type": "integer",
                  "choices": None, "precision": None, "unit": None}


def write_params(repo: Path, weights: dict, options: dict) -> None:
    rewards = {"weights": weights, **options}
    (repo / "params.yaml").write_text(yaml.safe_dump({"rewards": rewards}, sort_keys=False))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_params(tmp_path, WEIGHTS, OPTIONS)
    return tmp_path


def client_for(repo: Path) -> TestClient:
    return TestClient(create_app(repo), base_url="http://127.0.0.1")


@pytest.fixture
def client(repo: Path) -> TestClient:
    return client_for(repo)


def post_score(client: TestClient, completion, record=INTEGER_RECORD):
    return client.post("/api/score", json={"completion": completion, "record": record})


# ------------------------------------------------------------------ scoring

SCORED_CASES = [
    (GOOD, INTEGER_RECORD),
    ("<SOLUTION>13</SOLUTION>", INTEGER_RECORD),
    ("no tags at all, just a long ramble " * 4, INTEGER_RECORD),
    ("<REASONING>r</REASONING><SOLUTION>3.14159 cm</SOLUTION>",
     {"answer": "3.14", "question_type": "free_form", "answer_type": "float", "precision": 2,
      "unit": "cm"}),
    ("<REASONING>look</REASONING><SOLUTION>(B)</SOLUTION>",
     {"answer": "145°", "question_type": "multi_choice", "answer_type": "text",
      "choices": ["90°", "145°", "30°"]}),
    # A gold answer that is not an integer: correctness_reward is None (no signal).
    (GOOD, {"answer": "twelve", "question_type": "free_form", "answer_type": "integer"}),
]


@pytest.mark.parametrize(("completion", "record"), SCORED_CASES)
def test_score_equals_score_completion_with_params_weights(client, completion, record):
    response = post_score(client, completion, record)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = score_completion(completion, record, WEIGHTS, OPTIONS)
    for key, value in expected.items():
        assert body[key] == value, key
    assert body["weights"] == WEIGHTS
    assert body["options"] == OPTIONS
    assert body["completion_chars"] == len(completion)


def test_weights_come_from_the_repo_params_and_are_reread(repo, client):
    first = post_score(client, GOOD).json()
    assert first["total"] == pytest.approx(0.5 * 2.0 + 2.0 * 2.0 + 0.25 * 0.0)
    write_params(repo, {"correctness_reward": 3.0}, {})
    second = post_score(client, GOOD).json()
    assert second["weights"] == {"correctness_reward": 3.0}
    assert set(second["rewards"]) == {"correctness_reward"}
    assert second["total"] == pytest.approx(6.0)


def test_broken_params_is_a_clear_error_not_a_crash(repo, client):
    write_params(repo, {"no_such_reward": 1.0}, {})
    response = post_score(client, GOOD)
    assert response.status_code == 503
    assert "params.yaml" in response.json()["error"]
    assert "no_such_reward" in response.json()["error"]
    (repo / "params.yaml").unlink()
    response = post_score(client, GOOD)
    assert response.status_code == 503 and "params.yaml" in response.json()["error"]
    assert "params.yaml" in client.get("/api/config").json()["options"]["error"]


def test_config_reports_params_weights_and_options(client):
    config = client.get("/api/config").json()
    assert config["weights"] == WEIGHTS
    assert config["options"] == OPTIONS
    assert config["max_completion_bytes"] == MAX_COMPLETION_BYTES


def test_config_offers_a_worked_example_that_scores_with_the_params_weights(client):
    example = client.get("/api/config").json()["example"]
    response = post_score(client, example["completion"], example["record"])
    assert response.status_code == 200, response.text
    body = response.json()
    expected = score_completion(example["completion"], example["record"], WEIGHTS, OPTIONS)
    assert {key: body[key] for key in expected} == expected
    assert body["correct"] is True and body["format_ok"] is True
    assert set(body["rewards"]) == set(WEIGHTS) and None not in body["rewards"].values()
    assert example["record"]["question"]


def test_the_project_playground_opens_with_params_yaml_weights_and_a_correct_example():
    project = client_for(ROOT)
    config = project.get("/api/config").json()
    weights = dict(load_params(ROOT / "params.yaml").rewards.weights)
    assert weights and config["weights"] == weights
    example = config["example"]
    body = post_score(project, example["completion"], example["record"]).json()
    assert body["weights"] == weights
    assert body["correct"] is True and body["format_ok"] is True
    assert body["total"] > 0


# ---------------------------------------------------------------- bad input

BAD_INPUT = [
    ({"completion": "", "record": INTEGER_RECORD}, 422, "completion"),
    ({"completion": "  \n ", "record": INTEGER_RECORD}, 422, "completion"),
    ({"record": INTEGER_RECORD}, 422, "completion"),
    ({"completion": 42, "record": INTEGER_RECORD}, 422, "completion"),
    ({"completion": GOOD}, 422, "record"),
    ({"completion": GOOD, "record": ["12"]}, 422, "record"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "answer_type": "decimal"}}, 422,
     "record.answer_type"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "question_type": None}}, 422,
     "record.question_type"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "choices": "A, B"}}, 422,
     "record.choices"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "choices": ["A", 2]}}, 422,
     "record.choices"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "question_type": "multi_choice"}}, 422,
     "record.choices"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "precision": "two"}}, 422,
     "record.precision"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "precision": -1}}, 422,
     "record.precision"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "precision": True}}, 422,
     "record.precision"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "answer": ""}}, 422, "record.answer"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "answer": 12}}, 422, "record.answer"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "unit": 5}}, 422, "record.unit"),
    ({"completion": GOOD, "record": {**INTEGER_RECORD, "answr": "12"}}, 422, "record.answr"),
    ({"completion": GOOD, "record": INTEGER_RECORD, "weights": {}}, 422, "weights"),
]


@pytest.mark.parametrize(("payload", "status", "field"), BAD_INPUT)
def test_bad_input_is_a_4xx_naming_the_field(client, payload, status, field):
    response = client.post("/api/score", json=payload)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["field"] == field
    assert field in body["error"]


@pytest.mark.parametrize("body", [b"{not json", b'["a list"]', b"\xff\xfe"])
def test_body_that_is_not_a_json_object_is_a_400(client, body):
    response = client.post("/api/score", content=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]


def test_two_megabyte_completion_is_413_naming_the_limit(client):
    response = post_score(client, "x" * 2_000_000)
    assert response.status_code == 413
    assert response.json()["field"] == "completion"
    assert f"{MAX_COMPLETION_BYTES:,}" in response.json()["error"]


def test_completion_limit_counts_utf8_bytes_up_to_the_exact_limit(client):
    assert post_score(client, "a" * MAX_COMPLETION_BYTES).status_code == 200
    assert post_score(client, "a" * (MAX_COMPLETION_BYTES + 1)).status_code == 413
    # 600,000 characters, 1,200,000 bytes
    assert post_score(client, "é" * 600_000).status_code == 413


def test_oversized_body_is_refused_before_it_is_parsed(client):
    body = b'{"completion": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}'
    response = client.post("/api/score", content=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert "completion" in response.json()["error"]


def test_non_loopback_host_header_is_refused(repo):
    outside = TestClient(create_app(repo), base_url="http://attacker.example")
    assert outside.post("/api/score", json={"completion": GOOD,
                                            "record": INTEGER_RECORD}).status_code == 400


def test_page_and_assets_are_served_with_a_content_security_policy(client):
    page = client.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/style.css").status_code == 200
    missing = client.get("/api/nothing")
    assert missing.status_code == 404 and "/api/nothing" in missing.json()["error"]


# ---------------------------------------------------------------- eval data


def eval_record(pid: str, correct: bool, **extra) -> dict:
    return {"pid": pid, "question_type": "free_form", "answer_type": "integer",
            "category": "math-word-problem", "source": "synthetic", "gold": "7",
            "response": f"<SOLUTION>{7 if correct else 3}</SOLUTION>",
            "extracted": "7" if correct else "3", "normalized": "7" if correct else "3",
            "correct": correct, "format_ok": False, "reward_format_reward": 1.0,
            "reward_correctness_reward": 2.0 if correct else 0.0, "reward_length_penalty": -1.0,
            "reward_total": 1.3 if correct else -0.7, "generated_tokens": 9, **extra}


BASELINE = [eval_record("p1", False), eval_record("p2", True),
            eval_record("p3", True, question_type="multi_choice", category="geometry"),
            eval_record("p4", False, category="geometry"), eval_record("p5", False)]
POST = [eval_record("p1", True), eval_record("p2", False),
        eval_record("p3", True, question_type="multi_choice", category="geometry"),
        eval_record("p4", False, category="geometry"), eval_record("p6", True)]
BASELINE_METRICS = {"n": 5, "accuracy": 0.4, "format_compliance": 0.0, "mean_reward": 0.1}
POST_METRICS = {"n": 5, "accuracy": 0.6, "format_compliance": 0.2, "mean_reward": 0.5}


def write_eval_outputs(repo: Path, baseline=BASELINE, post=POST,
                       baseline_metrics=BASELINE_METRICS, post_metrics=POST_METRICS) -> None:
    files = {"data/eval/baseline/records.jsonl": "".join(json.dumps(r) + "\n" for r in baseline),
             "data/eval/post/records.jsonl": "".join(json.dumps(r) + "\n" for r in post),
             "data/metrics/baseline_eval.json": json.dumps(baseline_metrics),
             "data/metrics/post_eval.json": json.dumps(post_metrics)}
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)


def shown_pids(client: TestClient, **query) -> list[str]:
    response = client.get("/api/eval", params=query)
    assert response.status_code == 200, response.text
    return [row["pid"] for row in response.json()["rows"]]


@pytest.mark.parametrize(("change", "pids"), [
    ("wrong_to_right", ["p1"]), ("right_to_wrong", ["p2"]), ("flipped", ["p1", "p2"]),
    ("still_right", ["p3"]), ("still_wrong", ["p4"]), ("only_in_baseline", ["p5"]),
    ("only_in_post", ["p6"]), ("all", ["p1", "p2", "p3", "p4", "p5", "p6"]),
])
def test_change_filter_returns_exactly_those_pids(repo, client, change, pids):
    write_eval_outputs(repo)
    assert shown_pids(client, change=change) == pids


def test_question_type_and_category_filters_combine_with_the_change(repo, client):
    write_eval_outputs(repo)
    assert shown_pids(client, question_type="multi_choice") == ["p3"]
    assert shown_pids(client, category="geometry") == ["p3", "p4"]
    assert shown_pids(client, category="geometry", change="still_wrong") == ["p4"]
    assert shown_pids(client, category="geometry", change="flipped") == []


def test_eval_view_pairs_records_and_reports_headline_counts_and_facets(repo, client):
    write_eval_outputs(repo)
    view = client.get("/api/eval").json()
    assert view["counts"] == {"wrong_to_right": 1, "right_to_wrong": 1, "still_right": 1,
                              "still_wrong": 1, "only_in_baseline": 1, "only_in_post": 1}
    assert view["question_types"] == ["free_form", "multi_choice"]
    assert view["categories"] == ["geometry", "math-word-problem"]
    row = view["rows"][0]
    assert row["baseline"] == BASELINE[0] and row["post"] == POST[0]
    assert view["rows"][4]["post"] is None and view["rows"][5]["baseline"] is None
    headline = {h["key"]: h for h in view["headline"]}
    assert headline["n"]["baseline"] == 5
    assert headline["accuracy"]["delta"] == pytest.approx(0.2)
    assert headline["mean_reward"]["post"] == 0.5


def test_unknown_change_filter_is_a_400_naming_it(repo, client):
    write_eval_outputs(repo)
    response = client.get("/api/eval", params={"change": "sideways"})
    assert response.status_code == 400
    assert response.json()["field"] == "change" and "sideways" in response.json()["error"]


def test_missing_eval_outputs_name_the_files_and_the_stage_to_run(repo, client):
    response = client.get("/api/eval")
    assert response.status_code == 404
    assert "dvc repro post_eval" in response.json()["error"]
    assert len(response.json()["missing"]) == 4
    write_eval_outputs(repo)
    (repo / "data/eval/post/records.jsonl").unlink()
    response = client.get("/api/eval")
    assert response.json()["missing"] == ["data/eval/post/records.jsonl"]
    assert "data/eval/post/records.jsonl (written by post_eval)" in response.json()["error"]


def test_corrupt_records_and_nan_metrics_are_reported_not_crashed(repo, client):
    write_eval_outputs(repo, post_metrics={**POST_METRICS, "mean_reward": float("nan")})
    view = client.get("/api/eval").json()
    assert {h["key"]: h for h in view["headline"]}["mean_reward"]["post"] is None
    path = repo / "data/eval/baseline/records.jsonl"
    path.write_text(path.read_text() + "{truncated\n")
    response = client.get("/api/eval")
    assert response.status_code == 503
    assert "data/eval/baseline/records.jsonl: line 6" in response.json()["error"]
    assert "dvc repro baseline_eval" in response.json()["error"]


# ---------------------------------------------------------------- eval set

IMAGE_COLOURS = {"p1": (200, 30, 30), "p2": (30, 200, 30)}


def save_eval_set(target: Path) -> None:
    from datasets import disable_progress_bars

    from vlmrl.data.prepare import to_dataset, to_row
    from vlmrl.data.prompts import SYSTEM_PROMPT

    disable_progress_bars()

    rows = []
    for index, (pid, colour) in enumerate(IMAGE_COLOURS.items()):
        record = {"pid": pid, "question": f"How many apples in picture {index}?", "answer": "7",
                  "question_type": "free_form", "answer_type": "integer", "choices": None,
                  "precision": None, "unit": None, "source": "synthetic",
                  "category": "math-word-problem",
                  "image": Image.new("RGB", (40 + index, 30), colour)}
        rows.append(to_row(record, SYSTEM_PROMPT))
    to_dataset(rows).save_to_disk(str(target))


@pytest.fixture(scope="module")
def eval_set_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prepared") / "eval"
    save_eval_set(path)
    return path


def link_eval_set(repo: Path, eval_set_dir: Path) -> None:
    (repo / "data/prepared").mkdir(parents=True, exist_ok=True)
    (repo / "data/prepared/eval").symlink_to(eval_set_dir, target_is_directory=True)


def test_image_endpoint_serves_the_eval_set_image_as_png(repo, client, eval_set_dir):
    link_eval_set(repo, eval_set_dir)
    for index, (pid, colour) in enumerate(IMAGE_COLOURS.items()):
        response = client.get(f"/api/image/{pid}")
        assert response.status_code == 200 and response.headers["content-type"] == "image/png"
        image = Image.open(io.BytesIO(response.content))
        assert image.format == "PNG" and image.size == (40 + index, 30)
        assert image.convert("RGB").getpixel((0, 0)) == colour
    unknown = client.get("/api/image/nope")
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]


def test_records_endpoint_lists_gold_records_with_question_text(repo, client, eval_set_dir):
    link_eval_set(repo, eval_set_dir)
    records = client.get("/api/records").json()["records"]
    assert [r["pid"] for r in records] == ["p1", "p2"]
    assert records[0]["answer"] == "7" and records[0]["answer_type"] == "integer"
    assert records[0]["question"].startswith("How many apples in picture 0?")
    scored = post_score(client, GOOD, {k: records[0][k] for k in INTEGER_RECORD})
    assert scored.status_code == 200, scored.text


def test_eval_rows_carry_the_question_when_the_eval_set_exists(repo, client, eval_set_dir):
    link_eval_set(repo, eval_set_dir)
    write_eval_outputs(repo)
    rows = {row["pid"]: row for row in client.get("/api/eval").json()["rows"]}
    assert rows["p1"]["question"].startswith("How many apples in picture 0?")
    assert rows["p3"]["question"] is None


def test_missing_eval_set_names_prepare_data(repo, client):
    write_eval_outputs(repo)
    for url in ("/api/records", "/api/image/p1"):
        response = client.get(url)
        assert response.status_code == 404
        assert "dvc repro prepare_data" in response.json()["error"]
    assert client.get("/api/eval").status_code == 200


# -------------------------------------------------------------------- CLI


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--repo", "/no/such/dir"],
                                  ["--host", "0.0.0.0"]])
def test_cli_refuses_bad_arguments_and_offers_no_host(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_ui(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_cli_reports_a_busy_port_instead_of_a_traceback(repo, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_ui(["--port", str(port), "--repo", str(repo)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
