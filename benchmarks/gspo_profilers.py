"""The profilers `gspo_step.py --profile-training`, `--profile-training-host` and `--profile-host`
put around one optimizer step: the phase timers say how long forward, backward and a generation's
input work take, not which kernels or host functions take it, nor whether the GPU waits on the
host meanwhile. Each profiled step runs after the timed ones (or is reported apart), so the
timings leave the profiler's cost out.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from gspo_measure import _sync


def profile_training(trainer, step: int, top: int = 25) -> tuple[list[dict], list[dict]]:
    """Wraps the trainer's `training_step` so that the micro-batches of optimizer step `step` run
    under torch.profiler; returns the lists it fills: that step's `top` kernels by total device
    time (CPU operators by their own time where there is no GPU), and each micro-batch's
    `micro_batch_busy` (empty without a GPU): where a training step's time goes, which the phase
    timers cannot say."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    totals: dict[str, list[float]] = {}
    kernels: list[dict] = []
    busy: list[dict] = []

    def profiled(original, *args, **kwargs):
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            result = original(*args, **kwargs)
            _sync()
        busy.append(micro_batch_busy(prof, time.perf_counter() - started) if cuda else {})
        for event in prof.key_averages():
            spent = event.device_time_total if cuda else event.self_cpu_time_total
            if spent > 0:
                total = totals.setdefault(event.key, [0.0, 0])
                total[0] += spent
                total[1] += event.count
        ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
        kernels[:] = [{"kernel": key[:90], "ms_per_step": round(spent / 1000, 3),
                       "calls_per_step": int(count)} for key, (spent, count) in ranked]
        return result

    run_step_micro_batches(trainer, step, profiled)
    return kernels, busy


def run_step_micro_batches(trainer, step: int, run) -> None:
    """Wraps `trainer.training_step`: the micro-batches of optimizer step `step` go through
    `run(original, *args, **kwargs)`, the device synchronised first; the others run as they
    are."""
    original = trainer.training_step

    def training_step(*args, **kwargs):
        if trainer.state.global_step != step:
            return original(*args, **kwargs)
        _sync()
        return run(original, *args, **kwargs)

    trainer.training_step = training_step


def micro_batch_busy(prof, wall_seconds: float) -> dict:
    """How much of one profiled micro-batch's wall time (`wall_s`, the device synchronised at
    both ends) the GPU spent running kernels (`gpu_busy_s`, the union of the kernels' intervals,
    so overlapping streams count once): below the wall time, the GPU waited on the host."""
    from torch.autograd import DeviceType

    spans = sorted((event.time_range.start, event.time_range.end) for event in prof.events()
                   if event.device_type == DeviceType.CUDA)
    return {"wall_s": round(wall_seconds, 4), "kernels": len(spans),
            "gpu_busy_s": round(union_length(spans) / 1e6, 4)}


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, sorted by start."""
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class TrainingHostProfile:
    """cProfile over the micro-batches (`training_step` calls) of optimizer step `step`, with
    its generation left out (`paused`, as HostProfile's): which host work the training
    micro-batches wait on where `micro_batch_busy` says the GPU idles. `result()`: the step's
    micro-batches' wall seconds without the generation, and the `top` functions by own seconds
    and by cumulative seconds."""

    def __init__(self, trainer, step: int, top: int = 40) -> None:
        self.profiler, self.wall_s, self.active = None, 0.0, False
        self.calls, self.top = 0, top
        run_step_micro_batches(trainer, step, self.profiled)

    def profiled(self, original, *args, **kwargs):
        import cProfile

        started = time.perf_counter()
        self.profiler = self.profiler or cProfile.Profile()
        self.profiler.enable()
        self.active = True
        try:
            return original(*args, **kwargs)
        finally:
            _sync()
            self.profiler.disable()
            self.active = False
            self.wall_s += time.perf_counter() - started
            self.calls += 1

    @contextlib.contextmanager
    def paused(self):
        profiling = self.profiler is not None and self.active
        if profiling:
            self.profiler.disable()
        started = time.perf_counter()
        try:
            yield
        finally:
            if profiling:
                self.wall_s -= time.perf_counter() - started
                self.profiler.enable()

    def result(self) -> dict:
        if self.profiler is None:
            return {}
        rows = profiled_functions(self.profiler)
        by_own = sorted(rows, key=lambda row: -row["own_s"])[:self.top]
        by_cumulative = sorted(rows, key=lambda row: -row["cumulative_s"])[:self.top]
        return {"micro_batches": self.calls, "wall_s": round(self.wall_s, 3),
                "by_own": by_own, "by_cumulative": by_cumulative}


class HostProfile:
    """cProfile over the first `_prepare_inputs` call from optimizer step `first_step` on that
    generates, with the generation itself left out (`paused`): which host work fills the phase
    tables' "other input work" and "prompts" columns, which the phase timers cannot split.
    `functions`: the `top` functions by cumulative seconds."""

    def __init__(self, trainer, first_step: int, top: int = 40) -> None:
        self.profiler, self.functions, self.generated = None, [], False
        original = trainer._prepare_inputs

        def prepare_inputs(*args, **kwargs):
            if trainer.state.global_step < first_step or self.functions:
                return original(*args, **kwargs)
            import cProfile

            self.profiler, self.generated = cProfile.Profile(), False
            self.profiler.enable()
            try:
                return original(*args, **kwargs)
            finally:
                self.profiler.disable()
                if self.generated:
                    self.functions[:] = self.ranked(top)
                self.profiler = None

        trainer._prepare_inputs = prepare_inputs

    @contextlib.contextmanager
    def paused(self):
        profiler = self.profiler
        if profiler is not None:
            self.generated = True
            profiler.disable()
        try:
            yield
        finally:
            if profiler is not None:
                profiler.enable()

    def ranked(self, top: int) -> list[dict]:
        return sorted(profiled_functions(self.profiler),
                      key=lambda row: -row["cumulative_s"])[:top]


def profiled_functions(profiler) -> list[dict]:
    """Every function a cProfile profiler saw: file:line(name), calls, cumulative and own
    seconds."""
    import pstats

    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls,
             "cumulative_s": round(cumulative, 4), "own_s": round(own, 4)}
            for (file, line, name), (_, calls, own, cumulative, _)
            in pstats.Stats(profiler).stats.items()]
