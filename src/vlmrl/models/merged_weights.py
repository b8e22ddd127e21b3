"""A merged checkpoint is right when every adapted weight is W + scale * B @ A, rounded once to the
export dtype, and every other tensor is the base model's, bit for bit. Checked in weight space
this is exact at any model size, where a logit comparison must allow for 16-bit rounding that
compounds over dozens of layers: on a random 2B model, rounding alone moved the logits by 0.23.
Names are compared after dropping `model` segments, so checkpoints saved by transformers, PEFT
and Unsloth (which nest `model.` differently) line up."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.errors import UserError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# One rounding of W + scale*B@A to 16 bits is half a step; a merge from a float32 checkpoint
# (Unsloth merges into the checkpoint it was loaded from) against the 16-bit base adds another.
MAX_ULPS = 2.0


class MergeCheckError(UserError, RuntimeError):
    """A checkpoint or adapter could not be read or lined up with the other."""


def check_adapter_weights(adapter: Path | str) -> None:
    """The adapter's weights must open as safetensors (the header and the data it promises):
    a file cut short by a failed copy or a full disk is named here in one line, where PEFT would
    fail deep inside its loader."""
    from safetensors import SafetensorError, safe_open

    path = Path(adapter) / ADAPTER_WEIGHTS
    if not path.is_file():
        return  # PEFT's other formats, or no adapter: the loader names what is missing
    try:
        with safe_open(str(path), "pt"):
            pass
    except SafetensorError as error:
        raise MergeCheckError(f"{path}: not a readable safetensors file, truncated or corrupt "
                              f"({error}); rerun the stage that wrote it") from None


def check_adapter(adapter: Path | str) -> None:
    """An adapter folder a stage can load: adapter_config.json there and valid JSON, and its
    weights readable (`check_adapter_weights`); each problem one line naming the file, before
    a model is loaded."""
    config = Path(adapter) / "adapter_config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{adapter}: no LoRA adapter (adapter_config.json) there; the "
                                "train_gspo stage makes it (dvc repro train_gspo)")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise MergeCheckError(f"{config}: not valid JSON ({error}); rerun the stage that wrote "
                              "it") from None
    check_adapter_weights(adapter)


def canonical_name(key: str) -> str:
    """`base_model.model.model.language_model.layers.0.mlp.up_proj.weight` and
    `model.language_model.layers.0.mlp.up_proj.weight` -> `language_model.layers.0.mlp.up_proj.weight`."""
    return ".".join(part for part in key.split(".") if part not in ("model", "base_model"))


@contextmanager
def open_checkpoint(directory: Path) -> Iterator[dict[str, Any]]:
    """canonical name -> lazily readable tensor, over every safetensors file in `directory`
    (one file or shards)."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    files = [path for path in files if path.name != ADAPTER_WEIGHTS]
    if not files:
        raise MergeCheckError(f"{directory}: no *.safetensors checkpoint")
    with ExitStack() as stack:
        index: dict[str, Any] = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), "pt"))
            for key in handle.keys():  # noqa: SIM118  (safe_open has no __iter__)
                name = canonical_name(key)
                if name in index:
                    raise MergeCheckError(f"{path}: tensor {key} appears twice in {directory}")
                index[name] = (handle, key)
        yield index


def _load(entry) -> Any:
    handle, key = entry
    return handle.get_tensor(key)


