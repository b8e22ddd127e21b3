"""export on the embedded model, through the real stage script: the merged model must reload
alone and match the adapter model, every GGUF file must load and generate, the f16 GGUF must
match the merged model while the base model's GGUF must not, and a damaged GGUF file must give
an error naming it, never a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, dvc_repro, run
from test_verify import make_adapter, prepare_workdir

from vlmrl.export.exporter import check_quantize_types, gguf_file_names, gguf_tolerance
from vlmrl.export.gguf import (
    GGUFError,
    converter_source,
    expected_tensor_type,
    is_converter_source,
    read_gguf_info,
)
from vlmrl.export.llama_runtime import greedy_tokens, image_chat, last_position_logits, open_gguf
from vlmrl.models.forward import (
    first_eval_row,
    forward_logits,
    hf_last_logits,
    question_inputs,
    text_prompt,
)
from vlmrl.models.loading import load_merged
from vlmrl.params import ExportParams, ParamsError

GGUF_NAMES = {"model-f16.gguf", "model-q8_0.gguf", "model-Q4_K_M.gguf", "mmproj-f16.gguf",
              "README.md", "Modelfile"}
MERGED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                "video_preprocessor_config.json"}


@dataclass
class Exported:
    workdir: Path
    adapter: Path
    result: subprocess.CompletedProcess
    metrics: dict

    @property
    def merged(self) -> Path:
        return self.workdir / "data/models/merged"

    @property
    def gguf(self) -> Path:
        return self.workdir / "data/models/gguf"

    @property
    def row(self) -> dict:
        return first_eval_row(self.workdir / "data/prepared/eval")


def run_export_stage(workdir: Path, adapter: Path, out: str = "data/models",
                     metrics: str = "data/metrics/export.json",
                     details: str = "data/reports/details/export.json",
                     timings: str = "data/reports/timings/export.json"):
    return run([sys.executable, str(ROOT / "stages/export.py"), "--adapter", str(adapter),
                "--eval-set", "data/prepared/eval", "--merged", f"{out}/merged",
                "--gguf", f"{out}/gguf", "--metrics", metrics, "--details", details,
                "--timings", timings], workdir, check=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Exported:
    workdir = prepare_workdir(tmp_path_factory.mktemp("export") / "repo")
    adapter = make_adapter(workdir / "data/models/adapter", b_scale=0.02)
    result = run_export_stage(workdir, adapter)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((workdir / "data/reports/details/export.json").read_text())
    return Exported(workdir, adapter, result, metrics)


def test_export_writes_every_artifact_and_its_metrics(exported: Exported) -> None:
    assert {p.name for p in exported.merged.iterdir()} == MERGED_FILES
    assert {p.name for p in exported.gguf.iterdir()} == GGUF_NAMES
    metrics = exported.metrics
    assert metrics["passed"] and all(c["passed"] for c in metrics["checks"].values())
    for name, size in metrics["files"].items():
        assert (exported.workdir / name).stat().st_size == size
    assert len(metrics["files"]) == len(MERGED_FILES) + len(GGUF_NAMES)
    assert set(metrics["logit_max_abs_diff"]) == {
        "merged_vs_adapter", "adapter_vs_base", "gguf_f16_vs_merged", "gguf_q8_0_vs_merged",
        "gguf_Q4_K_M_vs_merged", "base_gguf_f16_vs_merged"}
    assert "timings_s" not in metrics, "wall-clock times belong in the timings file"
    headline = json.loads((exported.workdir / "data/metrics/export.json").read_text())
    assert headline == {"checks_failed": 0, "logit_max_abs_diff": metrics["logit_max_abs_diff"]}
    timings = json.loads((exported.workdir / "data/reports/timings/export.json").read_text())
    assert timings["timings_s"]["total"] > timings["timings_s"]["merge"] > 0
    assert "exported data/models/merged and 4 GGUF files" in exported.result.stdout
    assert exported.metrics["preflight"]["checked"] is True
    assert exported.metrics["preflight"]["parameters"] > 40_000_000


def test_merged_model_is_16_bit_and_free_of_lora(exported: Exported) -> None:
    from safetensors import safe_open

    with safe_open(str(exported.merged / "model.safetensors"), "pt") as tensors:
        names = list(tensors.keys())
        dtypes = {str(tensors.get_slice(name).get_dtype()) for name in names}
    assert dtypes == {"BF16"}
    assert not [name for name in names if "lora" in name]
    config = json.loads((exported.merged / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]


def test_merged_model_reloads_alone_and_matches_the_adapter_model(exported: Exported) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.embedded import resolve_model_path
    from vlmrl.models.loading import attach_adapter, load_transformers_model
    from vlmrl.models.processor import load_processor
    from vlmrl.params import ModelParams

    row = exported.row
    merged = AutoModelForImageTextToText.from_pretrained(exported.merged, dtype=torch.bfloat16)
    merged_logits = forward_logits(merged, question_inputs(load_processor(exported.merged),
                                                                 row))
    settings = ModelParams(name="embedded:tiny-qwen3-vl", dtype="bfloat16")
    base_path = resolve_model_path(settings)
    with_adapter = attach_adapter(load_transformers_model(base_path, settings), exported.adapter)
    inputs = question_inputs(load_processor(base_path), row)
    adapter_logits = forward_logits(with_adapter, inputs)
    with with_adapter.disable_adapter():
        base_logits = forward_logits(with_adapter, inputs)

    # The stage's own tolerance: bf16 rounding of the merged weights moves the logits in
    # proportion to their scale, so it is relative to the adapter's effect when that is larger.
    settings = ExportParams()
    effect = float((adapter_logits - base_logits).abs().max())
    assert float((merged_logits - adapter_logits).abs().max()) <= settings.merged_tolerance(effect)
    assert float((merged_logits - base_logits).abs().max()) > 10 * settings.logit_atol  # adapter in


def test_every_gguf_file_loads_and_generates(exported: Exported) -> None:
    _text, token_ids = text_prompt(load_merged_processor(exported), exported.row)
    for name in ("model-f16.gguf", "model-q8_0.gguf", "model-Q4_K_M.gguf"):
        with open_gguf(exported.gguf / name) as llm:
            assert len(greedy_tokens(llm, token_ids, 3)) == 3, name
        assert exported.metrics["checks"][f"{name} generates"]["passed"]


def load_merged_processor(exported: Exported):
    from vlmrl.models.processor import load_processor

    return load_processor(exported.merged)


def test_f16_gguf_text_logits_match_the_merged_model(exported: Exported) -> None:
    model, processor = load_merged(exported.merged)
    _text, token_ids = text_prompt(processor, exported.row)
    reference = hf_last_logits(model, token_ids)
    with open_gguf(exported.gguf / "model-f16.gguf", logits_all=True) as llm:
        gguf_logits = last_position_logits(llm, token_ids)

    diff = float(abs(gguf_logits - reference).max())
    assert diff <= gguf_tolerance(reference)
    assert diff == pytest.approx(exported.metrics["logit_max_abs_diff"]["gguf_f16_vs_merged"],
                                 abs=1e-6)
    # the quantized files are checked to load, not to match: they are lossy by design
    assert exported.metrics["logit_max_abs_diff"]["gguf_Q4_K_M_vs_merged"] > diff


def test_base_model_gguf_does_not_match_the_merged_model(exported: Exported) -> None:
    diffs, tolerances = exported.metrics["logit_max_abs_diff"], exported.metrics["tolerances"]
    assert diffs["base_gguf_f16_vs_merged"] > 10 * tolerances["gguf_f16_vs_merged"]
    assert exported.metrics["checks"]["base_gguf_differs_from_merged"]["passed"]


def test_untrained_adapter_fails_the_base_control_and_keeps_the_earlier_outputs(
        exported: Exported) -> None:
    """With every lora_B zero the merged model IS the base model: the control must catch it,
    and the failed export leaves the outputs of the run before it as they were, nothing of its
    own."""
    workdir = exported.workdir
    adapter = make_adapter(workdir / "adapters/untrained")
    stale = [workdir / "data/failed/merged/config.json", workdir / "data/failed/gguf/x.gguf",
             workdir / "data/failed/metrics/export.json", workdir / "data/failed/details.json"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("stale")

    result = run_export_stage(workdir, adapter, out="data/failed",
                              metrics="data/failed/metrics/export.json",
                              details="data/failed/details.json")

    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "export failed 1 of 17 checks" in result.stderr
    assert "base_gguf_differs_from_merged" in result.stderr
    assert all(path.read_text() == "stale" for path in stale)  # the earlier run's, as they were
    assert sorted(path.name for path in (workdir / "data/failed/merged").iterdir()) == [
        "config.json"]
    assert sorted(path.name for path in (workdir / "data/failed/gguf").iterdir()) == ["x.gguf"]
    assert not list((workdir / "data/failed").glob(".merged*"))
    assert not list((workdir / "data/failed").glob(".gguf*"))


def test_q4_k_m_file_holds_q4_k_tensors_named_as_released(exported: Exported) -> None:
    """gguf-py's GGUFReader (the converter's) reads the quantized file and the projector; the
    model files carry the release's name, which `vlmrl serve` gives clients."""
    q4 = read_gguf_info(exported.gguf / "model-Q4_K_M.gguf")
    projector = read_gguf_info(exported.gguf / "mmproj-f16.gguf")

    assert q4.tensor_types["Q4_K"] > 0 and set(q4.tensor_types) <= {"Q4_K", "Q5_K", "Q6_K",
                                                                     "Q8_0", "F16", "F32"}
    assert (q4.architecture, q4.name) == ("qwen3vl", "tiny-qwen3-vl-gspo")
    assert projector.architecture == "clip" and projector.tensor_types["F16"] > 0
    assert exported.metrics["gguf"]["model-Q4_K_M.gguf"]["tensor_types"] == q4.tensor_types


