"""What `gspo_step.py`'s worker measures around a training run, apart from the run itself: the
device and library versions, the bytes a decode step must read and the copy bandwidth they are
held against (the "% of bound" columns), each phase's seconds with the device synchronised around
it, and the peak memory per phase. `benchmarks/scaling.py` and `decode_profile.py` time and
size their runs with the same functions, so their figures compare with the GSPO step's.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "unsloth",
                 "unsloth_zoo", "datasets", "triton"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "missing"
    return found


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"

def decode_steps_of(completion_ids: list, knobs: dict[str, Any]) -> int:
    """Decode steps one generation batch took: its longest completion per generate call, times
    the calls it was split into (train.max_generation_rows)."""
    rows = knobs.get("max_generation_rows") or len(completion_ids) or 1
    calls = -(-len(completion_ids) // rows)
    return calls * max((len(ids) for ids in completion_ids), default=0)


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step must read: every language-model parameter once (NF4
    weights as packed bytes plus their quantization scales; LoRA included), not the vision tower
    (prefill only), and of an untied input embedding only the rows looked up (left out)."""
    seen: set[int] = set()
    total = 0
    for name, param in model.named_parameters():
        if ".visual." in f".{name}." or param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        total += param.numel() * param.element_size()
        state = getattr(param, "quant_state", None)
        while state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            state = getattr(state, "state2", None)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is not None and embedding.weight.data_ptr() != output.weight.data_ptr():
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float | None:
    """Device memory bandwidth in bytes/s, measured by a device-to-device copy of random bytes
    (bytes read + bytes written over the median time of `repeats` copies)."""
    import torch

    if not torch.cuda.is_available():
        return None
    count = int(gib * 2**30)
    source = torch.randint(0, 256, (count,), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del source, target
    torch.cuda.empty_cache()
    return 2 * count / sorted(times)[len(times) // 2]


def bandwidth_fraction(run: dict[str, Any], bandwidth: float | None) -> float | None:
    """Decode steps per second over the weights' bound (bandwidth / weight bytes per step)."""
    steps, weights = run.get("decode_steps_per_second"), run.get("decode_weight_bytes")
    if not (steps and weights and bandwidth):
        return None
    return steps * weights / bandwidth

def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synced_timer(original, phase_of, record):
    """`original`, timed with the device synchronised around it: `record(phase, seconds)` for
    each call whose `phase_of()` is not None (benchmarks/scaling.py times its phases the same)."""
    def call(*args, **kwargs):
        phase = phase_of()
        if phase is None:
            return original(*args, **kwargs)
        _sync()
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _sync()
            record(phase, time.perf_counter() - started)
    return call


def _peak_gib(kind: str) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return round(getattr(torch.cuda, f"max_memory_{kind}")() / 2**30, 2)


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def device_used_bytes() -> int | None:
    """Bytes in use on the device by every process (what nvidia-smi shows)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def _non_pytorch_gib(others_bytes: int) -> float | None:
    """What this process holds on the device beside PyTorch's pool (CUDA context, cuBLAS
    workspaces, compiled kernels): a 24 GB card must hold this plus the peak reserved pool.
    `others_bytes` is what other processes (the driver process among them) held before it."""
    import torch

    used = device_used_bytes()
    if used is None:
        return None
    return round((used - others_bytes - torch.cuda.memory_reserved()) / 2**30, 2)


class MemoryPeaks:
    """Peak GPU memory per phase (generation, the rest of training): the peak counters are read
    and reset at each boundary."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {}

    def close(self, phase: str) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        seen = self.peaks.setdefault(phase, {"allocated": 0, "reserved": 0})
        for kind in seen:
            seen[kind] = max(seen[kind], getattr(torch.cuda, f"max_memory_{kind}")())
        torch.cuda.reset_peak_memory_stats()

    def by_phase(self, kind: str) -> dict[str, float]:
        return {phase: round(seen[kind] / 2**30, 2) for phase, seen in self.peaks.items()}

    def overall(self, kind: str) -> float | None:
        values = self.by_phase(kind).values()
        return max(values) if values else None


# Trainer methods timed per optimizer step (nested: training_step holds prepare_inputs, which
# holds the prompts' processing, generation, rewards and the old log-probabilities).
PHASES = {"training_step": "training_step", "_prepare_inputs": "prepare_inputs",
          "_tokenize_prompts": "prompts", "_calculate_rewards": "rewards",
          "compute_loss": "loss"}


def time_phases(trainer) -> dict[str, list[tuple[int, float]]]:
    """Wraps PHASES' methods, the backward pass and the no-grad log-probability passes
    (`old_logps`) with a timer, and times Python's garbage collections (`gc`); returns phase ->
    [(optimizer step, seconds) per call], filled as the trainer runs."""
    import gc

    import torch

    calls: dict[str, list[tuple[int, float]]] = {}

    def record(phase: str, seconds: float) -> None:
        calls.setdefault(phase, []).append((trainer.state.global_step, seconds))

    def timed(original, phase_of):
        return synced_timer(original, phase_of, record)

    for method, phase in PHASES.items():
        setattr(trainer, method, timed(getattr(trainer, method), lambda phase=phase: phase))
    trainer.accelerator.backward = timed(trainer.accelerator.backward, lambda: "backward")
    logps = "_get_per_token_logps_and_entropies"
    setattr(trainer, logps, timed(getattr(trainer, logps),
                                  lambda: None if torch.is_grad_enabled() else "old_logps"))
    collecting: list[float] = []

    def on_gc(stage: str, info: dict) -> None:
        if stage == "start":
            collecting.append(time.perf_counter())
        elif collecting:
            record("gc", time.perf_counter() - collecting.pop())

    gc.callbacks.append(on_gc)
    return calls


def phase_means(calls: dict[str, list[tuple[int, float]]], warmup: int, timed_steps: int
                ) -> dict[str, float]:
    """Seconds per timed optimizer step spent in each phase."""
    timed = range(warmup, warmup + timed_steps)
    return {phase: round(sum(t for step, t in found if step in timed) / timed_steps, 3)
            for phase, found in calls.items()} if timed_steps else {}


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's counts of device allocations, frees and retries."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ("num_alloc_retries", "num_device_alloc",
                                                "num_device_free", "num_sync_all_streams")}


# What transformers logs when generation drops its KV cache under gradient checkpointing: every
# sampled token would then ignore the prompt. TRL switches checkpointing off around generation, so
# a run that logs it has a broken setup, and the results say so (`kv_cache_dropped_in_generation`).
KV_DROPPED_MESSAGE = "Caching is incompatible with gradient checkpointing"


class KVDropDetector(logging.Handler):
    """Sees whether transformers logged KV_DROPPED_MESSAGE while it was attached."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        if KV_DROPPED_MESSAGE in record.getMessage():
            self.seen = True
