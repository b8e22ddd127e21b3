"""The `vlmrl` command as a user meets it, run in a subprocess: `--help` on stdout lists every
subcommand with what it does, every option of every subcommand has help that shows its default,
an unknown command is named with a non-zero exit, and `--version` prints the package version."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from vlmrl.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
SHOWS_DEFAULT = re.compile(r"\(default:? [^)]+\)|\(required\)")


def vlmrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    python_path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "vlmrl.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def option_help(help_text: str) -> dict[str, str]:
    """Each option of an argparse help text (by its first flag) -> its help, unwrapped."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            invocation, _, text = line.strip().partition("  ")
            current = invocation.split(",")[0].split()[0]
            entries[current] = text.strip()
        elif current and line.startswith("    "):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def test_help_lists_every_subcommand_with_what_it_does_on_stdout():
    completed = vlmrl("--help")
    assert completed.returncode == 0 and completed.stderr == ""
    listed = {}
    for line in completed.stdout.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines():
        name, summary = line.split(maxsplit=1)
        listed[name] = summary
    assert listed == {name: command.summary for name, command in SUBCOMMANDS.items()}
    assert all(len(summary) > 20 for summary in listed.values())
    assert "--version" in completed.stdout
    assert vlmrl("-h").stdout == completed.stdout


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_subcommand_resolves_to_its_function(name):
    command = SUBCOMMANDS[name]
    assert callable(getattr(importlib.import_module(command.module), command.function))


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_option_has_help_that_shows_its_default(name, tmp_path):
    completed = vlmrl(name, "--help", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith(f"usage: vlmrl {name} ")
    options = option_help(completed.stdout)
    options.pop("-h")
    assert options, completed.stdout
    for flag, text in options.items():
        assert text, f"vlmrl {name} {flag} has no help"
        assert SHOWS_DEFAULT.search(text), f"vlmrl {name} {flag} shows no default: {text}"


def test_pull_what_names_the_groups_and_its_default():
    options = option_help(vlmrl("pull", "--help").stdout)
    assert options["--what"].startswith("which group to fetch")
    assert options["--what"].endswith("(default: all)")
    assert options["--to"].endswith("(required)")
    assert options["--force"].endswith("(default: off)")


@pytest.mark.parametrize(("word", "kind", "hint"), [
    ("pul", "command", " (did you mean 'pull'?)"),
    ("frobnicate", "command", ""),
    ("--what", "option", ""),
])
def test_unknown_command_is_named_with_a_non_zero_exit(word, kind, hint):
    completed = vlmrl(word)
    assert completed.returncode == 2 and completed.stdout == ""
    assert completed.stderr.startswith(f"vlmrl: unknown {kind} '{word}'{hint}. Commands: pull, ")
    assert "`vlmrl --help` says what each does" in completed.stderr


def test_no_command_prints_the_help_and_fails():
    completed = vlmrl()
    assert completed.returncode == 2 and completed.stdout == ""
    assert "commands:" in completed.stderr
    assert completed.stderr.rstrip().endswith("vlmrl: no command given")


def test_version_prints_the_package_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    completed = vlmrl("--version")
    assert completed.returncode == 0 and completed.stderr == ""
    assert completed.stdout == f"vlmrl {project['version']}\n"


def description(help_text: str) -> str:
    """The paragraph argparse prints between the usage and the first argument group."""
    body = help_text.split("\n\n", 1)[1]
    return " ".join(body.split("\n\n", 1)[0].split())


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_subcommand_describes_itself_in_whole_sentences(name, tmp_path):
    text = description(vlmrl(name, "--help", cwd=tmp_path).stdout)
    assert text[:1].isupper() and text.endswith((".", ".)")), f"vlmrl {name}: {text!r}"


def test_recipe_list_gives_each_recipe_a_whole_sentence():
    completed = vlmrl("recipe", "--list")
    assert completed.returncode == 0, completed.stderr
    listed = completed.stdout.splitlines()
    assert len(listed) == 5 and vlmrl("recipe").stdout.splitlines() == listed
    for line in listed:
        _name, _, summary = line.partition(": ")
        assert summary.endswith(".") and len(summary) > 40, line


def test_help_describes_the_product_not_one_recipe():
    """The one-line description names what the pipeline does for any recipe, and `vlmrl run`
    says that it starts a Prefect server of its own unless one is configured."""
    text = description(vlmrl("--help").stdout)
    assert "GSPO" in text and "vlmrl recipe" in text and "Qwen3-VL visual maths" not in text
    assert "temporary Prefect server unless PREFECT_API_URL" in SUBCOMMANDS["run"].summary
