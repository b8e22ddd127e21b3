"""Checks of the export that can fail, apart from the merge itself: the quantized GGUF files
against the f16 one on fixed prompts, and a preflight that stops an export the machine has no
room for before it writes a byte (an 8B export stages tens of GB: merged model, the base it was
merged into, four GGUF files).

Quantization bounds were measured on the embedded tiny Qwen3-VL (hidden size 256, the worst case
for top-1 agreement: a random model's logits are nearly flat, so a small error swaps the top
token) over the 195 positions of QUANT_PROMPTS plus the eval prompt, merged with the random
LoRA of tests/test_export.py (b_scale 0.02; the export metrics' `quantized_vs_f16`):

| quant | top-1 agreement with f16 | max |logit error| / max(1, max |f16 logit|) |
| --- | --- | --- |
| q8_0 | 0.974 | 0.026 |
| Q4_K_M | 0.677 | 0.257 |

q8_0 keeps 8 bits per weight with one scale per 32 (weight error ~2**-8), so its bound is 0.06,
2.3x the measured error, and top-1 may drop to 0.85; Q4_K_M keeps ~4.8 bits (weight error ~2**-5,
8-16x q8_0's, as measured: 10x), so its bound is 0.5, about 2x, and top-1 at least 0.4. A real
model's logits have clear margins and agree better; a wrong or damaged file (the Q4_K_M file
passed off as q8_0, garbled tensor data) breaks them: tests/test_export.py feeds both."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmrl.errors import UserError
from vlmrl.export.llama_runtime import open_gguf

QUANT_PROMPTS = (
    "<|im_start|>user\nWhat is 3 + 4? Answer with a number.<|im_end|>\n<|im_start|>assistant\n",
    ("<|im_start|>user\nA triangle has angles 30 and 60 degrees. What is the third angle?"
     "<|im_end|>\n<|im_start|>assistant\n"),
    ("<|im_start|>user\nRead the bar chart and give the largest value.<|im_end|>\n"
     "<|im_start|>assistant\n<REASONING>"),
    "The quick brown fox jumps over the lazy dog. 1, 2, 3, 4, 5, 6, 7, 8",
)


@dataclass(frozen=True)
class QuantBound:
    min_top1: float
    max_relative_error: float


QUANT_BOUNDS = {"q8_0": QuantBound(0.85, 0.06), "Q4_K_M": QuantBound(0.4, 0.5)}
# Other K-quants and legacy quants: Q4_K_M's bounds for 4 bits and more, none below.
DEFAULT_BOUND = QUANT_BOUNDS["Q4_K_M"]


@dataclass(frozen=True)
class QuantReport:
    kind: str
    positions: int
    top1_agreement: float
    max_relative_error: float
    bound: QuantBound

    @property
    def passed(self) -> bool:
        return (self.top1_agreement >= self.bound.min_top1
                and self.max_relative_error <= self.bound.max_relative_error)

    def detail(self) -> str:
        return (f"top-1 agreement with f16 {self.top1_agreement:.3f} over {self.positions} "
                f"positions (at least {self.bound.min_top1}), max |logit error| "
                f"{self.max_relative_error:.3g} of max(1, |f16 logit|) (at most "
                f"{self.bound.max_relative_error})")


def prompt_logits(path: Path, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """Logits of every position of every prompt, stacked (positions x vocabulary)."""
    rows = []
    with open_gguf(path, n_ctx=max(512, max(map(len, prompts)) + 8), logits_all=True) as llm:
        for ids in prompts:
            llm.reset()
            llm.eval(list(ids))
            rows.append(np.array(llm.scores[:len(ids)], dtype=np.float32))
    return np.concatenate(rows)


def quant_prompt_ids(f16_file: Path, extra: Sequence[int] = ()) -> list[list[int]]:
    """QUANT_PROMPTS split by the f16 file's own tokenizer, plus `extra` ids."""
    with open_gguf(f16_file, n_ctx=512) as llm:
        prompts = [list(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))
                   for text in QUANT_PROMPTS]
    return prompts + ([list(extra)] if extra else [])


