"""`vlmrl ui`: a local web app for iterating on reward design by looking at completions.

What RL learns is decided by the rewards, so the page must show the numbers training sees, not
a look-alike: every score comes from `vlmrl.rewards.functions.score_completion` through a JSON endpoint,
with the weights and options read from the repo's params.yaml on each request (edit params.yaml,
and the next keystroke shows the effect). The page opens with params.yaml's weights shown and
a worked example (`vlmrl.ui.example`) already scored. This module is the Starlette app, its
routes and the server; the request models live in `vlmrl.ui.requests`, the eval browser's data
in `vlmrl.ui.browser`.

Deliberate choices:
- 127.0.0.1 only, and no --host option: the app reads the repo and has no authentication.
  Requests whose Host header is not loopback are refused too, so a web page cannot reach the
  app through DNS rebinding.
- Input is checked before scoring, and every problem is a 4xx JSON `{"error": ...}` that
  names the field; the page shows it. A completion over `MAX_COMPLETION_BYTES` is a 413, and the
  request body is read in chunks and abandoned past its cap, so megabytes cost nothing.
- A missing or broken pipeline output is not a crash either: the message names the file and
  the `dvc repro` command that makes it.
- No front-end build: plain HTML, CSS and JS under assets/ui/, and the page writes model output
  with textContent only (a Content-Security-Policy backs that up).
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
from collections.abc import Mapping
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

from vlmrl.params import ParamsError, load_params
from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat, answer_format
from vlmrl.rewards.functions import build_rewards, score_completion
from vlmrl.ui.browser import EVAL_SET_DIR, EvalSet, eval_view
from vlmrl.ui.errors import ApiError
from vlmrl.ui.example import worked_example
from vlmrl.ui.requests import (
    ANSWER_TYPES,
    MAX_COMPLETION_BYTES,
    QUESTION_TYPES,
    parse_score_request,
)

__all__ = ["MAX_BODY_BYTES", "cli_ui", "create_app"]

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8765
# JSON escaping can grow text up to 6x ("\u0001"); the record adds a little.
MAX_BODY_BYTES = 6 * MAX_COMPLETION_BYTES + 64_000
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "ui"
CONTENT_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data:; style-src 'self'; "
                           "script-src 'self'; connect-src 'self'; object-src 'none'; "
                           "base-uri 'none'; frame-ancestors 'none'")
PARAMS_FILE = "params.yaml"


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


def reward_config(repo: Path) -> tuple[dict[str, Any], dict[str, Any], AnswerFormat]:
    """(weights, per-reward options, answer format) from params.yaml, checked as training checks
    them."""
    try:
        params = load_params(repo / PARAMS_FILE)
        rewards, fmt = params.rewards, answer_format(params)
        build_rewards(rewards.weights, rewards.options, fmt)
    except (ParamsError, ValueError, TypeError) as error:
        raise ApiError(503, f"{PARAMS_FILE}: {error}", field="params.yaml") from None
    return dict(rewards.weights), dict(rewards.options), fmt


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
            weights, options, fmt = reward_config(repo)
        except ApiError as error:
            weights, options, fmt = {}, {"error": error.message}, DEFAULT_FORMAT
        return json_response({"repo": str(repo), "weights": weights, "options": options,
                              "tags": fmt.tags(), "example": worked_example(fmt),
                              "max_completion_bytes": MAX_COMPLETION_BYTES,
                              "question_types": QUESTION_TYPES, "answer_types": ANSWER_TYPES})

    async def score(request: Request) -> Response:
        parsed = parse_score_request(await read_capped_body(request, MAX_BODY_BYTES))
        completion, record = parsed.completion, parsed.record.scoring_record()
        weights, options, fmt = reward_config(repo)
        result = await run_in_threadpool(score_completion, completion, record, weights, options,
                                         fmt)
        return json_response({**result, "options": options, "tags": fmt.tags(), "record": record,
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
