"""`vlmrl ui`: a local web app for iterating on reward design by looking at completions.

What RL learns is decided by the rewards, so the page must show the numbers training sees, not
a look-alike: every score comes from `vlmrl.rewards.score_completion` through a JSON endpoint,
with the weights and options read from the repo's params.yaml on each request (edit params.yaml,
and the next keystroke shows the effect). The eval browser reads the records and metrics that
baseline_eval and post_eval wrote, and pairs them with `vlmrl.eval_report.find_flips`, so a
"flip" here is a flip in the post_eval report.

Deliberate choices:
- 127.0.0.1 only, and no --host option: the app reads the repo and has no authentication.
  Requests whose Host header is not loopback are refused too, so a web page cannot reach the
  app through DNS rebinding.
- Input is checked here, before scoring, and every problem is a 4xx JSON `{"error": ...}` that
  names the field; the page shows it. A completion over `MAX_COMPLETION_BYTES` is a 413, and the
  request body is read in chunks and abandoned past its cap, so megabytes cost nothing.
- A missing or broken pipeline output is not a crash either: the message names the file and
  the `dvc repro` command that makes it (404 when missing, 503 when unreadable).
- The prepared eval set (images, questions) loads lazily, once: importing `datasets` takes
  seconds, and the calculator never needs it.
- No front-end build: plain HTML, CSS and JS under assets/ui/, and the page writes model output
  with textContent only (a Content-Security-Policy backs that up).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping
from numbers import Real
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from vlmrl.config import ParamsError, load_params, section
from vlmrl.eval_report import find_flips, headline_rows
from vlmrl.rewards import RECORD_COLUMNS, build_rewards_from_params, score_completion

__all__ = ["MAX_COMPLETION_BYTES", "ApiError", "EvalSet", "cli_ui", "create_app",
           "parse_completion", "parse_record"]

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8765
MAX_COMPLETION_BYTES = 1_000_000
# JSON escaping can grow text up to 6x ("\u0001"); the record adds a little.
MAX_BODY_BYTES = 6 * MAX_COMPLETION_BYTES + 64_000
IMAGE_CACHE_SIZE = 64
ASSETS = Path(__file__).parent / "assets" / "ui"
CONTENT_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data:; style-src 'self'; "
                           "script-src 'self'; connect-src 'self'; object-src 'none'; "
                           "base-uri 'none'; frame-ancestors 'none'")

PARAMS_FILE = "params.yaml"
EVAL_SET_DIR = "data/prepared/eval"
# name -> (path relative to the repo, the stage that writes it)
EVAL_FILES = {
    "baseline_records": ("data/eval/baseline/records.jsonl", "baseline_eval"),
    "post_records": ("data/eval/post/records.jsonl", "post_eval"),
    "baseline_metrics": ("data/metrics/baseline_eval.json", "baseline_eval"),
    "post_metrics": ("data/metrics/post_eval.json", "post_eval"),
}

QUESTION_TYPES = ("free_form", "multi_choice")
ANSWER_TYPES = ("integer", "float", "text", "list")
RECORD_FIELDS = (*RECORD_COLUMNS, "pid", "question", "category", "source")
CHANGES = ("wrong_to_right", "right_to_wrong", "still_right", "still_wrong",
           "only_in_baseline", "only_in_post")
CHANGE_FILTERS = ("all", "flipped", *CHANGES)


class ApiError(Exception):
    """An answer for the page: HTTP status, a message naming the field or file, extra keys."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


