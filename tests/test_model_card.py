"""The model card, rendered by the upload stage from the project's params, the eval and export
metrics and the GGUF folder, written to data/reports/model_card.md and published as the merged
model's README.md (replacing one the merged folder holds)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, dvc_repro, stage_command

from vlmrl.publish.errors import MissingInputError
from vlmrl.publish.model_card import CardInputs, gguf_roles

BASELINE = {"n": 16, "accuracy": 0.0625, "format_compliance": 0.25, "mean_reward": 0.4,
            "rewards": {"format_reward": 0.1, "correctness_reward": 0.0625}}
POST = {"n": 16, "accuracy": 0.1875, "format_compliance": 0.75, "mean_reward": 0.9,
        "rewards": {"format_reward": 0.3, "correctness_reward": 0.1875}}
EXPORT = {"checks_failed": 0,
          "logit_max_abs_diff": {"merged_vs_adapter": 0.002, "gguf_f16_vs_merged": 0.001}}
GGUF_SIZES = {"model-f16.gguf": 40_000, "model-q8_0.gguf": 21_000, "model-Q4_K_M.gguf": 12_000,
              "mmproj-f16.gguf": 30_000}


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def make_outputs(project: Path) -> Path:
    """The pipeline's outputs as the upload stage finds them, with the project's params.yaml."""
    shutil.copy(ROOT / "params.yaml", project / "params.yaml")
    models, metrics = project / "data/models", project / "data/metrics"
    write(models / "adapter/adapter_config.json", b'{"r": 8}')
    write(models / "merged/config.json", b'{"model_type": "qwen3_vl"}')
    write(models / "merged/README.md", b"an older card")
    for name, size in GGUF_SIZES.items():
        write(models / "gguf" / name, os.urandom(size))
    write(models / "gguf/README.md", b"# GGUF files\n\nRun model-Q4_K_M.gguf with mmproj-f16.gguf.\n")
    for name, payload in (("baseline_eval.json", BASELINE), ("post_eval.json", POST),
                          ("export.json", EXPORT)):
        write(metrics / name, json.dumps(payload).encode())
    return project


def run_upload_stage(project: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    _python, script, *flags = stage_command("upload")  # dvc.yaml's paths
    return subprocess.run([sys.executable, str(ROOT / script), *flags], cwd=project, env=env,
                          capture_output=True, text=True, check=False, timeout=300)


@pytest.fixture
def uploaded(tmp_path: Path) -> Path:
    project = make_outputs(tmp_path)
    completed = run_upload_stage(project)
    assert completed.returncode == 0, completed.stderr
    return project


def test_model_card_describes_training_results_and_usage(uploaded: Path) -> None:
    card = (uploaded / "data/reports/model_card.md").read_text()
    assert "base_model: embedded:tiny-qwen3-vl" in card
    assert "`embedded:synthetic`" in card
    weights = yaml.safe_load((uploaded / "params.yaml").read_text())["rewards"]["weights"]
    for name, weight in weights.items():
        assert f"| {name} | {float(weight):.4g} |" in card, name
    assert "| 8 | 16 | 0 | q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj |" in card
    assert "| importance_sampling_level | sequence |" in card
    assert "| accuracy | 0.0625 | 0.1875 |" in card
    assert "| reward format_reward | 0.1 | 0.3 |" in card
    assert "vlmrl serve --gguf . --file model-Q4_K_M.gguf" in card
    assert ("python -m llama_cpp.server --model model-Q4_K_M.gguf --clip_model_path "
            "mmproj-f16.gguf --chat_format mtmd") in card
    assert "MTMDChatHandler(clip_model_path='mmproj-f16.gguf')" in card
    assert "merged in (bfloat16)" in card
    assert "| merged_vs_adapter | 0.002 |" in card
    assert "| model-Q4_K_M.gguf | 11.7 KiB |" in card


def test_release_carries_a_card_as_each_groups_readme(uploaded: Path) -> None:
    manifest = json.loads((uploaded / "data/reports/upload_manifest.json").read_text())
    readmes = [e for e in manifest["files"] if e["path"] == "README.md"]
    expected = []
    for group, name in (("adapter", "model_card_adapter.md"), ("merged", "model_card.md"),
                        ("gguf", "model_card_gguf.md")):
        card = (uploaded / "data/reports" / name).read_bytes()
        expected.append({"group": group, "path": "README.md", "size": len(card),
                         "sha256": hashlib.sha256(card).hexdigest()})
    assert readmes == expected


def card_metadata(path: Path) -> dict:
    from huggingface_hub import ModelCard

    text = path.read_text()
    assert text.startswith("---\n")
    assert ModelCard(text).data.eval_results  # the hub's own parser reads the results
    return yaml.safe_load(text.split("---\n")[1])


def test_each_card_carries_hugging_face_metadata(uploaded: Path) -> None:
    reports = uploaded / "data/reports"
    cards = {"adapter": card_metadata(reports / "model_card_adapter.md"),
             "merged": card_metadata(reports / "model_card.md"),
             "gguf": card_metadata(reports / "model_card_gguf.md")}
    assert {k: (m["library_name"], m["base_model_relation"]) for k, m in cards.items()} == {
        "adapter": ("peft", "adapter"), "merged": ("transformers", "finetune"),
        "gguf": ("gguf", "quantized")}
    tags = ["qwen3-vl", "lora", "gspo", "grpo", "visual-math"]
    assert {k: m["tags"] for k, m in cards.items()} == {
        "adapter": tags, "merged": tags, "gguf": [*tags, "gguf"]}
    for group, name in (("adapter", "model_card_adapter.md"), ("merged", "model_card.md")):
        # a YAML block list, as Hugging Face's model card template writes tags
        assert "\ntags:\n" + "".join(f"- {tag}\n" for tag in tags) in (reports / name).read_text()
    for meta in cards.values():
        assert meta["base_model"] == "embedded:tiny-qwen3-vl" and meta["base_model_seed"] == 0
        assert meta["datasets"] == ["embedded:synthetic"]
        assert meta["pipeline_tag"] == "image-text-to-text"
        results = meta["model-index"][0]["results"][0]["metrics"]
        assert {r["type"]: r["value"] for r in results}["accuracy"] == POST["accuracy"]
    adapter = (reports / "model_card_adapter.md").read_text()
    assert "ensure_embedded_model('embedded:tiny-qwen3-vl', seed=0)" in adapter
    assert "PeftModel.from_pretrained(base, " in adapter and "| accuracy | 0.0625 | 0.1875 |" in adapter
    assert "[More Information Needed]" not in adapter
    gguf = (reports / "model_card_gguf.md").read_text()
    assert "Run model-Q4_K_M.gguf with mmproj-f16.gguf." in gguf and "| accuracy |" in gguf


def test_upload_refuses_a_release_that_names_this_machine(tmp_path: Path) -> None:
    project = make_outputs(tmp_path)
    config = project / "data/models/adapter/adapter_config.json"
    config.write_text(json.dumps({"r": 8, "base_model_name_or_path":
                                  f"{Path.home()}/.cache/vlmrl/models/tiny-qwen3-vl-seed0"}))
    completed = run_upload_stage(project)
    assert completed.returncode == 1
    assert "the release names this machine" in completed.stderr
    assert f"data/models/adapter/adapter_config.json: {Path.home()}/" in completed.stderr
    assert not (project / "data/reports/upload_manifest.json").exists()
    assert not (project / "data/reports/model_card_adapter.md").exists()


def test_card_without_export_metrics_names_the_export_stage(tmp_path: Path) -> None:
    project = make_outputs(tmp_path)
    (project / "data/metrics/export.json").unlink()
    completed = run_upload_stage(project)
    assert completed.returncode == 1
    assert "data/metrics/export.json" in completed.stderr and "made by export" in completed.stderr
    assert not (project / "data/reports/model_card.md").exists()
    assert not (project / "data/reports/upload_manifest.json").exists()


def test_usage_examples_use_the_smallest_model_file_and_the_projector() -> None:
    assert gguf_roles(GGUF_SIZES) == ("model-Q4_K_M.gguf", "mmproj-f16.gguf")
    assert gguf_roles({"model-f16.gguf": 9, "model-q8_0.gguf": 5, "mmproj-f16.gguf": 1}) == (
        "model-q8_0.gguf", "mmproj-f16.gguf")
    assert gguf_roles({"model-f16.gguf": 9}) == ("model-f16.gguf", None)  # a text model
    with pytest.raises(MissingInputError, match="needs a GGUF model file"):
        gguf_roles({"mmproj-f16.gguf": 1})


@pytest.mark.slow
def test_dvc_repro_upload_writes_the_card(pipeline_repo: Path) -> None:
    dvc_repro(pipeline_repo, "upload")
    assert "| accuracy |" in (pipeline_repo / "data/reports/model_card.md").read_text()
    assert not (pipeline_repo / "data/models/merged/README.md").exists()


@pytest.mark.slow
def test_the_whole_release_names_nothing_of_this_machine(pipeline_repo: Path) -> None:
    """Every byte of what the pipeline ships: the trained adapter, the export's and the upload's
    outputs (the cards the release carries as README.md)."""
    from vlmrl.models.portable import machine_values_in

    dvc_repro(pipeline_repo, "upload")
    data = pipeline_repo / "data"
    shipped = [p for group in ("models/adapter", "models/merged", "models/gguf")
               for p in (data / group).rglob("*") if p.is_file()]
    shipped += [data / "reports" / name for name in ("model_card.md", "model_card_adapter.md",
                                                     "model_card_gguf.md", "upload_manifest.json")]
    assert len(shipped) > 15
    assert machine_values_in(shipped) == []
    config = json.loads((data / "models/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "embedded:tiny-qwen3-vl"
    assert not (data / "models/adapter/README.md").exists()  # PEFT's template card


def text_run_outputs(project: Path, params_update: dict) -> Path:
    """A text model's outputs (no projector) on local data, with the project's params changed."""
    from project_repo import update_params

    make_outputs(project)
    (project / "data/models/gguf/mmproj-f16.gguf").unlink()
    update_params(project, {"model.name": "embedded:tiny-qwen3", "data.source": "local",
                            "data.path": "data/local/gsm8k.jsonl", **params_update})
    return project


@pytest.mark.parametrize(("sft_enabled", "baseline"), [(True, "before (base + SFT)"),
                                                       (False, "before (base)")])
def test_cards_name_the_local_data_and_the_baseline_for_what_they_are(
        tmp_path: Path, sft_enabled: bool, baseline: str) -> None:
    project = text_run_outputs(tmp_path, {"sft.enabled": sft_enabled})
    completed = run_upload_stage(project)
    assert completed.returncode == 0, completed.stderr
    reports = project / "data/reports"
    for name in ("model_card.md", "model_card_adapter.md", "model_card_gguf.md"):
        card = (reports / name).read_text()
        assert f"| metric | {baseline} | after (GSPO adapter) |" in card, name
        assert "testmini" not in card and "split" not in card, name
        meta = card_metadata(reports / name)
        assert meta["datasets"] == ["gsm8k.jsonl"]
        assert meta["model-index"][0]["results"][0]["dataset"] == {
            "name": "gsm8k.jsonl", "type": "gsm8k.jsonl"}
    card = (reports / "model_card.md").read_text()
    assert "- Data: `data/local/gsm8k.jsonl` (local), question types" in card


def released_adapter(folder: Path, name: str) -> None:
    """A real LoRA adapter on the built-in model `name`, saved as the release ships it: its
    base named by the model's name, not by a path of this machine."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from vlmrl.models.embedded import ensure_embedded_model

    model_class = AutoModelForCausalLM if name == "embedded:tiny-qwen3" else (
        AutoModelForImageTextToText)
    base = model_class.from_pretrained(ensure_embedded_model(name))
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                        exclude_modules=r".*\.visual\..*" if name.endswith("-vl") else None)
    get_peft_model(base, config).save_pretrained(str(folder))
    saved = folder / "adapter_config.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()),
                                 "base_model_name_or_path": name}))


