"""One `vlmrl` command; each subcommand lives beside the code it drives and is imported lazily,
so `vlmrl pull` never pays for importing torch or Prefect."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pull": ("vlmrl.publish.cli", "cli_pull"),
    "versions": ("vlmrl.publish.cli", "cli_versions"),
    "run": ("vlmrl.orchestration", "cli_run"),
    "schedule": ("vlmrl.orchestration", "cli_schedule"),
    "ui": ("vlmrl.ui.app", "cli_ui"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in SUBCOMMANDS:
        known = ", ".join(SUBCOMMANDS)
        print(f"usage: vlmrl {{{known}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    module_name, function_name = SUBCOMMANDS[argv[0]]
    command = getattr(importlib.import_module(module_name), function_name)
    return int(command(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
