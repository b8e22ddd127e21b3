"""Checked-in recipes: `recipes/*.yaml`, each holding only the keys one job changes from
params.yaml's defaults (a real model on MathVista, a text model on GSM8K, ...), under a comment
header that says what it is for and what it needs. Applying one merges it onto the defaults and
writes the complete result, every key and its comment, over params.yaml: DVC stays the one source
of truth (`dvc params diff` shows what the recipe changed, `dvc repro` reruns what it touched).

    vlmrl recipe --list              # the recipes and what each is for
    vlmrl recipe gsm8k-qwen3-4b      # check it, then write it over params.yaml
    vlmrl recipe gsm8k-qwen3-4b --check

The defaults are params.yaml as git has it at HEAD (what `git checkout params.yaml` restores), so
applying one recipe after another never stacks them; outside git, the params file itself. The
merge is a round trip through ruamel.yaml, DVC's own YAML library, and the result is written the
way DVC writes params.yaml, so a later `dvc exp run -S key=value` changes only that key's line. A
recipe's value replaces the default's; a mapping is merged key by key, a list replaced whole; a
key keeps params.yaml's comment unless the recipe's line has one; the header is the recipe's.

A recipe is checked before anything is written, by the functions the stages check their params
with (vlmrl.params, vlmrl.params_checks): every section against its typed class, the trainer
configs' ranges and keys (against TRL's configs), the rewards against the registry, the answer
format against its rules; nothing is downloaded. The defaults are checked first, so a problem is
named in the file that holds it."""

from __future__ import annotations

import argparse
import copy
import io
import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import yaml
from ruamel.yaml import YAML
from ruamel.yaml import YAMLError as RuamelYAMLError
from ruamel.yaml.comments import CommentedMap

from vlmrl.errors import UserError
from vlmrl.outputs import write_text_atomic
from vlmrl.params import PARAMS_FILE, Params, ParamsError, in_file
from vlmrl.params_checks import check_trainer_fields
from vlmrl.rewards.answer_format import answer_format
from vlmrl.rewards.functions import build_rewards

RECIPES_DIR = Path("recipes")


class RecipeError(UserError, ValueError):
    """A recipe is missing or invalid; the message names the recipe and the key."""


# ------------------------------------------------------------------ finding


def recipe_path(name: str, root: Path = Path(".")) -> Path:
    """`name` as a recipe file: a path to a YAML file, or a name in recipes/."""
    given = Path(name)
    if given.suffix in (".yaml", ".yml") and (root / given).is_file():
        return root / given
    path = root / RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(available(root)) or "none"
        raise RecipeError(f"no recipe {name!r} ({path} does not exist); recipes: {known}")
    return path


def available(root: Path = Path(".")) -> list[str]:
    return sorted(path.stem for path in (root / RECIPES_DIR).glob("*.yaml"))


def split_header(text: str) -> tuple[str, str]:
    """The leading comment block (with the blank lines after it) and the YAML after it."""
    lines = text.splitlines(keepends=True)
    end = next((index for index, line in enumerate(lines)
                if line.strip() and not line.lstrip().startswith("#")), len(lines))
    return "".join(lines[:end]), "".join(lines[end:])


def summary(path: Path) -> str:
    """The first sentence of the recipe's comment header (what it is for), however many lines
    it spans."""
    header = split_header(path.read_text(encoding="utf-8"))[0]
    text = " ".join(part for line in header.splitlines() if (part := line.lstrip("#").strip()))
    end = re.search(r"[.!?](?=\s|$)", text)
    return text[:end.end()] if end else text


def defaults_text(params_file: Path = PARAMS_FILE) -> str:
    """The defaults a recipe is merged onto: `params_file` as git has it at HEAD, else (outside
    git, or never committed) the file itself."""
    try:
        shown = subprocess.run(["git", "show", f"HEAD:./{params_file.name}"],
                               cwd=params_file.parent, capture_output=True, text=True,
                               check=False)
    except (FileNotFoundError, NotADirectoryError):  # no git, or no such folder
        shown = None
    if shown is not None and shown.returncode == 0:
        return shown.stdout
    if params_file.is_file():
        return params_file.read_text(encoding="utf-8")
    raise RecipeError(f"{params_file}: no defaults to merge a recipe onto (not in git at HEAD, "
                      "not on disk)")


# ------------------------------------------------------------------ merging