def python_block(card: str) -> str:
    return card.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize(("name", "vision"), [("embedded:tiny-qwen3", False),
                                              ("embedded:tiny-qwen3-vl", True)])
def test_adapter_card_code_loads_the_released_adapter(tmp_path: Path, name: str,
                                                      vision: bool) -> None:
    """The card's own code, run as a user runs it in the released adapter's folder."""
    from project_repo import update_params

    from vlmrl.publish.model_card import build_release_cards

    project = make_outputs(tmp_path)
    update_params(project, {"model.name": name})
    if not vision:
        (project / "data/models/gguf/mmproj-f16.gguf").unlink()
    params = yaml.safe_load((project / "params.yaml").read_text())
    metrics = project / "data/metrics"
    inputs = CardInputs(baseline_metrics=metrics / "baseline_eval.json",
                        post_metrics=metrics / "post_eval.json",
                        export_metrics=metrics / "export.json", gguf=project / "data/models/gguf")
    card = build_release_cards(params, inputs)["adapter"]
    assert ("vision tower is not adapted" in card) is vision
    adapter = tmp_path / "released-adapter"
    released_adapter(adapter, name)
    check = "\nprint(type(model).__name__, type(base).__name__)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run([sys.executable, "-c", python_block(card) + check], cwd=adapter,
                               env=env, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    loaded = completed.stdout.split()
    assert loaded == ["PeftModelForCausalLM", "Qwen3VLForConditionalGeneration" if vision
                      else "Qwen3ForCausalLM"], loaded