def error_response(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def finite(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become null (metrics files may hold them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_response(payload: Any) -> JSONResponse:
    return JSONResponse(finite(payload))


# -------------------------------------------------------------------- input


async def read_capped_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body is over {limit:,} bytes ({size:,} read); the completion "
                         f"may be at most {MAX_COMPLETION_BYTES:,} bytes", field="completion")


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object with `completion` and `record`")
    unknown = sorted(set(payload) - {"completion", "record"})
    if unknown:
        raise ApiError(422, f"unknown field(s) {', '.join(unknown)}; expected completion, record",
                       field=unknown[0])
    return payload


def parse_completion(value: Any) -> str:
    if value is None:
        raise ApiError(422, "completion is missing", field="completion")
    if not isinstance(value, str):
        raise ApiError(422, f"completion must be a string, got {json_type(value)}",
                       field="completion")
    if not value.strip():
        raise ApiError(422, "completion is empty: paste or type a model response",
                       field="completion")
    size = len(value.encode("utf-8", errors="replace"))
    if size > MAX_COMPLETION_BYTES:
        raise ApiError(413, f"completion is {size:,} bytes; the limit is "
                            f"{MAX_COMPLETION_BYTES:,} bytes (1 MB)", field="completion")
    return value


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def optional_string(record: Mapping[str, Any], name: str) -> str | None:
    value = record.get(name)
    if value is None or isinstance(value, str):
        return value
    raise ApiError(422, f"record.{name} must be a string or null, got {json_type(value)}",
                   field=f"record.{name}")


def choice_of(record: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    value = record.get(name)
    if value not in allowed:
        raise ApiError(422, f"record.{name} must be one of {', '.join(allowed)}, got "
                            f"{json.dumps(value)}", field=f"record.{name}")
    return value


def parse_choices(record: Mapping[str, Any], question_type: str) -> list[str] | None:
    choices = record.get("choices")
    if choices is None or choices == []:
        if question_type == "multi_choice":
            raise ApiError(422, "record.choices must list the options of a multi_choice question",
                           field="record.choices")
        return None
    if not isinstance(choices, list):
        raise ApiError(422, f"record.choices must be a list of strings, got {json_type(choices)}",
                       field="record.choices")
    bad = [i for i, choice in enumerate(choices) if not isinstance(choice, str)]
    if bad:
        raise ApiError(422, f"record.choices[{bad[0]}] must be a string, got "
                            f"{json_type(choices[bad[0]])}", field="record.choices")
    return choices


def parse_precision(record: Mapping[str, Any]) -> float | None:
    value = record.get("precision")
    if value is None:
        return None
    valid = isinstance(value, Real) and not isinstance(value, bool)
    if not (valid and math.isfinite(value) and value >= 0 and value == int(value)):
        raise ApiError(422, f"record.precision must be a whole number of decimal places (0, 1, "
                            f"2, ...) or null, got {json.dumps(value)}", field="record.precision")
    return float(value)


def parse_record(value: Any) -> dict[str, Any]:
    """A gold record `score_completion` accepts; a 422 naming the first bad field otherwise."""
    if not isinstance(value, dict):
        raise ApiError(422, f"record must be an object, got {json_type(value)}", field="record")
    unknown = sorted(set(value) - set(RECORD_FIELDS))
    if unknown:
        names = ", ".join(f"record.{name}" for name in unknown)
        raise ApiError(422, f"unknown field(s) {names}; a record has "
                            f"{', '.join(RECORD_FIELDS)}", field=f"record.{unknown[0]}")
    answer = optional_string(value, "answer")
    if answer is None or not answer.strip():
        raise ApiError(422, "record.answer (the gold answer) is empty", field="record.answer")
    question_type = choice_of(value, "question_type", QUESTION_TYPES)
    return {
        "answer": answer,
        "question_type": question_type,
        "answer_type": choice_of(value, "answer_type", ANSWER_TYPES),
        "choices": parse_choices(value, question_type),
        "precision": parse_precision(value),
        "unit": optional_string(value, "unit"),
    }


# ------------------------------------------------------------------- params


def reward_config(repo: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(weights, per-reward options) from params.yaml, checked as training checks them."""
    try:
        rewards = section(load_params(repo / PARAMS_FILE), "rewards")
        build_rewards_from_params(rewards)
    except (ParamsError, ValueError, TypeError) as error:
        raise ApiError(503, f"{PARAMS_FILE}: {error}", field="params.yaml") from None
    options = {name: value for name, value in rewards.items() if name != "weights"}
    return dict(rewards.get("weights") or {}), options


# ----------------------------------------------------------------- eval data


def missing_outputs(repo: Path) -> list[tuple[str, str]]:
    return [(path, stage) for path, stage in EVAL_FILES.values() if not (repo / path).is_file()]


def missing_message(missing: list[tuple[str, str]]) -> str:
    files = "; ".join(f"{path} (written by {stage})" for path, stage in missing)
    return (f"No before/after evaluation yet: missing {files}. Run `dvc repro post_eval` "
            f"(it runs prepare_data, baseline_eval and train_gspo first when needed).")


def corrupt(path: str, stage: str, problem: str) -> ApiError:
    return ApiError(503, f"{path}: {problem}; re-run `dvc repro {stage}`", file=path)


def read_jsonl(repo: Path, path: str, stage: str) -> list[dict[str, Any]]:
    records = []
    text = (repo / path).read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise corrupt(path, stage, f"line {number} is not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "pid" not in record:
            raise corrupt(path, stage, f"line {number} is not a record with a pid")
        records.append(record)
    return records


def read_metrics(repo: Path, path: str, stage: str) -> dict[str, Any]:
    try:
        metrics = json.loads((repo / path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise corrupt(path, stage, f"not JSON ({error})") from None
    if not isinstance(metrics, dict):
        raise corrupt(path, stage, "not a JSON object")
    return metrics


def change_of(pid: str, flips: Mapping[str, list[str]], baseline: Mapping[str, Any]) -> str:
    for kind in ("wrong_to_right", "right_to_wrong", "only_in_baseline", "only_in_post"):
        if pid in flips[kind]:
            return kind
    return "still_right" if baseline[pid].get("correct") else "still_wrong"


def paired_rows(baseline_records: list[dict], post_records: list[dict]) -> list[dict[str, Any]]:
    """One row per pid (baseline order, then post-only pids) with both records and the change."""
    flips = {kind: set(pids) for kind, pids in find_flips(baseline_records, post_records).items()}
    baseline = {str(r["pid"]): r for r in baseline_records}
    post = {str(r["pid"]): r for r in post_records}
    rows = []
    for pid in dict.fromkeys([*baseline, *post]):
        either = baseline.get(pid) or post[pid]
        rows.append({"pid": pid, "change": change_of(pid, flips, baseline),
                     **{key: either.get(key) for key in
                        ("question_type", "answer_type", "category", "source", "gold")},
                     "baseline": baseline.get(pid), "post": post.get(pid)})
    return rows


def matches(row: Mapping[str, Any], change: str, question_type: str, category: str) -> bool:
    if change == "flipped" and row["change"] not in ("wrong_to_right", "right_to_wrong"):
        return False
    if change not in ("all", "flipped") and row["change"] != change:
        return False
    if question_type and str(row["question_type"]) != question_type:
        return False
    return not category or str(row["category"]) == category


def headline(baseline_metrics: Mapping[str, Any], post_metrics: Mapping[str, Any]) -> list[dict]:
    rows = [{"key": "n", "label": "Samples", "baseline": baseline_metrics.get("n"),
             "post": post_metrics.get("n"), "delta": None}]
    for row in headline_rows(baseline_metrics, post_metrics):
        numeric = all(isinstance(v, Real) for v in (row.before, row.after))
        rows.append({"key": row.key, "label": row.label, "baseline": row.before,
                     "post": row.after, "delta": row.delta if numeric else None})
    return rows


def facet_values(rows: list[dict[str, Any]], key: str) -> list[str]:
    return sorted({str(row[key]) for row in rows if row[key] is not None})


def eval_view(repo: Path, change: str, question_type: str, category: str) -> dict[str, Any]:
    """The eval browser's data: headline metrics, change counts, facets and the filtered rows."""
    if change not in CHANGE_FILTERS:
        raise ApiError(400, f"change must be one of {', '.join(CHANGE_FILTERS)}, got "
                            f"{json.dumps(change)}", field="change")
    missing = missing_outputs(repo)
    if missing:
        raise ApiError(404, missing_message(missing), stage="post_eval",
                       missing=[path for path, _stage in missing])
    loaded = {name: (read_jsonl if name.endswith("records") else read_metrics)(repo, *spec)
              for name, spec in EVAL_FILES.items()}
    rows = paired_rows(loaded["baseline_records"], loaded["post_records"])
    return {
        "headline": headline(loaded["baseline_metrics"], loaded["post_metrics"]),
        "counts": {kind: sum(row["change"] == kind for row in rows) for kind in CHANGES},
        "question_types": facet_values(rows, "question_type"),
        "categories": facet_values(rows, "category"),
        "total": len(rows),
        "rows": [row for row in rows if matches(row, change, question_type, category)],
    }


class EvalSet:
    """The prepared eval set (`datasets.load_from_disk`), loaded on first use and kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._dataset = None
        self._index: dict[str, int] = {}
        self._records: list[dict[str, Any]] = []
        self._images: OrderedDict[str, bytes] = OrderedDict()

    def _load(self):
        with self._lock:
            if self._dataset is None:
                self._dataset = self._open()
                self._index = {str(pid): i for i, pid in enumerate(self._dataset["pid"])}
                self._records = [gold_record(row) for row in
                                 self._dataset.remove_columns(["image"]).to_list()]
        return self._dataset

    def _open(self):
        if not self.path.is_dir():
            raise ApiError(404, f"No prepared eval set at {EVAL_SET_DIR}: run "
                                f"`dvc repro prepare_data`", stage="prepare_data")
        from datasets import load_from_disk

        try:
            dataset = load_from_disk(str(self.path))
        except Exception as error:  # noqa: BLE001 - any unreadable dataset gets one message
            raise ApiError(503, f"{EVAL_SET_DIR}: cannot load the eval set ({error}); re-run "
                                f"`dvc repro prepare_data`", stage="prepare_data") from None
        if "pid" not in dataset.column_names or "image" not in dataset.column_names:
            raise ApiError(503, f"{EVAL_SET_DIR} lacks a pid or image column; re-run "
                                f"`dvc repro prepare_data`", stage="prepare_data")
        return dataset

    def records(self) -> list[dict[str, Any]]:
        self._load()
        return self._records

    def questions(self) -> dict[str, str | None]:
        """pid -> question text; empty when the eval set is not there (the browser still works)."""
        try:
            return {r["pid"]: r["question"] for r in self.records()}
        except ApiError:
            return {}

    def image_png(self, pid: str) -> bytes:
        dataset = self._load()
        with self._lock:
            if pid in self._images:
                self._images.move_to_end(pid)
                return self._images[pid]
        if pid not in self._index:
            raise ApiError(404, f"no record with pid {pid!r} in {EVAL_SET_DIR}", field="pid")
        png = png_bytes(dataset[self._index[pid]]["image"])
        with self._lock:
            self._images[pid] = png
            if len(self._images) > IMAGE_CACHE_SIZE:
                self._images.popitem(last=False)
        return png


def png_bytes(image) -> bytes:
    if image.mode not in ("1", "L", "LA", "P", "RGB", "RGBA"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def question_text(prompt: Any) -> str | None:
    """The text part of the user message of a conversational prompt."""
    for message in prompt or []:
        if isinstance(message, Mapping) and message.get("role") == "user":
            parts = message.get("content") or []
            return "\n".join(p.get("text") or "" for p in parts
                             if isinstance(p, Mapping) and p.get("type") == "text") or None
    return None


def gold_record(row: Mapping[str, Any]) -> dict[str, Any]:
    record = {key: row.get(key) for key in RECORD_FIELDS if key != "question"}
    record["pid"] = str(row.get("pid"))
    record["question"] = question_text(row.get("prompt"))
    return record


# --------------------------------------------------------------------- app


def create_app(repo_dir: Path) -> Starlette:
    """The web app over one repository (params.yaml, data/eval, data/metrics, data/prepared)."""
    repo = Path(repo_dir).resolve()
    eval_set = EvalSet(repo / EVAL_SET_DIR)

    async def index(request: Request) -> Response:
        return FileResponse(ASSETS / "index.html",
                            headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                     "Cache-Control": "no-cache"})

    def config(request: Request) -> Response:
        try:
            weights, options = reward_config(repo)
        except ApiError as error:
            weights, options = {}, {"error": error.message}
        return json_response({"repo": str(repo), "weights": weights, "options": options,
                              "max_completion_bytes": MAX_COMPLETION_BYTES,
                              "question_types": QUESTION_TYPES, "answer_types": ANSWER_TYPES})

    async def score(request: Request) -> Response:
        payload = parse_json_object(await read_capped_body(request, MAX_BODY_BYTES))
        completion = parse_completion(payload.get("completion"))
        record = parse_record(payload.get("record"))
        weights, options = reward_config(repo)
        result = await run_in_threadpool(score_completion, completion, record, weights, options)
        return json_response({**result, "options": options, "record": record,
                              "completion_chars": len(completion)})

    def records(request: Request) -> Response:
        return json_response({"records": eval_set.records()})

    def evaluation(request: Request) -> Response:
        query = request.query_params
        view = eval_view(repo, query.get("change", "all"), query.get("question_type", ""),
                         query.get("category", ""))
        questions = eval_set.questions()
        for row in view["rows"]:
            row["question"] = questions.get(row["pid"])
        return json_response(view)

    def image(request: Request) -> Response:
        png = eval_set.image_png(request.path_params["pid"])
        return Response(png, media_type="image/png", headers={"Cache-Control": "max-age=300"})

    async def api_error(request: Request, error: ApiError) -> Response:
        return error_response(error.status, error.message, **error.extra)

    async def http_error(request: Request, error: HTTPException) -> Response:
        return error_response(error.status_code, f"{request.method} {request.url.path}: "
                                                 f"{error.detail}")

    routes = [
        Route("/", index),
        Route("/api/config", config),
        Route("/api/score", score, methods=["POST"]),
        Route("/api/records", records),
        Route("/api/eval", evaluation),
        Route("/api/image/{pid:path}", image),
        Mount("/static", StaticFiles(directory=ASSETS), name="static"),
    ]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=[LOOPBACK, "localhost"])]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={ApiError: api_error, HTTPException: http_error})


# --------------------------------------------------------------------- CLI


def loopback_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vlmrl ui", description="Reward calculator and eval browser on "
                                     f"http://{LOOPBACK}:PORT (loopback only).")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port on {LOOPBACK} (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--repo", type=Path, default=Path("."),
                        help="project directory holding params.yaml and data/ (default: .)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {args.port}")
    if not args.repo.is_dir():
        parser.error(f"--repo {args.repo}: not a directory")
    return args


def cli_ui(argv: list[str]) -> int:
    import uvicorn

    args = parse_args(argv)
    repo = args.repo.resolve()
    if not (repo / PARAMS_FILE).is_file():
        print(f"vlmrl ui: warning: {repo / PARAMS_FILE} not found; scoring will say so",
              file=sys.stderr)
    try:
        sock = loopback_socket(args.port)
    except OSError as error:
        print(f"vlmrl ui: cannot listen on {LOOPBACK}:{args.port}: {error.strerror or error}",
              file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    print(f"vlmrl ui: serving {repo} on http://{LOOPBACK}:{port}/ (Ctrl-C stops)", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(repo), log_level="warning"))
    server.run(sockets=[sock])
    return 0
