"""Wall seconds of a stage's named steps, for its metrics and benchmarks: `with timer("merge"):`
around a step, `start`/`stop` where a step's two ends are separate callbacks (the trainer's
step begin and end), `parallel` for independent jobs run a few at a time. An optional tqdm bar
shows the step under way."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepTimer:
    seconds: dict[str, float] = field(default_factory=dict)
    bar: Any = None
    started: float = field(default_factory=time.perf_counter)
    _running: dict[str, float] = field(default_factory=dict)

    def total(self) -> float:
        return round(time.perf_counter() - self.started, 3)

    def rounded(self, digits: int = 3) -> dict[str, float]:
        return {name: round(value, digits) for name, value in self.seconds.items()}

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)
        self._running[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        """Records and returns the seconds since `start(name)`."""
        self.seconds[name] = time.perf_counter() - self._running.pop(name)
        if self.bar is not None:
            self.bar.update(1)
        return self.seconds[name]

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.start(name)
        yield
        self.stop(name)

    def parallel(self, phase: str, jobs: Mapping[str, Callable[[], Any]],
                 workers: int) -> dict[str, Any]:
        """Runs independent jobs (subprocess-bound: the converter) `workers` at a time; each
        job's own wall time is recorded under its name, the whole phase's under `phase`."""
        def timed(name: str) -> Any:
            start = time.perf_counter()
            result = jobs[name]()
            self.seconds[name] = time.perf_counter() - start
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
        self.seconds[phase] = time.perf_counter() - start
        return results


# Keys of stage metrics that hold wall-clock figures. DVC hashes a metrics file that a later
# stage depends on, so a time in it would rerun that stage whenever the machine was busier.
WALL_CLOCK_KEYS = frozenset({"seconds", "samples_per_second", "generated_tokens_per_second",
                             "runtime_seconds", "timings_s", "step_seconds"})


def split_wall_clock(metrics: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the metrics without wall-clock figures, the wall-clock figures) of a stage's results."""
    kept = {key: value for key, value in metrics.items() if key not in WALL_CLOCK_KEYS}
    times = {key: value for key, value in metrics.items() if key in WALL_CLOCK_KEYS}
    return kept, times
