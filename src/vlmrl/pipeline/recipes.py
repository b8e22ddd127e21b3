"""Checked-in recipes: `recipes/*.yaml`, each a complete params.yaml for one job (the embedded
defaults, a real model on MathVista, a text model on GSM8K), with a comment header saying what it
is for and what it needs. A run of one is a run of the pipeline with that params.yaml, so
applying a recipe writes it over params.yaml: DVC stays the one source of truth (`dvc params
diff` shows what the recipe changed, `dvc repro` reruns what it touched, `git checkout
params.yaml` goes back).

    vlmrl recipe                     # list the recipes and what each is for
    vlmrl recipe gsm8k-qwen3-4b      # check it, then write it over params.yaml
    vlmrl recipe gsm8k-qwen3-4b --check

A recipe is checked before it is written: every section against its typed params class, the
rewards against the registry, the answer format against its rules; nothing is downloaded.
Settings that only a runtime can check (`train.grpo` against TRL's GRPOConfig, `sft.args` against
SFTConfig) are checked by the stage that uses them, and by tests/test_recipes.py for every
checked-in recipe."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from vlmrl.rewards.answer_format import answer_format
from vlmrl.errors import UserError
from vlmrl.outputs import write_text_atomic
from vlmrl.params import PARAMS_FILE, Params, ParamsError
from vlmrl.rewards.functions import build_rewards

RECIPES_DIR = Path("recipes")
SECTIONS = ("model", "data", "rewards", "eval", "sft", "train", "verify", "export", "upload")


class RecipeError(UserError, ValueError):
    """A recipe is missing or invalid; the message names the recipe and the key."""


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


def summary(path: Path) -> str:
    """The first sentence of the recipe's comment header (what it is for), however many lines
    it spans."""
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    text = " ".join(part for part in header if part)
    end = re.search(r"[.!?](?=\s|$)", text)
    return text[:end.end()] if end else text


def check_recipe(path: Path) -> Params:
    """Every section validated; raises RecipeError naming the recipe and the key."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise RecipeError(f"{path}: not valid YAML ({error})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of params sections")
    params = Params(raw)
    try:
        for section in SECTIONS:
            getattr(params, section)
        fmt = answer_format(params)
        build_rewards(params.rewards.weights, params.rewards.options, fmt)
    except (ParamsError, ValueError) as error:
        raise RecipeError(f"{path}: {error}") from None
    return params


def apply_recipe(path: Path, params_file: Path = PARAMS_FILE) -> None:
    check_recipe(path)
    write_text_atomic(params_file, path.read_text(encoding="utf-8"))


def cli_recipe(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vlmrl recipe",
        description="List the checked-in recipes, or check one and write it over params.yaml.")
    parser.add_argument("name", nargs="?",
                        help="a recipe in recipes/ (without .yaml) or a path to a YAML file; "
                             "omitted: list them (default: list)")
    parser.add_argument("--check", action="store_true",
                        help="only check the recipe, write nothing (default: off)")
    parser.add_argument("--params", type=Path, default=PARAMS_FILE,
                        help="the params file to write (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        if args.name is None:
            for name in available():
                print(f"{name}: {summary(recipe_path(name))}")
            return 0
        path = recipe_path(args.name)
        if args.check:
            check_recipe(path)
            print(f"{path}: valid")
            return 0
        apply_recipe(path, args.params)
    except RecipeError as error:
        print(f"vlmrl recipe: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path} over {args.params}; `dvc params diff` shows what changed, "
          "`dvc repro` runs it")
    return 0
