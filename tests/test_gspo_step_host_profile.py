"""`benchmarks/gspo_step.py --profile-host` (`gspo_profilers.HostProfile`): cProfile over the input
preparation of the first generating call from a given optimizer step on, the generation left out."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import benchmark_fixture

profilers = benchmark_fixture("gspo_profilers")


def host_work() -> int:
    return sum(range(20000))


def generation_work() -> int:
    return sum(range(20000))


class FakeTrainer:
    """A trainer whose input preparation generates where `generates` says, inside the benchmark's
    pause as gspo_step's generation wrapper does."""

    def __init__(self) -> None:
        self.state = SimpleNamespace(global_step=0)
        self.host: object | None = None
        self.generates = True

    def _prepare_inputs(self, batch):
        host_work()
        if self.generates:
            with self.host.paused():
                generation_work()
        return batch


def profiled_names(functions: list[dict]) -> set[str]:
    return {row["function"].rsplit("(", 1)[1].rstrip(")") for row in functions}


def test_the_first_generating_call_from_the_step_on_is_profiled_without_its_generation(
        profilers):
    trainer = FakeTrainer()
    host = trainer.host = profilers.HostProfile(trainer, first_step=2)
    trainer._prepare_inputs("step 0")  # before the first timed step: not profiled
    assert host.functions == []
    trainer.state.global_step, trainer.generates = 2, False
    trainer._prepare_inputs("a micro-batch that does not generate")
    assert host.functions == []
    trainer.generates = True
    assert trainer._prepare_inputs("generating") == "generating"
    names = profiled_names(host.functions)
    assert {"host_work", "_prepare_inputs"} <= names
    assert "generation_work" not in names
    assert all(row["cumulative_s"] >= row["own_s"] >= 0 for row in host.functions)
    first = list(host.functions)
    trainer._prepare_inputs("a later generation")  # one call is profiled, not the later ones
    assert host.functions == first


def test_outside_a_profiled_call_the_pause_is_a_plain_context(profilers):
    trainer = FakeTrainer()
    host = trainer.host = profilers.HostProfile(trainer, first_step=5)
    with host.paused():
        generation_work()
    assert host.functions == [] and not host.generated