def test_image_prompt_runs_through_the_mtmd_handler(exported: Exported) -> None:
    row = exported.row
    reply = image_chat(exported.gguf / "model-Q4_K_M.gguf", exported.gguf / "mmproj-f16.gguf",
                       row["image"], "What number is shown?", max_tokens=3)
    assert reply["usage"]["completion_tokens"] == 3 and isinstance(reply["text"], str)
    assert exported.metrics["image_prompt"]["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------ damaged files


def damaged_copies(source: Path, directory: Path) -> dict[str, Path]:
    data = source.read_bytes()
    variants = {
        "truncated": data[: len(data) // 2],
        "garbled-header": data[:4] + b"\xff" * 60 + data[64:],
        "bad-magic": b"GGML" + data[4:],
        "empty": b"",
    }
    paths = {}
    for name, blob in variants.items():
        paths[name] = directory / f"{name}.gguf"
        paths[name].write_bytes(blob)
    return paths


DAMAGE_PROBE = """
import sys
from pathlib import Path
from vlmrl.export.gguf import GGUFError, read_gguf_info
from vlmrl.export.llama_runtime import open_gguf
for name in sys.argv[1:]:
    for action in (read_gguf_info, lambda p: open_gguf(p).__enter__()):
        try:
            action(Path(name))
            print("LOADED", name)
        except GGUFError as error:
            print("ERROR", error)
"""


def test_damaged_gguf_files_give_errors_naming_them(exported: Exported, tmp_path: Path) -> None:
    paths = damaged_copies(exported.gguf / "model-f16.gguf", tmp_path)
    result = subprocess.run([sys.executable, "-c", DAMAGE_PROBE, *map(str, paths.values())],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr  # a crash would be a signal, not 0
    lines = result.stdout.splitlines()
    assert len(lines) == 2 * len(paths) and not [line for line in lines if "LOADED" in line]
    for name, path in paths.items():
        assert sum(line.startswith(f"ERROR {path}:") for line in lines) == 2, (name, lines)
    assert f"ERROR {paths['truncated']}: corrupted GGUF file (tensor " in result.stdout


def test_damaged_projector_gives_an_error_naming_it(exported: Exported, tmp_path: Path) -> None:
    damaged = tmp_path / "mmproj-f16.gguf"
    data = (exported.gguf / "mmproj-f16.gguf").read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match=f"^{damaged}: corrupted GGUF file"):
        image_chat(exported.gguf / "model-f16.gguf", damaged, exported.row["image"], "hi")


# ------------------------------------------------------------ settings and tools


def test_export_settings_follow_params() -> None:
    settings = ExportParams.from_params({"dtype": "float16", "gguf_outtypes": ["f16"],
                                         "quantize": ["Q4_K_M", "Q5_K_S"], "logit_atol": 0.1})
    check_quantize_types(settings)
    assert gguf_file_names(settings) == {"f16": "model-f16.gguf", "Q4_K_M": "model-Q4_K_M.gguf",
                                         "Q5_K_S": "model-Q5_K_S.gguf",
                                         "mmproj": "mmproj-f16.gguf"}
    for bad, message in (({"dtype": "float32"}, "export.dtype"),
                         ({"gguf_outtypes": ["q8_0"]}, "must include f16"),
                         ({"gguf_outtypes": ["f16", "q5"]}, "export.gguf_outtypes"),
                         ({"quantize": ["Q4_K_X"]}, "no quantization type 'Q4_K_X'"),
                         ({"logit_atol": 0}, "logit_atol"),
                         ({"threads": 2}, "unknown keys")):
        with pytest.raises(ParamsError, match=message):
            check_quantize_types(ExportParams.from_params(bad))


def test_expected_tensor_types() -> None:
    assert [expected_tensor_type(k) for k in ("Q4_K_M", "Q5_K_S", "q8_0", "f16", "IQ4_XS")] == [
        "Q4_K", "Q5_K", "Q8_0", "F16", "IQ4_XS"]


def test_converter_is_extracted_from_the_cached_sdist(tmp_path: Path, monkeypatch) -> None:
    from vlmrl.cache import cache_root
    from vlmrl.export.gguf import installed_llama_cpp_version

    version = installed_llama_cpp_version()
    sdist = cache_root() / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"{sdist} is not cached here")
    (tmp_path / "sdist").mkdir()
    (tmp_path / "sdist" / sdist.name).symlink_to(sdist)
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path))
    monkeypatch.delenv("VLMRL_LLAMA_CPP_SRC", raising=False)

    source = converter_source()

    assert source == tmp_path / f"llama.cpp-{version}" and is_converter_source(source)
    assert not (source / "ggml").exists()  # only the converter's parts, not 200 MB of C++
    assert converter_source() == source  # extracted once, reused
    assert not list(tmp_path.glob(".llama.cpp-*"))