def dvc_yaml() -> YAML:
    """ruamel.yaml set up as DVC's `modify_yaml` writes params.yaml (dvc.utils.serialize._yaml):
    what it writes, a DVC round trip writes back unchanged."""
    writer = YAML()
    writer.default_flow_style = False
    writer.Representer.add_representer(OrderedDict, writer.Representer.represent_dict)
    return writer


def load_body(text: str, source: Path | str, first_line: int = 1) -> CommentedMap:
    """The YAML of a params file or recipe (its header split off; `first_line`: the line of
    the file it starts on) as ruamel's commented mapping; an empty body is an empty mapping."""
    try:
        data = YAML(typ="rt").load(text)
    except RuamelYAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + first_line}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise RecipeError(f"{source}: not valid YAML ({problem}{where})") from None
    if data is None:
        return CommentedMap()
    if not isinstance(data, CommentedMap):
        raise RecipeError(f"{source}: a recipe is a mapping of params sections, "
                          f"got {type(data).__name__}")
    return data


def merge(defaults: str, recipe: str, recipe_source: Path | str = "the recipe") -> str:
    """`recipe` merged onto `defaults` (both params-file texts), comments kept, under the
    recipe's header (the defaults' where the recipe has none)."""
    base_header, base_body = split_header(defaults)
    recipe_header, recipe_body = split_header(recipe)
    merged = load_body(base_body, PARAMS_FILE, base_header.count("\n") + 1)
    overlay(merged, load_body(recipe_body, recipe_source, recipe_header.count("\n") + 1))
    stream = io.StringIO()
    dvc_yaml().dump(plain_lists(merged), stream)
    header = (recipe_header if recipe_header.strip() else base_header).rstrip("\n")
    return f"{header}\n\n{stream.getvalue()}" if header else stream.getvalue()


def plain_lists(node: Any) -> Any:
    """Every list under `node` as a plain one, which the writer puts one item a line: what
    `dvc exp run -S` does to each list of params.yaml whatever key it sets (its Hydra overrides
    rebuild the lists), so a file written so keeps its lines through DVC's round trip."""
    if isinstance(node, CommentedMap):
        for key, value in node.items():
            node[key] = plain_lists(value)
        return node
    if isinstance(node, list):
        return [plain_lists(item) for item in node]
    return node


def overlay(base: CommentedMap, over: CommentedMap) -> None:
    """`over`'s keys onto `base`, in place: mappings merged key by key, anything else replaced;
    a new key goes last, taking over the blank lines that closed `base`."""
    for key, value in over.items():
        if key not in base:
            append(base, key, value, comment_of(over, key))
            continue
        if isinstance(base[key], CommentedMap) and isinstance(value, CommentedMap):
            overlay(base[key], value)
        else:
            base[key] = value
        recomment(base, key, comment_of(over, key))


def comment_of(node: CommentedMap, key: Any) -> str:
    """The comment on `key`'s line (with the comment lines that continue it), without the blank
    lines after it; "" for none."""
    token = token_of(node, key)
    text = token.value.rstrip("\n") if token is not None else ""
    return text if text.lstrip().startswith("#") else ""


def token_of(node: CommentedMap, key: Any) -> Any:
    entry = node.ca.items.get(key)
    return entry[2] if entry and len(entry) > 2 else None


def blank_lines_after(node: CommentedMap, key: Any) -> int:
    token = token_of(node, key)
    return 0 if token is None else len(token.value) - len(token.value.rstrip("\n")) - 1


def recomment(node: CommentedMap, key: Any, comment: str, blank_lines: int | None = None) -> None:
    """`key`'s comment set to `comment` (none given: the one it has), followed by `blank_lines`
    blank lines (none given: as many as it had)."""
    token = token_of(node, key)
    old = token.value.rstrip("\n") if token is not None else ""
    blank = blank_lines_after(node, key) if blank_lines is None else blank_lines
    text = (comment or old) + "\n" + "\n" * blank
    if text == "\n":
        if token is not None:
            node.ca.items[key][2] = None
        return
    new = copy.copy(token) if token is not None else comment_token(text)
    new.value = text
    entry = node.ca.items.setdefault(key, [None, None, None, None])
    entry[2] = new


def comment_token(text: str) -> Any:
    """A comment token for a key that had none, at the column params.yaml's comments use."""
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    return CommentToken(text, CommentMark(36))


