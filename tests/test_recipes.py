"""Checked-in recipes: each is a complete params set that validates without downloading
anything, `vlmrl recipe` writes one over params.yaml so that `dvc params diff` shows what it
changed, and the offline text recipe runs all seven stages (GGUF without a projector). The other
offline recipe, embedded-vl, is params.yaml itself (checked here), which test_end_to_end runs
through every stage."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, dvc_repro, run

from vlmrl.rewards.answer_format import answer_format
from vlmrl.distributed.data_parallel import split_global_batch
from vlmrl.distributed.launch import DistributedParams, resolve
from vlmrl.params import ParamsError
from vlmrl.pipeline.recipes import RecipeError, available, check_recipe, cli_recipe, recipe_path, summary
from vlmrl.rewards.functions import build_rewards
from vlmrl.training.sft import build_sft_config
from vlmrl.training.gspo import build_grpo_config, local_generation_rows, split_batch

RECIPES = available(ROOT)
# Short enough for the test suite; every stage still does its real work.
SHORT = {"sft.args.max_steps": 2, "train.grpo.max_steps": 2, "data.eval_size": 4,
         "data.synthetic_size": 40, "train.grpo.per_device_train_batch_size": 4,
         "train.grpo.num_generations": 4, "eval.max_new_tokens": 16}


def test_the_five_recipes_are_checked_in() -> None:
    assert RECIPES == ["embedded-text", "embedded-vl", "gsm8k-qwen3-4b", "mathvista-qwen3-vl-2b",
                       "mathvista-qwen3-vl-8b"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_validates_against_every_schema(name: str, tmp_path: Path) -> None:
    path = recipe_path(name, ROOT)
    assert summary(path), f"{name}: the header must say what the recipe is for"
    assert "Needs:" in path.read_text(), f"{name}: the header must say what it needs"
    params = check_recipe(path)
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
    params = check_recipe(recipe_path(name, ROOT))
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
    recipe = yaml.safe_load(recipe_path("embedded-vl", ROOT).read_text())
    assert recipe == yaml.safe_load((ROOT / "params.yaml").read_text())


def test_bad_recipe_names_the_recipe_and_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["eval"]["top_p"] = 3
    bad.write_text(yaml.safe_dump(params))
    with pytest.raises(RecipeError, match=r"bad.yaml: params.yaml eval.top_p"):
        check_recipe(bad)
    with pytest.raises(RecipeError, match="no recipe 'nope'.*recipes: embedded-text"):
        recipe_path("nope", ROOT)


def test_cli_lists_checks_and_refuses_without_writing(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    assert cli_recipe([]) == 0
    listed = capsys.readouterr().out
    assert all(f"{name}: " in listed for name in RECIPES)
    assert cli_recipe(["gsm8k-qwen3-4b", "--check"]) == 0
    target = tmp_path / "params.yaml"
    target.write_text("untouched\n")
    assert cli_recipe(["no-such-recipe", "--params", str(target)]) == 2
    assert "no recipe 'no-such-recipe'" in capsys.readouterr().err
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


def leaf_values(params: dict, prefix: str = "") -> dict[str, object]:
    values: dict[str, object] = {}
    for key, value in params.items():
        if isinstance(value, dict) and value:
            values |= leaf_values(value, f"{prefix}{key}.")
        else:
            values[f"{prefix}{key}"] = value
    return values


@pytest.mark.parametrize("name", RECIPES)
def test_applying_a_recipe_keeps_the_comments_on_its_keys(name: str, tmp_path: Path,
                                                         monkeypatch) -> None:
    """`vlmrl recipe NAME` writes the recipe as it is, comments and all, and a recipe documents
    every key the shipped params.yaml documents where it keeps that key's value."""
    monkeypatch.chdir(ROOT)
    target = tmp_path / "params.yaml"
    assert cli_recipe([name, "--params", str(target)]) == 0
    written = target.read_text()
    assert written == recipe_path(name, ROOT).read_text()
    shipped_text = (ROOT / "params.yaml").read_text()
    shipped = leaf_values(yaml.safe_load(shipped_text))
    kept = {key for key, value in leaf_values(yaml.safe_load(written)).items()
            if key in shipped and shipped[key] == value}
    assert sorted(documented_keys(shipped_text) & kept - documented_keys(written)) == []


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
