"""Checked-in recipes: each holds only the keys it changes from params.yaml (60 lines at most);
`vlmrl recipe` merges it onto the defaults (params.yaml at git HEAD) with the comments kept and
writes a complete params.yaml, so that `dvc params diff` shows exactly the recipe's keys; every
applied recipe passes the checks the stages run, and the offline text recipe runs all seven
stages (GGUF without a projector). The other offline recipe, embedded-vl, is params.yaml itself,
which test_end_to_end runs through every stage."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, dvc_repro, run

from vlmrl.distributed.data_parallel import split_global_batch
from vlmrl.distributed.launch import DistributedParams, resolve
from vlmrl.params import Params, ParamsError
from vlmrl.pipeline.recipes import (
    RecipeError,
    applied,
    available,
    cli_recipe,
    recipe_params,
    recipe_path,
    split_header,
    summary,
)
from vlmrl.rewards.answer_format import answer_format
from vlmrl.rewards.functions import build_rewards
from vlmrl.training.gspo import build_grpo_config, local_generation_rows, split_batch
from vlmrl.training.sft import build_sft_config

RECIPES = available(ROOT)
DEFAULTS = (ROOT / "params.yaml").read_text()
MAX_RECIPE_LINES = 60
# Short enough for the test suite; every stage still does its real work.
SHORT = {"sft.args.max_steps": 2, "train.grpo.max_steps": 2, "data.eval_size": 4,
         "data.synthetic_size": 40, "train.grpo.per_device_train_batch_size": 4,
         "train.grpo.num_generations": 4, "eval.max_new_tokens": 16}


def applied_text(name: str) -> str:
    return applied(recipe_path(name, ROOT), DEFAULTS)


def leaf_values(params: dict, prefix: str = "") -> dict[str, object]:
    """Dotted key paths of a params mapping -> their values (an empty mapping is a value)."""
    values: dict[str, object] = {}
    for key, value in params.items():
        if isinstance(value, dict) and value:
            values |= leaf_values(value, f"{prefix}{key}.")
        else:
            values[f"{prefix}{key}"] = value
    return values


def recipe_keys(name: str) -> dict[str, object]:
    return leaf_values(yaml.safe_load(recipe_path(name, ROOT).read_text()) or {})


def test_the_five_recipes_are_checked_in() -> None:
    assert RECIPES == ["embedded-text", "embedded-vl", "gsm8k-qwen3-4b", "mathvista-qwen3-vl-2b",
                       "mathvista-qwen3-vl-8b"]


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_is_short_and_holds_only_what_it_changes(name: str) -> None:
    path = recipe_path(name, ROOT)
    assert len(path.read_text().splitlines()) <= MAX_RECIPE_LINES
    assert summary(path), f"{name}: the header must say what the recipe is for"
    assert "Needs:" in split_header(path.read_text())[0], f"{name}: and what it needs"
    defaults = leaf_values(yaml.safe_load(DEFAULTS))
    same = sorted(key for key, value in recipe_keys(name).items()
                  if key in defaults and defaults[key] == value)
    assert same == [], f"{name} repeats defaults of params.yaml"


@pytest.mark.parametrize("name", RECIPES)
def test_an_applied_recipe_has_every_key_of_params_yaml(name: str) -> None:
    """Merging onto the defaults: no recipe misses a key params.yaml has, and the result
    holds the recipe's values."""
    written = leaf_values(yaml.safe_load(applied_text(name)))
    defaults = leaf_values(yaml.safe_load(DEFAULTS))
    assert sorted(set(defaults) - set(written)) == []
    assert {key: written[key] for key in recipe_keys(name)} == recipe_keys(name)
    assert set(written) - set(defaults) <= set(recipe_keys(name))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_the_stages_configs(name: str, tmp_path: Path) -> None:
    params = Params(yaml.safe_load(applied_text(name)))
    build_rewards(params.rewards.weights, params.rewards.options, answer_format(params))
    build_grpo_config(params.train.grpo, output_dir=tmp_path, save_steps=params.train.save_steps,
                      reward_weights=[1.0] * len(params.rewards.weights),
                      model_settings=params.model)
    build_sft_config(params.sft, tmp_path, params.model)


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_on_1_2_4_and_8_processes(name: str, processes: int) -> None:
    """Each recipe as `auto` runs it on a host with that many GPUs: the global batches split
    evenly, TRL's generation batch holds whole groups, and each process's generate calls
    (`train.max_generation_rows`, capped at its share) divide its share of the generation."""
    params = Params(recipe_params(name, ROOT))
    settings = resolve(DistributedParams.from_params(params.train.distributed), processes)
    assert settings.num_processes == processes
    assert settings.strategy == ("none" if processes == 1 else "ddp")
    grpo = params.train.grpo
    per_process = split_batch(grpo, processes)["per_device_train_batch_size"]
    steps_per_generation = grpo.get("steps_per_generation") or grpo["gradient_accumulation_steps"]
    share = per_process * steps_per_generation
    assert share * processes % grpo["num_generations"] == 0  # GRPOConfig's own check
    rows = local_generation_rows(params.train.max_generation_rows, share)
    assert rows is None or share % rows == 0
    split_global_batch(params.sft.args, processes, 8, "sft.args")