def last_key(node: CommentedMap) -> tuple[CommentedMap, Any]:
    """The map and key whose comment closes `node`: its last key, or that of its last value."""
    key = list(node)[-1]
    value = node[key]
    if isinstance(value, CommentedMap) and value and not value.fa.flow_style():
        return last_key(value)
    return node, key


def append(base: CommentedMap, key: Any, value: Any, comment: str) -> None:
    closing = last_key(base) if base else None
    blank = blank_lines_after(*closing) if closing else 0
    if closing:
        recomment(*closing, comment="", blank_lines=0)
    base[key] = value
    recomment(base, key, comment, 0)
    recomment(*last_key(base), comment="", blank_lines=blank)


# ------------------------------------------------------------------ checking


def check_text(text: str, source: Path | str) -> Params:
    """A params file's text checked as the stages check params.yaml, every section at once;
    a ParamsError names `source`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise RecipeError(f"{source}: not valid YAML ({error})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a params file is a mapping of sections")
    params = Params(raw, source=source)
    params.check()
    with in_file(source):
        fmt = answer_format(params)
        try:
            build_rewards(params.rewards.weights, params.rewards.options, fmt)
        except ParamsError:
            raise
        except ValueError as error:  # the registry's checks of reward options
            raise ParamsError(f"{PARAMS_FILE} rewards: {error}") from None
        check_trainer_fields(params.sft.args, params.train.grpo)
    return params


def applied(path: Path, defaults: str, defaults_source: Path | str = PARAMS_FILE) -> str:
    """The recipe at `path` merged onto `defaults`, after both are checked: the text `vlmrl
    recipe` writes over params.yaml."""
    check_text(defaults, defaults_source)
    text = merge(defaults, path.read_text(encoding="utf-8"), path)
    check_text(text, path)
    return text


def recipe_params(name: str, root: Path = Path(".")) -> dict[str, Any]:
    """Every param a recipe runs with (it merged onto root's params.yaml as it is on disk), as
    the stages read them: for code that needs a recipe's complete settings."""
    params_file = root / PARAMS_FILE
    merged = merge(params_file.read_text(encoding="utf-8"),
                   recipe_path(name, root).read_text(encoding="utf-8"))
    return yaml.safe_load(merged)


def apply_recipe(path: Path, params_file: Path = PARAMS_FILE, defaults: Path | None = None) -> None:
    """Writes the recipe at `path`, merged onto the defaults (`defaults`, else params.yaml at
    git HEAD), over `params_file`; nothing is written unless both check."""
    base = defaults.read_text(encoding="utf-8") if defaults else defaults_text(params_file)
    write_text_atomic(params_file, applied(path, base, defaults or PARAMS_FILE))


# ------------------------------------------------------------------ command


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlmrl recipe",
        description="List the checked-in recipes, or check one and write it over params.yaml: "
                    "the recipe's keys merged onto the defaults, every other key and comment "
                    "kept, so `dvc params diff` shows what it changed.")
    parser.add_argument("name", nargs="?",
                        help="a recipe in recipes/ (without .yaml) or a path to a YAML file "
                             "(default: none, list the recipes)")
    parser.add_argument("--list", action="store_true",
                        help="list the recipes, each with what it is for (default: off)")
    parser.add_argument("--check", action="store_true",
                        help="only check the recipe as the stages check params, write nothing "
                             "(default: off)")
    parser.add_argument("--params", type=Path, default=PARAMS_FILE,
                        help="the params file to write (default: params.yaml)")
    parser.add_argument("--defaults", type=Path, default=None,
                        help="the params file the recipe is merged onto (default: the --params "
                             "file as git has it at HEAD, else as it is)")
    return parser


def cli_recipe(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        if args.list or args.name is None:
            for name in available():
                print(f"{name}: {summary(recipe_path(name))}")
            return 0
        path = recipe_path(args.name)
        if args.check:
            base = (args.defaults.read_text(encoding="utf-8") if args.defaults
                    else defaults_text(args.params))
            applied(path, base, args.defaults or PARAMS_FILE)
            print(f"{path}: valid")
            return 0
        apply_recipe(path, args.params, args.defaults)
    except (RecipeError, ParamsError, FileNotFoundError) as error:
        print(f"vlmrl recipe: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path} over {args.params}; `dvc params diff` shows what changed, "
          "`dvc repro` runs it")
    return 0