def test_converter_missing_everywhere_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path))
    monkeypatch.delenv("VLMRL_LLAMA_CPP_SRC", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no registry: the download fails at once
    with pytest.raises(GGUFError, match="set \\$VLMRL_LLAMA_CPP_SRC to a llama.cpp checkout"):
        converter_source()
    monkeypatch.setenv("VLMRL_LLAMA_CPP_SRC", str(tmp_path))
    with pytest.raises(GGUFError, match="is not a llama.cpp source directory"):
        converter_source()


@pytest.mark.slow
def test_dvc_repro_export_through_the_pipeline(pipeline_repo: Path) -> None:
    dvc_repro(pipeline_repo, "export")
    metrics = json.loads((pipeline_repo / "data/metrics/export.json").read_text())
    assert metrics["checks_failed"] == 0
    assert json.loads((pipeline_repo / "data/metrics/verify_lora.json").read_text()) \
        ["checks_failed"] == 0
    assert {p.name for p in (pipeline_repo / "data/models/gguf").iterdir()} == GGUF_NAMES


# ------------------------------------------------------------ checks that can fail


def garbled_copy(source: Path, target: Path) -> Path:
    """The same header, the tensor data of the second half reversed: loads, computes nonsense."""
    data = bytearray(source.read_bytes())
    half = len(data) // 2
    data[half:] = data[half:][::-1]
    target.write_bytes(bytes(data))
    return target


def test_quantized_files_agree_with_f16_within_their_bounds(exported: Exported) -> None:
    from vlmrl.export.checks import QUANT_BOUNDS

    table = exported.metrics["quantized_vs_f16"]
    assert set(table) == {"q8_0", "Q4_K_M"}
    for kind, row in table.items():
        assert row["top1_agreement"] >= QUANT_BOUNDS[kind].min_top1
        assert row["max_relative_error"] <= QUANT_BOUNDS[kind].max_relative_error
        assert exported.metrics["checks"][f"gguf_{kind}_agrees_with_f16"]["passed"]
    assert table["q8_0"]["max_relative_error"] < table["Q4_K_M"]["max_relative_error"]


def test_quant_check_fails_on_a_wrong_file(exported: Exported, tmp_path: Path) -> None:
    """The Q4_K_M file passed off as q8_0 breaks q8_0's bounds; garbled tensor data breaks
    Q4_K_M's."""
    from vlmrl.export.checks import compare_quantized, prompt_logits, quant_prompt_ids

    f16 = exported.gguf / "model-f16.gguf"
    prompts = quant_prompt_ids(f16)
    reference = prompt_logits(f16, prompts)
    assert compare_quantized("q8_0", reference, prompt_logits(exported.gguf / "model-q8_0.gguf",
                                                               prompts)).passed
    as_q8 = compare_quantized("q8_0", reference,
                              prompt_logits(exported.gguf / "model-Q4_K_M.gguf", prompts))
    assert not as_q8.passed and "top-1 agreement" in as_q8.detail()
    garbled = garbled_copy(exported.gguf / "model-Q4_K_M.gguf", tmp_path / "model-Q4_K_M.gguf")
    report = compare_quantized("Q4_K_M", reference, prompt_logits(garbled, prompts))
    assert not report.passed
    assert report.top1_agreement < 0.2


def image_exporter(tmp_path: Path):
    from vlmrl.export.exporter import _Exporter
    from vlmrl.params import ModelParams
    from vlmrl.reporting.timing import StepTimer

    return _Exporter(ModelParams(name="embedded:tiny-qwen3-vl"), ExportParams(), StepTimer(),
                     tmp_path)


def test_image_prompt_through_gguf_matches_the_merged_model(exported: Exported,
                                                           tmp_path: Path) -> None:
    from vlmrl.export.exporter import merged_image_reply

    check = exported.metrics["checks"]["gguf_image_prompt_matches_merged"]
    assert check["passed"], check["detail"]
    reply = exported.metrics["image_prompt"]
    assert reply["text"] == reply["merged_text"] and reply["usage"]["completion_tokens"] >= 1

    model, processor = load_merged(exported.merged)
    merged = merged_image_reply(model, processor, exported.row)
    exporter = image_exporter(tmp_path)
    files = {"f16": garbled_copy(exported.gguf / "model-f16.gguf", tmp_path / "model-f16.gguf"),
             "mmproj": exported.gguf / "mmproj-f16.gguf"}
    exporter.check_image_prompt(files, merged)
    assert [c.passed for c in exporter.checks] == [False]
    assert "merged model" in exporter.checks[0].detail


def test_preflight_stops_before_anything_is_written(exported: Exported) -> None:
    from vlmrl.export.exporter import ExportError, run_export
    from vlmrl.params import load_params

    workdir = exported.workdir
    params = load_params(workdir / "params.yaml")
    out = workdir / "data/short"
    with pytest.raises(ExportError, match=r"not enough room to export embedded:tiny-qwen3-vl .*"
                                          r"disk \(outputs.*needs 0\.\d GiB, 0\.0 GiB free"):
        run_export(params=params, adapter=exported.adapter,
                   eval_set=workdir / "data/prepared/eval", merged_out=out / "merged",
                   gguf_out=out / "gguf", show_progress=False, free_space=lambda path: 1024**2)
    with pytest.raises(ExportError, match=r"memory at /proc/meminfo: needs 0\.\d GiB"):
        run_export(params=params, adapter=exported.adapter,
                   eval_set=workdir / "data/prepared/eval", merged_out=out / "merged",
                   gguf_out=out / "gguf", show_progress=False, memory=lambda: 1024**2)
    assert not out.exists()


def test_preflight_sizes_an_8b_export(tmp_path: Path) -> None:
    from vlmrl.export.checks import GIB, export_needs

    needs = export_needs(8_770_000_000, ["f16", "q8_0", "Q4_K_M"], tmp_path, tmp_path,
                         float32_on_host=False, free_space=lambda path: 100 * GIB,
                         memory=lambda: 64 * GIB)
    by_where = {need.where: need for need in needs}
    disk = by_where["disk (outputs and scratch)"]
    # merged 17.5 + base copy 17.5 + GGUF 17.5 + 9.4 + 5.3 + base control 17.5 GB, + 10%
    assert 80 * GIB < disk.need < 95 * GIB
    assert not by_where["memory"].short and by_where["memory"].need < 20 * GIB


def test_gguf_folder_tells_a_consumer_what_to_run(exported: Exported) -> None:
    from vlmrl.rewards.answer_format import answer_format

    readme = (exported.gguf / "README.md").read_text()
    assert "`mmproj-f16.gguf` | " in readme and "needed for image input" in readme
    assert ("python -m llama_cpp.server --model model-Q4_K_M.gguf --clip_model_path "
            "mmproj-f16.gguf --chat_format mtmd") in readme
    assert "gguf_q8_0_agrees_with_f16: top-1 agreement" in readme
    modelfile = (exported.gguf / "Modelfile").read_text().splitlines()
    assert modelfile[:2] == ["FROM ./model-Q4_K_M.gguf", "FROM ./mmproj-f16.gguf"]
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    system = answer_format(yaml_params(exported)).system_text()
    assert f'SYSTEM """{system}"""' in "\n".join(modelfile)
    assert any(line.startswith('TEMPLATE """') for line in modelfile)


def yaml_params(exported: Exported) -> dict:
    import yaml

    return yaml.safe_load((exported.workdir / "params.yaml").read_text())


def test_exported_files_name_nothing_of_this_machine(exported: Exported) -> None:
    """Every byte of the merged model and the GGUF folder, binary files included."""
    from vlmrl.models.portable import machine_values, machine_values_in

    files = [p for p in [*exported.merged.iterdir(), *exported.gguf.iterdir()] if p.is_file()]
    assert {p.name for p in files} >= set(GGUF_NAMES)
    assert machine_values_in(files) == []
    tokenizer_config = json.loads((exported.merged / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tokenizer_config and "is_local" not in tokenizer_config
    # the scan can fail: the adapter as PEFT saved it names the cache directory
    assert machine_values_in([exported.adapter / "adapter_config.json"]) != []
    assert "local_files_only" in machine_values()
    names = [p.name for p in exported.gguf.glob("*.gguf")]
    for name in names:
        assert b".merged." not in (exported.gguf / name).read_bytes()[:4096], name