def test_generation_rows_are_capped_at_one_processes_share() -> None:
    assert local_generation_rows(None, 16) is None
    assert [local_generation_rows(32, share) for share in (32, 16, 8, 4)] == [32, 16, 8, 4]
    assert local_generation_rows(16, 32) == 16
    with pytest.raises(ParamsError, match=r"train\.max_generation_rows \(12\) must divide the "
                                          r"generation batch of one process .* = 16\)"):
        local_generation_rows(12, 16)


def test_embedded_vl_recipe_is_the_shipped_params() -> None:
    """Applying it writes params.yaml back byte for byte: its header is params.yaml's."""
    assert applied_text("embedded-vl") == DEFAULTS


def write_recipe(path: Path, body: str) -> Path:
    path.write_text(f"# A recipe under test.\n# Needs: nothing.\n\n{body}")
    return path


@pytest.mark.parametrize(("body", "message"), [
    ("eval:\n  top_p: 3\n", r"eval\.top_p: input should be less than or equal to 1, got 3$"),
    ("train:\n  grpo:\n    learnig_rate: 0.001\n",
     r"train\.grpo\.learnig_rate is not a trl\.GRPOConfig \(trl [\d.]+\) field"),
    ("train:\n  grpo:\n    learning_rate: -0.001\n",
     r"train\.grpo\.learning_rate: must be a number > 0, got -0\.001$"),
    ("model:\n  name: embedded:tiny-qwen9\n",
     r"model\.name: unknown embedded model 'embedded:tiny-qwen9'; known: embedded:tiny-qwen3-vl"),
    ("trian:\n  save_steps: 1\n", r"has unknown sections \['trian'\]; known: model, "),
    ("rewards:\n  length_penalty:\n    foo: 1\n",
     r"rewards: unknown option\(s\) 'foo' for reward 'length_penalty'"),
])
def test_check_names_the_recipe_and_the_key_once(tmp_path: Path, body: str, message: str) -> None:
    """What a stage would refuse, --check refuses, naming the recipe once (not params.yaml)."""
    bad = write_recipe(tmp_path / "bad.yaml", body)
    with pytest.raises((RecipeError, ParamsError), match=rf"^{re.escape(str(bad))} {message}") as \
            caught:
        applied(bad, DEFAULTS)
    assert str(caught.value).count(str(bad)) == 1 and "params.yaml" not in str(caught.value)


def test_a_problem_in_the_defaults_names_params_yaml(tmp_path: Path) -> None:
    defaults = DEFAULTS.replace("learning_rate: 3.0e-4 ", "learning_rate: -3.0e-4")
    with pytest.raises(ParamsError, match=r"^params\.yaml train\.grpo\.learning_rate: must be "):
        applied(recipe_path("embedded-text", ROOT), defaults)