def test_gguf_readme_and_modelfile_carry_the_training_system_prompt(tmp_path: Path) -> None:
    from vlmrl.export.gguf_release import write_gguf_consumer_files

    (tmp_path / "model-f16.gguf").write_bytes(b"GGUF")
    system = "You solve maths. Answer between <SOLUTION> and </SOLUTION>."
    write_gguf_consumer_files(tmp_path, {"f16": "model-f16.gguf"}, "tiny", system, {})
    readme = (tmp_path / "README.md").read_text()
    assert "## System prompt\n\nThe model was trained with this system prompt" in readme
    assert f"```text\n{system}\n```" in readme and "A text model: no projector." in readme
    assert f'SYSTEM """{system}"""' in (tmp_path / "Modelfile").read_text()
    assert "python -m llama_cpp.server --model model-f16.gguf --host" in readme  # no projector
    assert "vlmrl serve --gguf . --file model-f16.gguf" in readme


NOT_INSTALLED = ("llama-cli", "llama-server", "llama-mtmd-cli")


def test_cards_run_the_files_with_what_the_install_provides(uploaded: Path) -> None:
    """llama.cpp's own programs are not installed by the project (llama-cpp-python is): no card
    or README suggests them."""
    reports = uploaded / "data/reports"
    for name in ("model_card.md", "model_card_adapter.md", "model_card_gguf.md"):
        card = (reports / name).read_text()
        assert not [program for program in NOT_INSTALLED if program in card], name
    from vlmrl.export.gguf_release import render_gguf_readme

    for names in ({"Q4_K_M": "model-Q4_K_M.gguf", "mmproj": "mmproj-f16.gguf"},
                  {"f16": "model-f16.gguf"}):
        readme = render_gguf_readme(names, dict.fromkeys(names.values(), 1), "tiny", {})
        assert not [program for program in NOT_INSTALLED if program in readme]
        assert "vlmrl serve --gguf ." in readme and "python -m llama_cpp.server" in readme
