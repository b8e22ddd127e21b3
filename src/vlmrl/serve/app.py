"""The server process of `vlmrl serve`: llama-cpp-python's OpenAI app (`llama_cpp.server`, with its
own command-line options) behind one check of the chat requests. OpenAI clients send a message's
content as a list of parts; llama.cpp's chat template for a model without a projector reads
content as a string only, and answered such a list with HTTP 500. So for a text model the text
parts are joined into one string (with newlines, as the pipeline's prompts join them), and an
image part is refused with HTTP 400 naming it; a model served with its projector gets the parts
as sent (llama.cpp's multimodal handler reads them). With `--verbose False` (as `vlmrl serve` runs
it unless told otherwise) the process prints one line, once its port listens, instead of
llama.cpp's model metadata and uvicorn's logs.

    python -m vlmrl.serve.app --model model-Q4_K_M.gguf [--clip_model_path mmproj-f16.gguf ...]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
IMAGE_PARTS = ("image_url", "input_image", "image")


class RequestProblem(ValueError):
    """A chat request the served model cannot answer; the message names the part."""


def text_only_messages(payload: Any) -> Any:
    """The chat request with every message's content parts joined into one string; raises
    RequestProblem for an image part. Anything not shaped like a chat request passes unchanged,
    for the server's own validation to answer."""
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        return payload
    messages = []
    for index, message in enumerate(payload["messages"]):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            message = {**message, "content": joined_text(content, f"messages[{index}]")}
        messages.append(message)
    return {**payload, "messages": messages}


def joined_text(parts: list[Any], where: str) -> str:
    texts = []
    for number, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            raise RequestProblem(
                f"{where}.content[{number}] is an image, but this model is served without a "
                "vision projector (a text model, or --no-projector): send text only")
        if kind == "text":
            texts.append(str(part.get("text") or ""))
    return "\n".join(texts)


class ContentParts:
    """ASGI middleware: rewrites the body of POST .../chat/completions for a text model, or
    answers HTTP 400 with an OpenAI-style error; every other request passes untouched."""

    def __init__(self, app: ASGIApp, *, vision: bool) -> None:
        self.app, self.vision = app, vision

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.vision or scope["type"] != "http" or scope.get("method") != "POST"
                or not scope.get("path", "").endswith("/chat/completions")):
            await self.app(scope, receive, send)
            return
        body = await Request(scope, receive).body()
        try:
            body = json.dumps(text_only_messages(json.loads(body))).encode()
        except json.JSONDecodeError:
            pass  # the server answers a body that is not JSON itself
        except RequestProblem as problem:
            await openai_error(400, str(problem))(scope, receive, send)
            return
        await self.app(with_length(scope, len(body)), replay(body, receive), send)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that hands the app `body` once, then waits on the client's channel
    (for the disconnect a streaming response listens for)."""
    sent = False

    async def channel() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return channel


def with_length(scope: Scope, length: int) -> Scope:
    """A copy of `scope` whose content-length header says `length`."""
    scope = {**scope, "headers": list(scope.get("headers", []))}
    MutableHeaders(scope=scope)["content-length"] = str(length)
    return scope


def openai_error(status: int, message: str) -> JSONResponse:
    """An error response in the shape OpenAI's API answers with."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": "messages", "code": None}}, status_code=status)


def main(argv: list[str] | None = None) -> None:
    """llama_cpp.server's command line (its own options), served through ContentParts. With
    `--verbose False` it prints one line, once the port listens; with True, llama.cpp's and
    uvicorn's logs as well."""
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    from vlmrl.export.llama_runtime import quiet_llama_logs

    parser = argparse.ArgumentParser(prog="python -m vlmrl.serve.app",
                                     description="Runs llama_cpp.server's app for vlmrl serve.")
    add_args_from_model(parser, Settings)
    args = parser.parse_args(argv)
    server = parse_model_from_args(ServerSettings, args)
    model = parse_model_from_args(ModelSettings, args)
    if not model.verbose:
        quiet_llama_logs()
    try:
        app = create_app(server_settings=server, model_settings=[model])
    except ValueError as error:  # llama-cpp-python's answer to a file llama.cpp cannot load
        raise SystemExit(f"serve failed: {model.model}: llama.cpp cannot load it ({error})")
    config = uvicorn.Config(ContentParts(app, vision=model.clip_model_path is not None),
                            host=server.host, port=server.port,
                            log_level="info" if model.verbose else "warning")
    ready_server(config, ready_line(server.host, server.port, model.model_alias)).run()


def ready_line(host: str, port: int, model_id: str | None) -> str:
    """What `vlmrl serve` prints once it answers: where, and the model id to send."""
    return (f"vlmrl serve: ready on http://{host}:{port}/v1 (OpenAI chat API), model id "
            f"{model_id!r}; Ctrl-C stops it")


def ready_server(config: Any, line: str) -> Any:
    """A uvicorn.Server that prints `line` once its socket listens: clients that wait for the
    line can connect at once."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(line, flush=True)

    return ReadyServer(config)


if __name__ == "__main__":
    main()
