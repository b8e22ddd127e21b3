"""Users run the trained model without PEFT: as one 16-bit checkpoint, or as GGUF files under
llama.cpp. Each conversion can silently lose the adapter (a merge into 4-bit weights rounds it
away, a wrong file converts the base model) or break the model (a wrong tokenizer, a missing
projector), so every artifact is checked against the one before it on fixed inputs: the merged
weights against base + adapter, the merged model's logits against the adapter model's, the f16
GGUF against the merged model, and the base model's GGUF must NOT match, or the check could not
tell the adapter apart from noise. Everything is built in staging directories and appears only
when every check has passed. Also checked: the quantized files against the f16 one
(`vlmrl.export.checks`), an image prompt through GGUF + projector against the merged model's
greedy tokens, and, before anything is written, that disk and memory suffice."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vlmrl.data.prompts import prompt_question
from vlmrl.errors import UserError
from vlmrl.export.checks import (
    available_memory,
    checkpoint_parameters,
    compare_quantized,
    export_needs,
    free_disk,
    prompt_logits,
    quant_bounds_table,
    quant_prompt_ids,
    shortfalls,
)
from vlmrl.export.gguf import (
    GGUFError,
    convert_hf_to_gguf,
    converter_source,
    expected_tensor_type,
    llama_ftype,
    read_gguf_info,
)
from vlmrl.export.gguf_release import write_gguf_consumer_files
from vlmrl.export.llama_runtime import (
    greedy_tokens,
    image_chat,
    last_position_logits,
    open_gguf,
    quantize_gguf,
)
from vlmrl.models.backend import cuda_available
from vlmrl.models.embedded import resolve_model_path
from vlmrl.models.forward import (
    first_eval_row,
    forward_logits,
    hf_last_logits,
    max_abs_diff,
    question_inputs,
    text_prompt,
)
from vlmrl.models.loading import load_merged, merge_adapter, sixteen_bit
from vlmrl.models.merged_weights import check_adapter, compare_merged_weights
from vlmrl.models.portable import gguf_metadata, release_base_name, strip_machine_settings
from vlmrl.models.processor import is_text_checkpoint
from vlmrl.outputs import atomic_dir
from vlmrl.params import ExportParams, ModelParams, Params, ParamsError
from vlmrl.reporting.checks import Check
from vlmrl.reporting.timing import StepTimer
from vlmrl.rewards.answer_format import answer_format

# The f16 GGUF and the float32 reference hold the same weights (every bf16 value of the merged
# checkpoint is exact in f16 unless subnormal), so they differ by llama.cpp's f16 arithmetic:
# activations are rounded to f16 (unit roundoff 2**-11 = 4.9e-4) before each matmul. On the
# embedded model the deviation measured 6e-4 to 7e-4 of the largest |logit| (1.0e-3 absolute at
# max |logit| 1.5), about 1.4 roundoffs; the tolerance is 8 roundoffs of the largest |logit|
# (at least 1), a 5x margin. The base-GGUF control must exceed it, so an adapter too weak to
# clear it fails the export instead of passing unseen.
GGUF_F16_RTOL = 8 * 2.0**-11
GENERATED_TOKENS = 4
MMPROJ_OUTTYPE = "f16"
# Each converter run spends seconds importing torch and transformers on one core; two at a time
# keep both cores of a small machine busy without doubling peak memory on a large model.
CONVERTER_WORKERS = 2


class ExportError(UserError, RuntimeError):
    """An export check failed; the message lists every failed check."""


def check_quantize_types(settings: ExportParams) -> None:
    """`export.quantize` against the quantization types of the llama.cpp that will run them."""
    for kind in settings.quantize:
        try:
            llama_ftype(kind)
        except GGUFError as error:
            raise ParamsError(f"params.yaml export.quantize: {error}") from None


# ------------------------------------------------------------------------- GGUF


def gguf_file_names(settings: ExportParams, vision: bool = True) -> dict[str, str]:
    """kind -> file name; kinds are converter outtypes, quantize types and, for a
    vision-language model, `mmproj` (a text model has no projector)."""
    names = {kind: f"model-{kind}.gguf" for kind in settings.gguf_outtypes}
    names |= {kind: f"model-{kind}.gguf" for kind in settings.quantize}
    if vision:
        names["mmproj"] = f"mmproj-{MMPROJ_OUTTYPE}.gguf"
    return names


def build_gguf_files(merged_dir: Path, gguf_dir: Path, settings: ExportParams, source: Path,
                     step: StepTimer, base_dir: Path, scratch: Path,
                     vision: bool = True, model_name: str = "") -> dict[str, Path]:
    """Converts the merged model (every outtype, and the projector of a vision-language model)
    and, for the control, the base model; then quantizes from the f16 file. Returns kind ->
    path, the base as `base`. The files are named after `model_name`, not the staging folder."""
    names = gguf_file_names(settings, vision)
    metadata = scratch / "gguf-metadata.json"
    metadata.write_text(json.dumps(gguf_metadata(model_name)), encoding="utf-8")
    conversions = {kind: (merged_dir, gguf_dir / names[kind], kind, False)
                   for kind in settings.gguf_outtypes}
    if vision:
        conversions["mmproj"] = (merged_dir, gguf_dir / names["mmproj"], MMPROJ_OUTTYPE, True)
    conversions["base"] = (base_dir, scratch / "base-f16.gguf", "f16", False)
    jobs = {f"convert {kind} {out.name}": partial(convert_hf_to_gguf, model_dir, out, outtype,
                                                  mmproj=mmproj, source=source,
                                                  metadata=metadata)
            for kind, (model_dir, out, outtype, mmproj) in conversions.items()}
    done = step.parallel("convert (all, wall)", jobs, workers=CONVERTER_WORKERS)
    files = {kind: done[f"convert {kind} {out.name}"]
             for kind, (_dir, out, _type, _mmproj) in conversions.items()}
    for kind in settings.quantize:
        with step(f"quantize {names[kind]}"):
            files[kind] = quantize_gguf(files["f16"], gguf_dir / names[kind], kind)
    return files


def merged_image_reply(model, processor, row: Mapping) -> dict[str, Any]:
    """The merged model's first greedy tokens on the row's image and question as one user turn
    (what `image_chat` sends), with the image resized as the processor resizes it."""
    import torch

    question = prompt_question(row["prompt"])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[row["image"]], return_tensors="pt")
    patch = processor.image_processor.patch_size
    _frames, rows, columns = (int(v) for v in inputs["image_grid_thw"][0])
    with torch.no_grad():
        output = model.generate(**inputs.to(model.device), max_new_tokens=GENERATED_TOKENS,
                                do_sample=False)
    generated = output[0, inputs["input_ids"].shape[1]:].tolist()
    return {"image": row["image"].convert("RGB").resize((columns * patch, rows * patch)),
            "question": question, "tokens": generated,
            "text": processor.tokenizer.decode(generated)}


def run_gguf_text(path: Path, token_ids: Sequence[int], text: str) -> dict[str, Any]:
    """Last-position logits for the ids, a few greedy tokens, and whether llama.cpp's own
    tokenizer splits the text into the same ids."""
    with open_gguf(path, n_ctx=max(512, len(token_ids) + 64), logits_all=True) as llm:
        logits = last_position_logits(llm, token_ids)
        generated = greedy_tokens(llm, token_ids, GENERATED_TOKENS)
        own_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        generated_text = llm.detokenize(generated).decode("utf-8", errors="replace")
    return {"logits": logits, "generated": generated, "generated_text": generated_text,
            "tokenizer_matches": list(own_ids) == list(token_ids)}


def gguf_tolerance(reference) -> float:
    return GGUF_F16_RTOL * max(1.0, float(np.abs(reference).max()))


# ------------------------------------------------------------------------ export


def file_sizes(directory: Path, label: str) -> dict[str, int]:
    return {f"{label}/{path.name}": path.stat().st_size
            for path in sorted(directory.iterdir()) if path.is_file()}


def base_checkpoint_dir(settings: ModelParams) -> Path | None:
    """The local directory of the base checkpoint: the embedded model's, a local path, or a hub
    id's snapshot in the Hugging Face cache (the earlier stages loaded it); None if not found."""
    path = resolve_model_path(settings)
    if Path(path).is_dir():
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True,
                                      allow_patterns=["*.safetensors", "config.json"]))
    except Exception:  # noqa: BLE001  (not cached, or not a hub id: nothing to size)
        return None


