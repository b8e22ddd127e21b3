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

from vlmrl.export.gguf_release import PROJECTOR_KIND, default_model_file

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
                  port: int = 8080, n_ctx: int = 4096, projector: bool = True) -> list[str]:
    """The server's command line for the folder (`python -m` SERVER_MODULE, llama_cpp.server's
    app behind vlmrl.serve.app's request filter)."""
    names = gguf_names(folder)
    model = file or default_model_file(names)
    if not (Path(folder) / model).is_file():
        raise ServeError(f"{Path(folder) / model}: no such GGUF file; the folder has "
                         f"{sorted(names.values())}")
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(Path(folder) / model),
               "--host", host, "--port", str(port), "--n_ctx", str(n_ctx),
               "--n_threads", str(os.cpu_count() or 1), "--seed", "0"]
    if projector and PROJECTOR_KIND in names:
        command += ["--clip_model_path", str(Path(folder) / names[PROJECTOR_KIND]),
                    "--chat_format", "mtmd"]
    return command


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
    return parser.parse_args(argv)


def cli_serve(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_server_installed()
        command = serve_command(args.gguf, file=args.file, host=args.host, port=args.port,
                                n_ctx=args.n_ctx, projector=not args.no_projector)
    except ServeError as error:
        print(f"serve failed: {error}", file=sys.stderr)
        return 1
    print(f"serving {command[4]} on http://{args.host}:{args.port}/v1 (OpenAI chat API); "
          "Ctrl-C stops it", flush=True)
    sys.stderr.flush()
    os.execv(command[0], command)  # returns only by raising OSError
