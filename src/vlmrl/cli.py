"""One `vlmrl` command; each subcommand lives beside the code it drives and is imported lazily,
so `vlmrl pull` never pays for importing torch or Prefect. `vlmrl --help` lists the subcommands
from the table below without importing any of them. Each subcommand's options end their help with
their default, `(default: X)` or `(required)`; tests/test_cli.py checks every one."""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version


@dataclass(frozen=True)
class Subcommand:
    module: str
    function: str
    summary: str  # one line for `vlmrl --help`


SUBCOMMANDS: dict[str, Subcommand] = {
    "pull": Subcommand(
        "vlmrl.publish.cli",
        "cli_pull",
        "download a published version from S3, checked against its manifest",
    ),
    "versions": Subcommand(
        "vlmrl.publish.cli",
        "cli_versions",
        "list the versions published to S3 and which one is latest",
    ),
    "create-bucket": Subcommand(
        "vlmrl.publish.cli",
        "cli_create_bucket",
        "create the S3 bucket the upload stage publishes to",
    ),
    "run": Subcommand(
        "vlmrl.pipeline.orchestration",
        "cli_run",
        "run the DVC pipeline once as a Prefect flow, on a temporary Prefect server unless "
        "PREFECT_API_URL is set",
    ),
    "schedule": Subcommand(
        "vlmrl.pipeline.orchestration",
        "cli_schedule",
        "serve the pipeline on a cron schedule with Prefect (blocks), or register it on a work pool",
    ),
    "node": Subcommand(
        "vlmrl.pipeline.nodes",
        "cli_node",
        "run this machine's part of a training stage over several machines (Slurm, SSH)",
    ),
    "ui": Subcommand(
        "vlmrl.ui.app", "cli_ui", "open the reward playground and eval browser on 127.0.0.1"
    ),
    "serve": Subcommand(
        "vlmrl.serve.command",
        "cli_serve",
        "serve a pulled GGUF folder (with its projector) as an OpenAI chat API on 127.0.0.1",
    ),
    "recipe": Subcommand(
        "vlmrl.pipeline.recipes",
        "cli_recipe",
        "list the recipes, or check one and write it over params.yaml, merged onto the defaults",
    ),
}
HELP_FLAGS = ("-h", "--help")


def package_version() -> str:
    try:
        return version("vlmrl")
    except PackageNotFoundError:
        return "unknown (the package is not installed: pip install -e .)"


def help_text() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    commands = "\n".join(
        f"  {name:<{width}}  {command.summary}" for name, command in SUBCOMMANDS.items()
    )
    return (
        "usage: vlmrl COMMAND [options]\n\n"
        "Train Qwen3-VL or Qwen3 models with GSPO to solve maths problems, visual or in words; "
        "verify the\nLoRA adapter, export GGUF files and publish them to S3. `dvc repro` runs "
        "the pipeline on params.yaml;\n`vlmrl recipe` switches it to another model, data set "
        "or GPU profile.\n\n"
        f"commands:\n{commands}\n\n"
        "options:\n"
        "  -h, --help  show this help and exit\n"
        "  --version   print the package version and exit\n\n"
        "`vlmrl COMMAND --help` lists a command's options."
    )


def unknown_command_message(word: str) -> str:
    kind = "option" if word.startswith("-") else "command"
    close = difflib.get_close_matches(word, SUBCOMMANDS, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"vlmrl: unknown {kind} {word!r}{hint}. Commands: {', '.join(SUBCOMMANDS)} "
        "(`vlmrl --help` says what each does)."
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(f"{help_text()}\n\nvlmrl: no command given", file=sys.stderr)
        return 2
    first = argv[0]
    if first in HELP_FLAGS:
        print(help_text())
        return 0
    if first == "--version":
        print(f"vlmrl {package_version()}")
        return 0
    if first not in SUBCOMMANDS:
        print(unknown_command_message(first), file=sys.stderr)
        return 2
    command = SUBCOMMANDS[first]
    run = getattr(importlib.import_module(command.module), command.function)
    return int(run(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