def test_bad_yaml_names_the_recipe_and_its_line(tmp_path: Path) -> None:
    bad = write_recipe(tmp_path / "bad.yaml", "train: [\n")
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(bad))}: not valid YAML .* line 5\)$"):
        applied(bad, DEFAULTS)
    with pytest.raises(RecipeError, match="no recipe 'nope'.*recipes: embedded-text"):
        recipe_path("nope", ROOT)


def test_cli_lists_checks_and_refuses_without_writing(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    for listing in ([], ["--list"]):
        assert cli_recipe(listing) == 0
        listed = capsys.readouterr().out.splitlines()
        assert [line.split(": ", 1)[0] for line in listed] == RECIPES
    defaults = ["--defaults", str(ROOT / "params.yaml")]
    assert cli_recipe(["gsm8k-qwen3-4b", "--check", *defaults]) == 0
    assert capsys.readouterr().out == "recipes/gsm8k-qwen3-4b.yaml: valid\n"
    target = tmp_path / "params.yaml"
    target.write_text("untouched\n")
    assert cli_recipe(["no-such-recipe", "--params", str(target)]) == 2
    assert "no recipe 'no-such-recipe'" in capsys.readouterr().err
    bad = write_recipe(tmp_path / "bad.yaml", "train:\n  grpo:\n    learning_rate: -1\n")
    assert cli_recipe([str(bad), "--params", str(target), *defaults]) == 2
    assert capsys.readouterr().err == (f"vlmrl recipe: {bad} train.grpo.learning_rate: must be "
                                       "a number > 0, got -1\n")
    assert target.read_text() == "untouched\n"


def documented_keys(text: str) -> set[str]:
    """Dotted key paths of a params file whose line carries a comment."""
    found: set[str] = set()
    path: list[str] = []
    for line in text.splitlines():
        match = re.match(r"^( *)([A-Za-z_]\w*):(.*)$", line)
        if match:
            path = [*path[:len(match.group(1)) // 2], match.group(2)]
            if "#" in match.group(3):
                found.add(".".join(path))
    return found


@pytest.mark.parametrize("name", RECIPES)
def test_applying_a_recipe_keeps_the_comments(name: str, tmp_path: Path, monkeypatch) -> None:
    """`vlmrl recipe NAME` writes the merged params: every key params.yaml documents stays
    documented, and each comment the recipe gives its own keys is the one written."""
    monkeypatch.chdir(ROOT)
    target = tmp_path / "params.yaml"
    assert cli_recipe([name, "--params", str(target), "--defaults", str(ROOT / "params.yaml")]) == 0
    written = target.read_text()
    assert written == applied_text(name)
    assert sorted(documented_keys(DEFAULTS) - documented_keys(written)) == []
    recipe_lines = split_header(recipe_path(name, ROOT).read_text())[1].splitlines()

    def comments(lines: list[str]) -> set[str]:
        """Each line's comment (a recipe's flow list is written one item a line)."""
        return {" ".join(line.split("#", 1)[1].split()) for line in lines if "#" in line}

    assert comments(recipe_lines) <= comments(written.splitlines())


def dvc_round_trip(path: Path, key: str | None = None, value: object = None) -> list[str]:
    """The lines `dvc exp run -S key=value` changes in `path`: DVC's own `apply_overrides`, the
    function that runs its Hydra overrides over the params file (without a key, one that sets
    the file's first scalar to the value it has)."""
    import yaml
    from dvc.utils.hydra import apply_overrides

    before = path.read_text().splitlines()
    if key is None:
        section, values = next(iter(yaml.safe_load(path.read_text()).items()))
        name, same = next((k, v) for k, v in values.items() if isinstance(v, (int, str)))
        key, value = f"{section}.{name}", same
    apply_overrides(path, [f"{key}={value}"])
    after = path.read_text().splitlines()
    assert len(before) == len(after), "DVC added or removed lines"
    return [f"{old} -> {new}" for old, new in zip(before, after, strict=True) if old != new]


@pytest.mark.parametrize("name", RECIPES)
def test_dvc_exp_run_set_changes_one_line(name: str, tmp_path: Path) -> None:
    """params.yaml as `vlmrl recipe` writes it (the file `dvc exp run -S` edits) is what DVC's
    round trip writes back: `-S key=value` changes that key's line and no other, its lists
    included, which DVC's overrides rebuild whatever key they set."""
    path = tmp_path / "params.yaml"
    path.write_text(applied_text(name))
    assert dvc_round_trip(path) == []
    for key, value in [("train.grpo.learning_rate", 1e-4), ("data.config", "other"),
                       ("upload.bucket", "models")]:
        [changed] = dvc_round_trip(path, key, value)
        assert changed.split(" -> ")[1].lstrip().startswith(f"{key.rsplit('.', 1)[1]}: ")


def test_dvc_exp_run_set_changes_one_line_of_the_shipped_params(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text((ROOT / "params.yaml").read_text())
    assert dvc_round_trip(path) == []
    [changed] = dvc_round_trip(path, "train.grpo.learning_rate", 1e-4)
    assert changed.split(" -> ")[1].lstrip().startswith("learning_rate: ")


def test_recipes_never_stack_and_dvc_sees_only_the_recipes_keys(tmp_path: Path) -> None:
    """In a git + DVC repo the defaults are params.yaml at HEAD: a second recipe replaces the
    first, and `dvc params diff` lists exactly the keys the recipe sets."""
    from project_repo import make_project_repo

    repo = make_project_repo(tmp_path / "repo")
    run(["vlmrl", "recipe", "embedded-text"], repo)
    run(["vlmrl", "recipe", "gsm8k-qwen3-4b"], repo)
    assert (repo / "params.yaml").read_text() == applied_text("gsm8k-qwen3-4b")
    diff = json.loads(run(["dvc", "params", "diff", "--json"], repo).stdout)["params.yaml"]
    assert set(diff) == set(recipe_keys("gsm8k-qwen3-4b"))
    run(["vlmrl", "recipe", "embedded-vl"], repo)
    unchanged = subprocess.run(["git", "diff", "--quiet", "params.yaml"], cwd=repo, check=False)
    assert unchanged.returncode == 0


@pytest.mark.slow
def test_offline_text_recipe_runs_every_stage(tmp_path: Path) -> None:
    """The text path through all seven stages, applied the user's way
    (`vlmrl recipe`), and `dvc params diff` shows what the recipe changed."""
    from project_repo import make_project_repo, update_params

    repo = make_project_repo(tmp_path / "repo")
    run(["vlmrl", "recipe", "embedded-text"], repo)
    diff = run(["dvc", "params", "diff", "--json"], repo).stdout
    changed = json.loads(diff)["params.yaml"]
    assert changed["model.name"] == {"old": "embedded:tiny-qwen3-vl", "new": "embedded:tiny-qwen3"}
    assert "<THINK>" in str(changed["answer_format.reasoning_tags"]["new"])
    update_params(repo, SHORT)
    dvc_repro(repo)
    data = repo / "data"
    eval_rows = [json.loads(line) for line in
                 (data / "eval/baseline/records.jsonl").read_text().splitlines()]
    assert len(eval_rows) == SHORT["data.eval_size"] and all(r["pid"].startswith("auto-")
                                                             for r in eval_rows)
    gguf = sorted(path.name for path in (data / "models/gguf").glob("*.gguf"))
    assert gguf == ["model-Q4_K_M.gguf", "model-f16.gguf", "model-q8_0.gguf"]  # no projector
    config = json.loads((data / "models/merged/config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and "vision_config" not in config
    export = json.loads((data / "reports/details/export.json").read_text())
    assert export["passed"] is True and export["image_prompt"] is None
    assert json.loads((data / "reports/details/verify_lora.json").read_text())["passed"] is True
    card = (data / "reports/model_card.md").read_text()
    assert "pipeline_tag: text-generation" in card and "<THINK>" in card and "mmproj" not in card
    prompt = json.loads((data / "eval/baseline/records.jsonl").read_text().splitlines()[0])
    assert prompt["gold"].isdigit()  # the answer after ####