@dataclass(frozen=True)
class LoraDelta:
    a: Any
    b: Any
    scale: float

    def weight_delta(self):
        return (self.b.float() @ self.a.float()) * self.scale


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: a key matches a module name's dotted suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_lora_deltas(adapter_dir: Path) -> dict[str, LoraDelta]:
    """canonical weight name (`...q_proj.weight`) -> its LoRA factors and scale."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    config_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise MergeCheckError(f"{path}: missing; the adapter directory needs both "
                                  f"adapter_config.json and {ADAPTER_WEIGHTS}")
    config = json.loads(config_path.read_text())
    if config.get("use_dora"):
        raise MergeCheckError(f"{config_path}: DoRA adapters are not checked in weight space")
    tensors = load_file(str(weights_path))
    factors: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match:
            factors.setdefault(match.group(1), {})[match.group(2)] = tensor
    deltas: dict[str, LoraDelta] = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise MergeCheckError(f"{weights_path}: {module} has lora_{''.join(pair)} only")
        name = canonical_name(module)
        rank = _pattern_value(config.get("rank_pattern") or {}, name, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config["lora_alpha"])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        deltas[f"{name}.weight"] = LoraDelta(pair["A"], pair["B"], scale)
    if not deltas:
        raise MergeCheckError(f"{weights_path}: no lora_A/lora_B tensors")
    return deltas


@dataclass
class WeightReport:
    adapted: int = 0
    unchanged_checked: int = 0
    wrong: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    max_ulps: float = 0.0
    changed_fraction: float = 0.0
    dtypes: set[str] = field(default_factory=set)
    expected_dtype: str | None = None

    @property
    def wrong_dtype(self) -> bool:
        return self.expected_dtype is not None and self.dtypes != {self.expected_dtype}

    @property
    def passed(self) -> bool:
        return (not self.wrong and not self.missing and self.adapted > 0
                and not self.wrong_dtype)

    def detail(self) -> str:
        head = (f"{self.adapted} adapted weights within {MAX_ULPS:g} ulp of W + scale*B@A (max "
                f"{self.max_ulps:.2f} ulp; {self.changed_fraction:.1%} of their elements "
                f"changed), {self.unchanged_checked} other tensors identical to the base")
        problems = []
        if self.missing:
            problems.append(f"missing from one side: {', '.join(self.missing[:5])}"
                            + (" ..." if len(self.missing) > 5 else ""))
        if self.wrong:
            problems.append(f"wrong: {', '.join(self.wrong[:5])}"
                            + (" ..." if len(self.wrong) > 5 else ""))
        if self.adapted == 0:
            problems.append("no adapted weight found")
        if self.wrong_dtype:
            problems.append(f"stored as {sorted(self.dtypes)}, not {self.expected_dtype}")
        return head if not problems else f"{'; '.join(problems)} ({head})"


def _ulps(merged, ideal, base, delta, dtype) -> Any:
    """|merged - ideal| in steps of `dtype` at the larger of |W|, |delta| and |W + delta|: a
    merge's rounding is relative to its operands, so where W + delta nearly cancels, the error
    is still measured against W."""
    import torch

    info = torch.finfo(dtype)
    scale = torch.maximum(torch.maximum(ideal.abs(), base.float().abs()), delta.abs())
    spacing = torch.clamp(scale, min=info.smallest_normal) * info.eps
    return (merged.float() - ideal).abs() / spacing


def _coarser(first, second):
    """The floating dtype with the wider spacing: the one a 16-bit merge was rounded to."""
    import torch

    return max(first, second, key=lambda dtype: torch.finfo(dtype).eps)


def compare_merged_weights(base_dir: Path, merged_dir: Path, adapter_dir: Path,
                           dtype: str | None = None) -> WeightReport:
    """Compares every tensor of the merged checkpoint with the base checkpoint plus the adapter;
    with `dtype` (torch's name, "bfloat16"), every floating tensor must be stored in it."""
    import torch

    deltas = read_lora_deltas(adapter_dir)
    report = WeightReport(expected_dtype=dtype)
    changed = total = 0
    with open_checkpoint(base_dir) as base, open_checkpoint(merged_dir) as merged:
        report.missing = sorted(name for name in base if name not in merged)
        report.missing += sorted(f"{name} (adapted)" for name in deltas if name not in base)
        for name, entry in base.items():
            if name not in merged:
                continue
            base_tensor, merged_tensor = _load(entry), _load(merged[name])
            if merged_tensor.is_floating_point():
                report.dtypes.add(str(merged_tensor.dtype).removeprefix("torch."))
            if name not in deltas:
                report.unchanged_checked += 1
                if not torch.equal(base_tensor, merged_tensor):
                    report.wrong.append(f"{name} (not adapted, differs from the base)")
                continue
            report.adapted += 1
            delta = deltas[name].weight_delta()
            ideal = base_tensor.float() + delta
            if merged_tensor.shape != ideal.shape:
                report.wrong.append(f"{name} (shape {tuple(merged_tensor.shape)}, "
                                    f"expected {tuple(ideal.shape)})")
                continue
            ulps = float(_ulps(merged_tensor, ideal, base_tensor, delta,
                               _coarser(merged_tensor.dtype, base_tensor.dtype)).max())
            report.max_ulps = max(report.max_ulps, ulps)
            if not ulps <= MAX_ULPS:
                report.wrong.append(f"{name} ({ulps:.3g} ulp from W + scale*B@A)")
            changed += int((merged_tensor != base_tensor).sum())
            total += merged_tensor.numel()
    report.changed_fraction = changed / total if total else 0.0
    return report


SAFETENSORS_FLOATS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
SAFETENSORS_BYTES = {**SAFETENSORS_FLOATS, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1}


def cast_floating_tensors(directory: Path, dtype: str) -> list[str]:
    """Rewrites, file by file, the safetensors of `directory` whose floating tensors are not in
    `dtype` (Unsloth's merged save keeps the dtype of the checkpoint it merged into, float32 for
    a checkpoint saved in float32), and config.json's dtype and a shard index's total size with
    them. Files already in `dtype` are read only as far as their headers. Returns the files
    rewritten."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    target, target_name = getattr(torch, dtype), SAFETENSORS_DTYPES[dtype]
    rewritten: list[str] = []
    total_size = 0
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            stored = {key: handle.get_slice(key) for key in handle.keys()}  # noqa: SIM118
            cast = {key for key, piece in stored.items()
                    if piece.get_dtype() in SAFETENSORS_FLOATS and piece.get_dtype() != target_name}
            total_size += sum(
                math.prod(piece.get_shape())
                * SAFETENSORS_BYTES[target_name if key in cast else piece.get_dtype()]
                for key, piece in stored.items())
            if not cast:
                continue
            metadata = handle.metadata()
            tensors = {key: (handle.get_tensor(key).to(target) if key in cast
                             else handle.get_tensor(key)).contiguous() for key in stored}
        staging = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(staging), metadata=metadata)
        staging.replace(path)
        rewritten.append(path.name)
    if rewritten:
        _set_config_dtype(Path(directory), dtype)
        _set_index_size(Path(directory), total_size)
    return rewritten


def _set_config_dtype(directory: Path, dtype: str) -> None:
    path = directory / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    for section in (config, *(v for v in config.values() if isinstance(v, dict))):
        for key in ("dtype", "torch_dtype"):
            if key in section:
                section[key] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _set_index_size(directory: Path, total_size: int) -> None:
    for index_path in directory.glob("*.safetensors.index.json"):
        index = json.loads(index_path.read_text())
        index.setdefault("metadata", {})["total_size"] = total_size
        index_path.write_text(json.dumps(index, indent=2) + "\n")
