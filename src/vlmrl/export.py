"""Users run the trained model without PEFT: as one 16-bit checkpoint, or as GGUF files under
llama.cpp. Each conversion can silently lose the adapter (a merge into 4-bit weights rounds it
away, a wrong file converts the base model) or break the model (a wrong tokenizer, a missing
projector), so every artifact is checked against the one before it on fixed inputs: the merged
weights against base + adapter, the merged model's logits against the adapter model's, the f16
GGUF against the merged model, and the base model's GGUF must NOT match, or the check could not
tell the adapter apart from noise. Everything is built in staging directories and appears only
when every check has passed."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vlmrl.checks import Check
from vlmrl.gguf_tools import (
    GGUFError,
    convert_hf_to_gguf,
    converter_source,
    expected_tensor_type,
    greedy_tokens,
    image_chat,
    last_position_logits,
    llama_ftype,
    open_gguf,
    quantize_gguf,
    read_gguf_info,
)
from vlmrl.merged_weights import compare_merged_weights
from vlmrl.models.forward import (
    first_eval_row,
    forward_logits,
    hf_last_logits,
    max_abs_diff,
    question_inputs,
    text_prompt,
)
from vlmrl.models.loading import load_merged, merge_adapter
from vlmrl.models.processor import is_text_checkpoint
from vlmrl.outputs import atomic_dir
from vlmrl.params import ExportParams, ModelParams, Params, ParamsError
from vlmrl.prompts import prompt_question
from vlmrl.timing import StepTimer

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


class ExportError(RuntimeError):
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
                     vision: bool = True) -> dict[str, Path]:
    """Converts the merged model (every outtype, and the projector of a vision-language model)
    and, for the control, the base model; then quantizes from the f16 file. Returns kind ->
    path, the base as `base`."""
    names = gguf_file_names(settings, vision)
    conversions = {kind: (merged_dir, gguf_dir / names[kind], kind, False)
                   for kind in settings.gguf_outtypes}
    if vision:
        conversions["mmproj"] = (merged_dir, gguf_dir / names["mmproj"], MMPROJ_OUTTYPE, True)
    conversions["base"] = (base_dir, scratch / "base-f16.gguf", "f16", False)
    jobs = {f"convert {kind} {out.name}": partial(convert_hf_to_gguf, model_dir, out, outtype,
                                                  mmproj=mmproj, source=source)
            for kind, (model_dir, out, outtype, mmproj) in conversions.items()}
    done = step.parallel("convert (all, wall)", jobs, workers=CONVERTER_WORKERS)
    files = {kind: done[f"convert {kind} {out.name}"]
             for kind, (_dir, out, _type, _mmproj) in conversions.items()}
    for kind in settings.quantize:
        with step(f"quantize {names[kind]}"):
            files[kind] = quantize_gguf(files["f16"], gguf_dir / names[kind], kind)
    return files


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


def run_export(*, params: Params, adapter: Path, eval_set: Path, merged_out: Path,
               gguf_out: Path, show_progress: bool = True) -> dict[str, Any]:
    """Merges, converts and checks; the outputs appear only if every check passes. Returns the
    export metrics."""
    model_settings, settings = params.model, params.export
    check_quantize_types(settings)
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter}: no LoRA adapter (adapter_config.json) there; the "
                                "train_gspo stage makes it (dvc repro train_gspo)")
    row = first_eval_row(eval_set)
    total = 9 + len(settings.gguf_outtypes) + len(settings.quantize)
    with tqdm(total=total, desc="export", disable=not show_progress) as bar, \
            tempfile.TemporaryDirectory(prefix="vlmrl-export-") as scratch, \
            atomic_dir(merged_out) as merged_dir, atomic_dir(gguf_out) as gguf_dir:
        step = StepTimer(bar=bar)
        exporter = _Exporter(model_settings, settings, step, Path(scratch))
        metrics = exporter.run(Path(adapter), row, merged_dir, gguf_dir)
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
    checks: list[Check] = field(default_factory=list)
    diffs: dict[str, float] = field(default_factory=dict)

    def run(self, adapter: Path, row: Mapping, merged_dir: Path, gguf_dir: Path) -> dict[str, Any]:
        with self.step("merge"):
            adapter_logits, base_logits = merge_adapter(
                self.model_settings, self.settings.dtype, adapter, row, merged_dir,
                self.scratch / "base")
        with self.step("check merged weights"):
            self.check_merged_weights(self.scratch / "base", merged_dir, adapter)
        with self.step("reload merged"):
            text, token_ids, reference = self.check_merged(merged_dir, row, adapter_logits,
                                                           base_logits)
        del adapter_logits, base_logits
        with self.step("find converter"):
            source = converter_source()
        vision = not is_text_checkpoint(merged_dir)
        files = build_gguf_files(merged_dir, gguf_dir, self.settings, source, self.step,
                                 base_dir=self.scratch / "base", scratch=self.scratch,
                                 vision=vision)
        base_file = files.pop("base")
        with self.step("check GGUF files"):
            gguf_report = self.check_gguf_files(files, token_ids, text, reference)
        image_reply = None  # a text model has no projector, and text rows no image
        if vision and row.get("image") is not None:
            with self.step("image prompt"):
                image_reply = image_chat(files["f16"], files["mmproj"], row["image"],
                                         prompt_question(row["prompt"]))
        with self.step("base GGUF control"):
            self.check_base_control(base_file, token_ids, text, reference)
        self.raise_on_failures()
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
        model, processor = load_merged(merged_dir)
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
        return text, token_ids, reference

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

