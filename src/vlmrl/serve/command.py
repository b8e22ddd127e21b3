"""`vlmrl serve`: a pulled GGUF folder behind an OpenAI-compatible chat API, so that a user can
try a release without writing code.

It runs llama-cpp-python's server (`llama_cpp.server`, the `server` extra of llama-cpp-python,
through vlmrl.serve.app, which lets a text model take content-part messages) on the folder's
default model file, with the vision projector and llama.cpp's multimodal handler when the folder
has one. It listens on 127.0.0.1 unless told otherwise. The server replaces the `vlmrl serve`
process (exec), so that stopping that process by its id (Prefect, systemd, a test) stops the
server, and no child is left holding the port. The command is built apart from running it, so
that it can be shown and tested."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from vlmrl.export.gguf import GGUFError
from vlmrl.export.gguf_release import PROJECTOR_KIND, default_model_file
from vlmrl.export.llama_runtime import gguf_general_name

SERVER_MODULE = "vlmrl.serve.app"


class ServeError(RuntimeError):
    """The folder holds no model file, or the server is not installed."""


def gguf_names(folder: Path) -> dict[str, str]:
    """kind -> file name for the .gguf files of a folder (`model-KIND.gguf`, `mmproj-*.gguf`)."""
    names = {}
    for path in sorted(Path(folder).glob("*.gguf")):
        if path.name.startswith(PROJECTOR_KIND):
            names[PROJECTOR_KIND] = path.name
        else:
            names[path.stem.removeprefix("model-")] = path.name
    if not any(kind != PROJECTOR_KIND for kind in names):
        raise ServeError(f"{folder}: no GGUF model file there (pull one with "
                         "`vlmrl pull --what gguf --to DIR`)")
    return names


def serve_command(folder: Path, *, file: str | None = None, host: str = "127.0.0.1",
                  port: int = 8080, n_ctx: int = 4096, projector: bool = True,
                  alias: str | None = None, verbose: bool = False) -> list[str]:
    """The server's command line for the folder (`python -m` SERVER_MODULE, llama_cpp.server's
    app behind vlmrl.serve.app's request filter).

    Args:
        alias: the model id clients send and /v1/models lists; default `release_model_name`.
        verbose: llama.cpp's model metadata and logs, and uvicorn's, instead of one ready line.
    """
    names = gguf_names(folder)
    model = Path(folder) / (file or default_model_file(names))
    if not model.is_file():
        raise ServeError(f"{model}: no such GGUF file; the folder has "
                         f"{sorted(names.values())}")
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(model),
               "--model_alias", alias or release_model_name(model), "--host", host,
               "--port", str(port), "--n_ctx", str(n_ctx),
               "--n_threads", str(os.cpu_count() or 1), "--seed", "0",
               "--verbose", str(verbose)]
    if projector and PROJECTOR_KIND in names:
        command += ["--clip_model_path", str(Path(folder) / names[PROJECTOR_KIND]),
                    "--chat_format", "mtmd"]
    return command


def release_model_name(model: Path) -> str:
    """The model's name in the release: the GGUF file's `general.name` (export writes the base
    model's name + "-gspo" there), else the file's name without `.gguf`."""
    try:
        return gguf_general_name(model) or model.stem
    except GGUFError as error:
        raise ServeError(str(error)) from error


def check_server_installed() -> None:
    for module in ("llama_cpp", "sse_starlette", "starlette_context"):
        if importlib.util.find_spec(module) is None:
            raise ServeError(f"the server needs the Python package for `{module}`: pip install "
                             "'llama-cpp-python[server]' (or pip install -e '.[gguf]')")


DESCRIPTION = ("Serves a pulled GGUF folder (with its vision projector, where it has one) as an "
               "OpenAI-compatible chat API on 127.0.0.1, through llama-cpp-python's server.")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vlmrl serve", description=DESCRIPTION)
    parser.add_argument("--gguf", type=Path, required=True, metavar="DIR",
                        help="a GGUF folder, as `vlmrl pull --what gguf` writes it (required)")
    parser.add_argument("--file", help="the model file to serve (default: model-Q4_K_M.gguf, "
                        "else the folder's last kind)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on "
                        "(default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    parser.add_argument("--n-ctx", type=int, default=4096,
                        help="context length in tokens (default: 4096)")
    parser.add_argument("--no-projector", action="store_true",
                        help="text only, even where the folder has a projector (default: off)")
    parser.add_argument("--alias", metavar="NAME",
                        help="the model id OpenAI clients send (default: the release's model "
                        "name, the GGUF file's general.name)")
    parser.add_argument("--verbose", action="store_true",
                        help="show llama.cpp's model metadata and logs, and each request "
                        "(default: one line once the server is ready)")
    return parser.parse_args(argv)


def cli_serve(argv: Sequence[str] | None = None) -> int:
    """Execs the server; it prints one line once it answers (`vlmrl.serve.app.ready_line`)."""
    args = parse_args(argv)
    try:
        check_server_installed()
        command = serve_command(args.gguf, file=args.file, host=args.host, port=args.port,
                                n_ctx=args.n_ctx, projector=not args.no_projector,
                                alias=args.alias, verbose=args.verbose)
    except ServeError as error:
        print(f"serve failed: {error}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)  # returns only by raising OSError