def preflight(model_settings: ModelParams, settings: ExportParams, out_dir: Path, scratch: Path,
              free_space: Callable[[Path], int] = free_disk,
              memory: Callable[[], int] | None = None) -> dict[str, Any]:
    """Stops the export before it starts when the disk or the memory it needs is short."""
    base = base_checkpoint_dir(model_settings)
    if base is None:
        return {"checked": False, "why": f"{model_settings.name}: no local checkpoint to size"}
    parameters = checkpoint_parameters(base)
    kinds = [*settings.gguf_outtypes, *settings.quantize]
    needs = export_needs(parameters, kinds, out_dir, scratch,
                         float32_on_host=not cuda_available(), free_space=free_space,
                         memory=memory or available_memory)
    problem = shortfalls(needs)
    if problem:
        raise ExportError(f"not enough room to export {model_settings.name} ({parameters / 1e9:.2f} "
                          f"B parameters): {problem}. Free some space (or set TMPDIR to a larger "
                          "disk for the scratch) and rerun; nothing was written.")
    return {"checked": True, "parameters": parameters,
            "needs_bytes": {need.where: need.need for need in needs}}


def run_export(*, params: Params, adapter: Path, eval_set: Path, merged_out: Path,
               gguf_out: Path, show_progress: bool = True,
               free_space: Callable[[Path], int] = free_disk,
               memory: Callable[[], int] | None = None) -> dict[str, Any]:
    """Merges, converts and checks; the outputs appear only if every check passes. Returns the
    export metrics. `free_space` and `memory` measure the machine for the preflight."""
    model_settings, settings = params.model, params.export
    check_quantize_types(settings)
    check_adapter(adapter)
    row = first_eval_row(eval_set)
    total = 11 + len(settings.gguf_outtypes) + len(settings.quantize)
    with tempfile.TemporaryDirectory(prefix="vlmrl-export-") as scratch:
        room = preflight(sixteen_bit(model_settings, settings.dtype), settings,
                         Path(merged_out).absolute().parent, Path(scratch), free_space, memory)
        with tqdm(total=total, desc="export", disable=not show_progress) as bar, \
                atomic_dir(merged_out) as merged_dir, atomic_dir(gguf_out) as gguf_dir:
            step = StepTimer(bar=bar)
            exporter = _Exporter(model_settings, settings, step, Path(scratch),
                                 system_prompt=answer_format(params).system_text())
            metrics = exporter.run(Path(adapter), row, merged_dir, gguf_dir)
            metrics["preflight"] = room
            metrics["files"] = (file_sizes(merged_dir, merged_out.as_posix())
                                | file_sizes(gguf_dir, gguf_out.as_posix()))
            metrics["timings_s"] = step.rounded(3) | {"total": step.total()}
    return metrics


