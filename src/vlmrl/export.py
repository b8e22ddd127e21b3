"""Users run the trained model without PEFT: as one 16-bit checkpoint, or as GGUF files under
llama.cpp. Each conversion can silently lose the adapter (a merge into 4-bit weights rounds it
away, a wrong file converts the base model) or break the model (a wrong tokenizer, a missing
projector), so every artifact is checked against the one before it on fixed inputs: the merged
weights against base + adapter, the merged model's logits against the adapter model's, the f16
GGUF against the merged model, and the base model's GGUF must NOT match, or the check could not
tell the adapter apart from noise. Everything is built in staging directories and appears only
when every check has passed."""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from vlmrl.config import ParamsError, section
from vlmrl.gguf_tools import (
    CONVERTER_OUTTYPES,
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
from vlmrl.merged_weights import cast_floating_tensors, compare_merged_weights
from vlmrl.modeling import ModelSettings
from vlmrl.outputs import atomic_dir
from vlmrl.verify import (
    Check,
    adapter_and_base_logits,
    first_eval_row,
    forward_logits,
    image_question_inputs,
)

EXPORT_DTYPES = ("bfloat16", "float16")
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


@dataclass(frozen=True)
class ExportSettings:
    dtype: str = "bfloat16"
    gguf_outtypes: tuple[str, ...] = ("f16", "q8_0")
    quantize: tuple[str, ...] = ("Q4_K_M",)
    logit_atol: float = 0.05
    logit_rtol: float = 0.25

    @classmethod
    def from_params(cls, export: Mapping[str, Any]) -> ExportSettings:
        unknown = sorted(set(export) - set(cls.__dataclass_fields__))
        if unknown:
            raise ParamsError(f"params.yaml `export` has unknown keys {unknown}; known: "
                              f"{sorted(cls.__dataclass_fields__)}")
        values = dict(export)
        for key in ("gguf_outtypes", "quantize"):
            if key in values:
                values[key] = tuple(values[key] or ())
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise ParamsError(f"params.yaml `export.dtype` is {self.dtype!r}; use one of "
                              f"{EXPORT_DTYPES} (the merge is never done in 4-bit)")
        bad = [t for t in self.gguf_outtypes if t not in CONVERTER_OUTTYPES]
        if bad:
            raise ParamsError(f"params.yaml `export.gguf_outtypes` has {bad}; the converter "
                              f"knows {list(CONVERTER_OUTTYPES)}")
        if "f16" not in self.gguf_outtypes:
            raise ParamsError("params.yaml `export.gguf_outtypes` must include f16: the parity "
                              "check and `export.quantize` start from the f16 file")
        for kind in self.quantize:
            try:
                llama_ftype(kind)
            except GGUFError as error:
                raise ParamsError(f"params.yaml `export.quantize`: {error}") from None
        if not (self.logit_atol > 0 and math.isfinite(self.logit_atol)):
            raise ParamsError(f"params.yaml `export.logit_atol` must be > 0, got {self.logit_atol}")
        if not 0 <= self.logit_rtol < 1:
            raise ParamsError("params.yaml `export.logit_rtol` must be in [0, 1) (a fraction of the "
                              f"adapter's own effect on the logits), got {self.logit_rtol}")

    def merged_tolerance(self, adapter_effect: float) -> float:
        """16-bit rounding of the merged weights moves the logits more the deeper the model; a
        merge that lost the adapter moves them by the adapter's whole effect."""
        return max(self.logit_atol, self.logit_rtol * adapter_effect)


@dataclass
class StepTimer:
    """Times the export's named steps and shows them as a progress bar."""

    timings: dict[str, float] = field(default_factory=dict)
    bar: Any = None
    started: float = field(default_factory=time.perf_counter)

    def total(self) -> float:
        return round(time.perf_counter() - self.started, 3)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.bar is not None:
            self.bar.set_description(name)
        start = time.perf_counter()
        yield
        self.timings[name] = round(time.perf_counter() - start, 3)
        if self.bar is not None:
            self.bar.update(1)

    def parallel(self, phase: str, jobs: Mapping[str, Callable[[], Any]],
                 workers: int) -> dict[str, Any]:
        """Runs independent jobs (subprocess-bound: the converter) `workers` at a time; each
        job's own wall time is recorded under its name, the whole phase's under `phase`."""
        def timed(name: str) -> Any:
            start = time.perf_counter()
            result = jobs[name]()
            self.timings[name] = round(time.perf_counter() - start, 3)
            return result

        results = {}
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(timed, name): name for name in jobs}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if self.bar is not None:
                    self.bar.set_description(futures[future])
                    self.bar.update(1)
        self.timings[phase] = round(time.perf_counter() - start, 3)
        return results