def compare_quantized(kind: str, reference: np.ndarray, logits: np.ndarray) -> QuantReport:
    if logits.shape != reference.shape or not np.isfinite(logits).all():
        top1, error = 0.0, float("inf")
    else:
        top1 = float((logits.argmax(-1) == reference.argmax(-1)).mean())
        scale = np.maximum(1.0, np.abs(reference).max(-1))
        error = float((np.abs(logits - reference).max(-1) / scale).max())
    return QuantReport(kind, len(reference), top1, error, QUANT_BOUNDS.get(kind, DEFAULT_BOUND))


# ------------------------------------------------------------------ preflight

# Bytes per parameter of each file the export writes (llama.cpp's bits per weight / 8, K-quants
# rounded up); the 16-bit checkpoints are 2.
BYTES_PER_PARAM = {"f16": 2.0, "bf16": 2.0, "f32": 4.0, "q8_0": 1.07, "Q4_K_M": 0.61,
                   "Q4_K_S": 0.58, "Q5_K_M": 0.72, "Q5_K_S": 0.69, "Q6_K": 0.83}
HEADROOM = 1.1
GIB = 1024**3


@dataclass(frozen=True)
class Need:
    where: str
    path: Path
    need: int
    have: int

    @property
    def short(self) -> bool:
        return self.need > self.have


def checkpoint_parameters(model_dir: Path) -> int:
    """Parameters of a safetensors checkpoint, from the headers only (safetensors' safe_open
    maps each file and parses its header, never the tensors)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors checkpoint to size the export")
    total = 0
    for path in files:
        try:
            with safe_open(path, framework="numpy") as tensors:
                total += sum(math.prod(tensors.get_slice(name).get_shape())
                             for name in tensors.keys())  # noqa: SIM118 - not iterable
        except SafetensorError as error:
            raise UserError(f"{path}: not a readable safetensors file ({error})") from error
    return total


def available_memory() -> int:
    """Memory the export may take without swapping (bytes): psutil's `available`, which on Linux
    is the kernel's MemAvailable."""
    import psutil

    return int(psutil.virtual_memory().available)


def free_disk(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def export_needs(parameters: int, kinds: Sequence[str], out_dir: Path, scratch: Path, *,
                 float32_on_host: bool,
                 free_space: Callable[[Path], int] = free_disk,
                 memory: Callable[[], int] = available_memory) -> list[Need]:
    """Disk for the outputs (merged model and GGUF files) and for the scratch (the base copy and
    its control GGUF), summed where both are one file system; host memory for the merge (the
    16-bit model, and on a CPU its float32 copy for the logit check)."""
    outputs = parameters * (2.0 + sum(BYTES_PER_PARAM.get(kind, 2.0) for kind in kinds))
    staged = parameters * (2.0 + 2.0)
    disks = {"outputs": (out_dir, outputs), "scratch": (scratch, staged)}
    if _device(out_dir) == _device(scratch):
        disks = {"outputs and scratch": (out_dir, outputs + staged)}
    needs = [Need(f"disk ({where})", path, int(size * HEADROOM), free_space(path))
             for where, (path, size) in disks.items()]
    memory_need = parameters * (2.0 + (4.0 if float32_on_host else 0.0)) * HEADROOM
    needs.append(Need("memory", Path("/proc/meminfo"), int(memory_need), memory()))
    return needs


def _device(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return path.stat().st_dev


def shortfalls(needs: Sequence[Need]) -> str | None:
    short = [need for need in needs if need.short]
    if not short:
        return None
    return "; ".join(f"{need.where} at {need.path}: needs {need.need / GIB:.1f} GiB, "
                     f"{need.have / GIB:.1f} GiB free" for need in short)


def quant_bounds_table(reports: Mapping[str, QuantReport]) -> dict[str, dict[str, float]]:
    return {kind: {"top1_agreement": r.top1_agreement, "max_relative_error": r.max_relative_error,
                   "min_top1": r.bound.min_top1, "max_error_bound": r.bound.max_relative_error}
            for kind, r in reports.items()}