@dataclass
class _Exporter:
    model_settings: ModelParams
    settings: ExportParams
    step: StepTimer
    scratch: Path
    system_prompt: str = ""
    checks: list[Check] = field(default_factory=list)
    diffs: dict[str, float] = field(default_factory=dict)

    def run(self, adapter: Path, row: Mapping, merged_dir: Path, gguf_dir: Path) -> dict[str, Any]:
        with self.step("merge"):
            adapter_logits, base_logits = merge_adapter(
                self.model_settings, self.settings.dtype, adapter, row, merged_dir,
                self.scratch / "base")
            strip_machine_settings(merged_dir)
        with self.step("check merged weights"):
            self.check_merged_weights(self.scratch / "base", merged_dir, adapter)
        with self.step("reload merged"):
            text, token_ids, reference, merged_image = self.check_merged(
                merged_dir, row, adapter_logits, base_logits)
        del adapter_logits, base_logits
        with self.step("find converter"):
            source = converter_source()
        vision = not is_text_checkpoint(merged_dir)
        files = build_gguf_files(merged_dir, gguf_dir, self.settings, source, self.step,
                                 base_dir=self.scratch / "base", scratch=self.scratch,
                                 vision=vision, model_name=self.model_settings.name)
        base_file = files.pop("base")
        with self.step("check GGUF files"):
            gguf_report = self.check_gguf_files(files, token_ids, text, reference)
        with self.step("quantized vs f16"):
            quant_report = self.check_quantized(files, token_ids)
        image_reply = None  # a text model has no projector, and text rows no image
        if merged_image is not None:
            with self.step("image prompt"):
                image_reply = self.check_image_prompt(files, merged_image)
        with self.step("base GGUF control"):
            self.check_base_control(base_file, token_ids, text, reference)
        self.raise_on_failures()
        names = {kind: path.name for kind, path in files.items()}
        write_gguf_consumer_files(
            gguf_dir, names, f"{release_base_name(self.model_settings.name)} + GSPO LoRA",
            self.system_prompt, {c.name: c.detail for c in self.checks if "gguf" in c.name})
        return {
            "passed": True,
            "checks_failed": sum(not c.passed for c in self.checks),
            "dtype": self.settings.dtype,
            "logit_max_abs_diff": self.diffs,
            "tolerances": {"merged_vs_adapter": self.merged_tolerance(),
                           "gguf_f16_vs_merged": gguf_tolerance(reference)},
            "checks": {c.name: {"passed": c.passed, "detail": c.detail} for c in self.checks},
            "gguf": gguf_report,
            "image_prompt": image_reply,
            "quantized_vs_f16": quant_report,
            "text_prompt_tokens": len(token_ids),
        }

    def record(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, passed, detail))

    def merged_tolerance(self) -> float:
        return self.settings.merged_tolerance(self.diffs["adapter_vs_base"])

    def check_merged_weights(self, base_dir: Path, merged_dir: Path, adapter: Path) -> None:
        report = compare_merged_weights(base_dir, merged_dir, adapter, dtype=self.settings.dtype)
        self.record("merged_weights_match_adapter", report.passed, report.detail())

    def check_merged(self, merged_dir: Path, row: Mapping, adapter_logits, base_logits):
        """Reloads the merged directory alone (config, processor and all) and compares its logits
        with the adapter model's, both computed in float32 so that only the one rounding of the
        merged weights to 16 bits separates them; the tolerance grows with the adapter's own
        effect (`ExportParams.merged_tolerance`). Returns the text prompt and its float32
        reference logits."""
        model, processor = load_merged(merged_dir, dtype=self.reference_dtype())
        text, token_ids = text_prompt(processor, row)
        reference = hf_last_logits(model, token_ids)
        merged_logits = forward_logits(model, question_inputs(processor, row))
        diff = max_abs_diff(merged_logits, adapter_logits)
        effect = max_abs_diff(adapter_logits, base_logits)
        self.diffs["merged_vs_adapter"] = diff
        self.diffs["adapter_vs_base"] = effect
        tolerance = self.merged_tolerance()
        self.record("merged_matches_adapter", diff <= tolerance,
                    f"max |logit difference| {diff:.3g} on the image+question, both in float32 "
                    f"over {self.settings.dtype} weights; tolerance {tolerance:.3g} = "
                    f"max(export.logit_atol {self.settings.logit_atol:g}, export.logit_rtol "
                    f"{self.settings.logit_rtol:g} x the adapter's effect {effect:.3g})")
        merged_image = None
        if row.get("image") is not None and not is_text_checkpoint(merged_dir):
            merged_image = merged_image_reply(model, processor, row)
        return text, token_ids, reference, merged_image

    def reference_dtype(self) -> str:
        """float32 on a CPU (exact over 16-bit weights); on a GPU the export dtype, so that an
        8B model is never moved to float32 there (32 GB): the weight-space check stays exact."""
        return self.settings.dtype if cuda_available() else "float32"

    def check_quantized(self, files: Mapping[str, Path], token_ids: Sequence[int]) -> dict:
        """Every quantized model file against the f16 one, on QUANT_PROMPTS and the eval prompt."""
        quantized = [kind for kind in files if kind not in ("f16", "mmproj")]
        prompts = quant_prompt_ids(files["f16"], token_ids)
        reference = prompt_logits(files["f16"], prompts)
        reports = {}
        for kind in quantized:
            report = compare_quantized(kind, reference, prompt_logits(files[kind], prompts))
            self.record(f"gguf_{kind}_agrees_with_f16", report.passed, report.detail())
            reports[kind] = report
        return quant_bounds_table(reports)

    def check_image_prompt(self, files: Mapping[str, Path], merged: Mapping[str, Any]) -> dict:
        """The image prompt through the f16 GGUF and its projector must begin with the merged
        model's greedy tokens. The image goes in at the size the merged model's processor
        resizes it to: mtmd's Qwen3-VL resize policy ignores the checkpoint's max_pixels."""
        reply = image_chat(files["f16"], files["mmproj"], merged["image"], merged["question"],
                           max_tokens=GENERATED_TOKENS)
        agrees = reply["text"] == merged["text"]
        self.record("gguf_image_prompt_matches_merged", agrees,
                    f"first {GENERATED_TOKENS} greedy tokens through GGUF + projector "
                    f"{reply['text']!r}, merged model {merged['text']!r} (image "
                    f"{merged['image'].size[0]}x{merged['image'].size[1]})")
        return reply | {"merged_text": merged["text"]}

    def check_gguf_files(self, files: Mapping[str, Path], token_ids: Sequence[int], text: str,
                         reference) -> dict[str, Any]:
        report: dict[str, Any] = {}
        for kind, path in files.items():
            info = read_gguf_info(path)
            entry = {"architecture": info.architecture, "tensor_types": info.tensor_types}
            expected = expected_tensor_type(MMPROJ_OUTTYPE if kind == "mmproj" else kind)
            self.record(f"{path.name} tensor types", expected in info.tensor_types,
                        f"{info.tensor_types} (expects {expected})")
            if kind != "mmproj":
                entry |= self.check_gguf_model(kind, path, token_ids, text, reference)
            report[path.name] = entry
        return report

    def check_gguf_model(self, kind: str, path: Path, token_ids: Sequence[int], text: str,
                         reference) -> dict[str, Any]:
        run = run_gguf_text(path, token_ids, text)
        diff = max_abs_diff(run["logits"], reference)
        self.diffs[f"gguf_{kind}_vs_merged"] = diff
        self.record(f"{path.name} generates", len(run["generated"]) == GENERATED_TOKENS
                    and bool(np.isfinite(run["logits"]).all()),
                    f"{len(run['generated'])} tokens {run['generated_text']!r}")
        self.record(f"{path.name} tokenizer", run["tokenizer_matches"],
                    "llama.cpp's tokenizer splits the prompt into the transformers ids"
                    if run["tokenizer_matches"] else
                    "llama.cpp's tokenizer splits the prompt differently from transformers")
        if kind == "f16":
            tolerance = gguf_tolerance(reference)
            self.record("gguf_f16_matches_merged", diff <= tolerance,
                        f"max |last-position logit difference| {diff:.3g}, tolerance "
                        f"{tolerance:.3g}")
        return {"generated_tokens": run["generated"], "generated_text": run["generated_text"],
                "logit_max_abs_diff_vs_merged": diff}

    def check_base_control(self, base_file: Path, token_ids: Sequence[int], text: str,
                           reference) -> None:
        """The GGUF of the base model must not pass the parity check the merged GGUF passed."""
        run = run_gguf_text(base_file, token_ids, text)
        diff = max_abs_diff(run["logits"], reference)
        tolerance = gguf_tolerance(reference)
        self.diffs["base_gguf_f16_vs_merged"] = diff
        self.record("base_gguf_differs_from_merged", diff > tolerance,
                    f"base model's f16 GGUF differs from the merged model by {diff:.3g} "
                    f"(must exceed {tolerance:.3g}, or the parity check cannot see the adapter)")

    def raise_on_failures(self) -> None:
        failed = [check for check in self.checks if not check.passed]
        if failed:
            raise ExportError(f"export failed {len(failed)} of {len(self.checks)} checks:\n"
                              + "\n".join(f"  - {c.name}: {c.detail}" for c in failed))

