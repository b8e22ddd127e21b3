"""What each process does in a data-parallel run (issue 22): rank 0 alone writes to `data/`, and
the other ranks hand it what it must write: their evaluation results, their checkpoints' RNG
states, the rows they trained on. One process is the same code with a world of one.

The collectives come from accelerate (`gather_object`, `wait_for_everyone`), over gloo on a CPU
and NCCL on GPUs; torch and accelerate are imported inside the functions, so importing this
module stays light."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from vlmrl.params import ParamsError

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(this process's index, the number of processes) from accelerate's state, which the trainer
    config or `start_processes` set up."""
    from accelerate import PartialState

    state = PartialState()
    return state.process_index, state.num_processes


def start_processes(cpu: bool) -> tuple[int, int]:
    """Joins the process group of a launched run (gloo on a CPU) and returns `world()`; a
    single process stays alone."""
    from accelerate import PartialState

    PartialState(cpu=cpu)
    return world()


def split_global_batch(args: Mapping[str, Any], num_processes: int, default: int,
                       section: str) -> dict[str, Any]:
    """Trainer `args` whose `per_device_train_batch_size` (`default` where unset) is the batch of
    all processes together, with each of `num_processes` processes given its share (as
    accelerate's `split_batches`), so the optimizer batch means the same at any process count."""
    batch = int(args.get("per_device_train_batch_size", default))
    if batch % num_processes:
        raise ParamsError(
            f"params.yaml {section}.per_device_train_batch_size ({batch}) is the batch of all "
            f"processes together and must be divisible by train.distributed.num_processes "
            f"({num_processes})")
    return {**args, "per_device_train_batch_size": batch // num_processes}


def gather_lists(local: list[T]) -> list[list[T]]:
    """Every process's list, in process order (on every process)."""
    from accelerate.utils import gather_object

    if world()[1] == 1:
        return [local]
    return gather_object([local])


def main_decides(decide: Callable[[], T], follow: Callable[[], T]) -> T:
    """Rank 0 runs `decide` (which may move and write files); the others wait for it and then
    run `follow`, which must only read what rank 0 left."""
    from accelerate import PartialState

    state = PartialState()
    result = decide() if state.is_main_process else None
    state.wait_for_everyone()
    return result if state.is_main_process else follow()


def record_trained_rows(trainer, column: str = "pid") -> list[Any]:
    """The `column` of every row this process generated for and trained on, in order (TRL gives
    each process its own rows of a generation batch)."""
    seen: list[Any] = []
    original = trainer._generate_and_score_completions

    def recorded(inputs):
        seen.extend(row.get(column) for row in inputs)
        return original(inputs)

    trainer._generate_and_score_completions = recorded
    return seen


def save_rng_states_on_main(trainer) -> None:
    """transformers' Trainer has every rank write its own `rng_state_<rank>.pth` into the
    checkpoint; here each rank writes its file to a private temporary directory and rank 0 writes
    all of them into the checkpoint, so a resume finds the files it always did."""
    original = trainer._save_rng_state

    def save(output_dir: str) -> None:
        if trainer.args.world_size <= 1:
            original(output_dir)
            return
        with tempfile.TemporaryDirectory(prefix="vlmrl-rng-") as local:
            original(local)
            files = {path.name: path.read_bytes() for path in Path(local).glob("rng_state*.pth")}
        gathered = gather_lists([files])
        if trainer.accelerator.is_main_process:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            for [part] in gathered:
                for name, blob in part.items():
                    (Path(output_dir) / name).write_bytes(blob)

    trainer._save_rng_state = save


def gathered_state_dict(trainer) -> dict[str, Any] | None:
    """The full state dict where DeepSpeed or FSDP shard the weights (every rank must call this:
    gathering is collective), else None: each rank holds all of them."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    if accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return None
    return accelerator.get_state_dict(trainer.model_wrapped)


def resume_on_cpu_processes(trainer) -> None:
    """transformers loads a resumed optimizer state onto `args.device` when several processes
    train, and on a CPU that is `cpu:<rank>`, a location `torch.load` refuses ("don't know how to
    restore data location ... cpu:0"); the load is pointed at plain `cpu` while it lasts."""
    import torch

    if trainer.args.world_size <= 1 or trainer.args.device.type != "cpu":
        return
    original = trainer._load_optimizer_and_scheduler

    def load(checkpoint):
        torch_load = torch.load

        def load_on_cpu(*args, **kwargs):
            if isinstance(kwargs.get("map_location"), torch.device):
                kwargs["map_location"] = "cpu"
            return torch_load(*args, **kwargs)

        torch.load = load_on_cpu
        try:
            return original(checkpoint)
        finally:
            torch.load = torch_load

    trainer._load_optimizer_and_scheduler = load