# ------------------------------------------------------------------------ merge


def sixteen_bit(settings: ModelSettings, dtype: str) -> ModelSettings:
    return replace(settings, dtype=dtype, load_in_4bit=False)


def check_16bit_checkpoint(path: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None):
        raise ExportError(f"{path} is a pre-quantized checkpoint; merging needs the 16-bit base "
                          "weights: point model.name at the 16-bit model for export")


def merge_adapter(model_settings: ModelSettings, dtype: str, adapter: Path, row: Mapping,
                  out_dir: Path, base_dir: Path):
    """Writes the merged 16-bit model with its processor files to `out_dir`, and the 16-bit base
    it was merged into to `base_dir` (for the base-GGUF control: then only the adapter tells the
    two apart, not bf16 rounding). Returns the adapter model's and the base model's logits on the
    row's image+question."""
    from vlmrl.modeling import pick_backend

    settings = sixteen_bit(model_settings, dtype)
    if pick_backend(settings.backend) == "unsloth":
        return _merge_with_unsloth(settings, adapter, row, out_dir, base_dir)
    return _merge_with_transformers(settings, adapter, row, out_dir, base_dir)


def _merge_with_transformers(settings: ModelSettings, adapter: Path, row: Mapping,
                             out_dir: Path, base_dir: Path):
    from vlmrl.modeling import (
        attach_adapter,
        load_processor,
        load_transformers_model,
        resolve_model_path,
    )

    path = resolve_model_path(settings)
    check_16bit_checkpoint(path)
    processor = load_processor(path)
    model = load_transformers_model(path, settings)
    save_with_processor(model, processor, base_dir)
    dtype = model.dtype
    model = attach_adapter(model, adapter).float()
    logits = adapter_and_base_logits(model, image_question_inputs(processor, row))
    save_with_processor(model.merge_and_unload().to(dtype), processor, out_dir)
    return logits


def _merge_with_unsloth(settings: ModelSettings, adapter: Path, row: Mapping, out_dir: Path,
                        base_dir: Path):
    """GPU only. Unsloth's own 16-bit merge where it patched one in, PEFT's otherwise; the base
    is loaded in 16-bit either way (`sixteen_bit`), so nothing is merged into 4-bit weights."""
    import unsloth  # noqa: F401  (patches transformers before the model loads)

    from vlmrl.embedded import save_processor_files
    from vlmrl.modeling import resolve_model_path
    from vlmrl.unsloth_backend import load_unsloth_adapter_model, load_unsloth_model

    path = resolve_model_path(settings)
    model, processor = load_unsloth_model(path, settings)
    save_with_processor(model, processor, base_dir)
    del model
    model = load_unsloth_adapter_model(adapter, settings)
    logits = adapter_and_base_logits(model, image_question_inputs(processor, row))
    if hasattr(model, "save_pretrained_merged"):
        model.save_pretrained_merged(str(out_dir), processor.tokenizer,
                                     save_method="merged_16bit")
        cast_floating_tensors(out_dir, settings.dtype)
        save_processor_files(out_dir, processor.image_processor, processor.tokenizer)
    else:
        save_with_processor(model.merge_and_unload(), processor, out_dir)
    return logits


def save_with_processor(model, processor, out_dir: Path) -> None:
    """safetensors plus tokenizer, chat template and image processor: a directory that
    AutoModelForImageTextToText, AutoProcessor and llama.cpp's converter each read alone."""
    from vlmrl.embedded import save_processor_files

    model.save_pretrained(out_dir)
    save_processor_files(out_dir, processor.image_processor, processor.tokenizer)


def load_merged(merged_dir: Path):
    """The merged model and processor, from the directory alone, in float32 (exact: every value
    of a 16-bit checkpoint is a float32)."""
    from vlmrl.modeling import load_processor, load_transformers_model

    settings = ModelSettings(name=str(merged_dir), backend="transformers", dtype="float32")
    return load_transformers_model(str(merged_dir), settings), load_processor(merged_dir)


def max_abs_diff(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    return float(np.abs(a - b).max())


# ------------------------------------------------------------------ text prompt


def text_prompt(processor, row: Mapping) -> tuple[str, list[int]]:
    """The row's question without its image, as chat-template text and its token ids; llama.cpp
    is fed these very ids, so both models see identical tokens."""
    messages = [{"role": message["role"],
                 "content": [part for part in message["content"] if part["type"] == "text"]}
                for message in row["prompt"]]
    tokenizer = processor.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def question_text(row: Mapping) -> str:
    return "\n".join(part["text"] for message in row["prompt"] if message["role"] == "user"
                     for part in message["content"] if part["type"] == "text")


def hf_last_logits(model, token_ids: Sequence[int]):
    import torch

    from vlmrl.modeling import model_device

    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], device=model_device(model))
        return model(input_ids=ids).logits[0, -1].float().cpu().numpy()


# ------------------------------------------------------------------------- GGUF


def gguf_file_names(settings: ExportSettings) -> dict[str, str]:
    """kind -> file name; kinds are converter outtypes, quantize types and `mmproj`."""
    names = {kind: f"model-{kind}.gguf" for kind in settings.gguf_outtypes}
    names |= {kind: f"model-{kind}.gguf" for kind in settings.quantize}
    names["mmproj"] = f"mmproj-{MMPROJ_OUTTYPE}.gguf"
    return names


def build_gguf_files(merged_dir: Path, gguf_dir: Path, settings: ExportSettings, source: Path,
                     step: StepTimer, base_dir: Path, scratch: Path) -> dict[str, Path]:
    """Converts the merged model (every outtype and the projector) and, for the control, the
    base model; then quantizes from the f16 file. Returns kind -> path, the base as `base`."""
    names = gguf_file_names(settings)
    conversions = {kind: (merged_dir, gguf_dir / names[kind], kind, False)
                   for kind in settings.gguf_outtypes}
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
    import numpy as np

    return GGUF_F16_RTOL * max(1.0, float(np.abs(reference).max()))


# ------------------------------------------------------------------------ export


def file_sizes(directory: Path, label: str) -> dict[str, int]:
    return {f"{label}/{path.name}": path.stat().st_size
            for path in sorted(directory.iterdir()) if path.is_file()}


def run_export(*, params: Mapping[str, Any], adapter: Path, eval_set: Path, merged_out: Path,
               gguf_out: Path, show_progress: bool = True) -> dict[str, Any]:
    """Merges, converts and checks; the outputs appear only if every check passes. Returns the
    export metrics."""
    from tqdm import tqdm

    model_settings = ModelSettings.from_params(section(params, "model"))
    settings = ExportSettings.from_params(section(params, "export"))
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
        metrics["timings_s"] = step.timings | {"total": step.total()}
    return metrics


@dataclass
class _Exporter:
    model_settings: ModelSettings
    settings: ExportSettings
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
        files = build_gguf_files(merged_dir, gguf_dir, self.settings, source, self.step,
                                 base_dir=self.scratch / "base", scratch=self.scratch)
        base_file = files.pop("base")
        with self.step("check GGUF files"):
            gguf_report = self.check_gguf_files(files, token_ids, text, reference)
        with self.step("image prompt"):
            image_reply = image_chat(files["f16"], files["mmproj"], row["image"],
                                     question_text(row))
        with self.step("base GGUF control"):
            self.check_base_control(base_file, token_ids, text, reference)
        self.raise_on_failures()
        return {
            "passed": True,
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
        effect (`ExportSettings.merged_tolerance`). Returns the text prompt and its float32
        reference logits."""
        model, processor = load_merged(merged_dir)
        text, token_ids = text_prompt(processor, row)
        reference = hf_last_logits(model, token_ids)
        merged_logits = forward_logits(model, image_question_inputs(processor, row))
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
        import numpy as np

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

