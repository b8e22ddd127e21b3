"""What each process does in a data-parallel run: rank 0 alone writes to `data/`, and
the other ranks hand it what it must write: their evaluation results, their checkpoints' RNG
states, the rows they trained on. One process is the same code with a world of one.

The collectives come from accelerate (`gather_object`, `wait_for_everyone`), over gloo on a CPU
and NCCL on GPUs; torch and accelerate are imported inside the functions, so importing this
module stays light."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from vlmrl.errors import UserError
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
    accelerate's `split_batches`), so the optimizer batch (x `gradient_accumulation_steps`) and
    GRPO's generation batch (x `steps_per_generation`) mean the same at any process count. Where
    the processes outnumber what the micro-batch splits into (a micro-batch of 4 on 8 processes),
    micro-batches of successive accumulation steps are merged first: 4 x 4 steps becomes 8 x 2,
    split 1 x 2 per process."""
    batch = int(args.get("per_device_train_batch_size", default))
    merge = num_processes // math.gcd(batch, num_processes)  # micro-batches taken as one
    accumulation = int(args.get("gradient_accumulation_steps") or 1)
    generation = args.get("steps_per_generation")
    if accumulation % merge or (generation is not None and int(generation) % merge):
        steps = ("gradient_accumulation_steps"
                 + (" and steps_per_generation" if generation is not None else ""))
        raise ParamsError(
            f"params.yaml {section}.per_device_train_batch_size ({batch}) is the batch of all "
            f"processes together and must be divisible by train.distributed.num_processes "
            f"({num_processes}), or {section}.{steps} by {merge} (micro-batches merged so that "
            f"it is)")
    split = {**args, "per_device_train_batch_size": batch * merge // num_processes}
    if merge > 1:
        split["gradient_accumulation_steps"] = accumulation // merge
        if generation is not None:
            split["steps_per_generation"] = int(generation) // merge
    return split


def gather_lists(local: list[T]) -> list[list[T]]:
    """Every process's list, in process order (on every process)."""
    from accelerate.utils import gather_object

    if world()[1] == 1:
        return [local]
    return gather_object([local])


def main_decides(decide: Callable[[], T], follow: Callable[[], T]) -> T:
    """Rank 0 runs `decide` (which may move and write files); the others wait for it and then
    run `follow`, which must only read what rank 0 left, and find what rank 0 decided. A rank on
    another machine that does not see rank 0's files (a checkpoint to resume from, where the
    checkpoint folder is not shared) would train from another state: every rank stops with one
    line instead (a collective: every rank must call this)."""
    from accelerate import PartialState

    state = PartialState()
    result = decide() if state.is_main_process else None
    state.wait_for_everyone()
    mine = result if state.is_main_process else follow()
    views = gather_lists([mine])
    for rank, [view] in enumerate(views):
        if view != views[0][0]:
            raise UserError(f"process {rank} found {view} where process 0 decided "
                            f"{views[0][0]}: on several machines every one must see the files "
                            "process 0 prepares (a shared checkpoint folder), or process 0's "
                            "checkpoints be moved aside to start over")
    return mine


def write_gathered_files(files: Mapping[str, bytes], output_dir: Path, is_main: bool) -> None:
    """Every process's `files` (name -> bytes) written into `output_dir` by rank 0 alone (every
    rank must call this: gathering is collective). The trainer's RNG states go this way
    (vlmrl.training.trainer.mixins.DataParallelRun), so only rank 0 writes into a checkpoint."""
    gathered = gather_lists([dict(files)])
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        for [part] in gathered:
            for name, blob in part.items():
                (output_dir / name).write_bytes(blob)


def gathered_state_dict(trainer) -> dict[str, Any] | None:
    """The full state dict where DeepSpeed or FSDP shard the weights (every rank must call this:
    gathering is collective), else None: each rank holds all of them."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    if accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return None
    return accelerator.get_state_dict(trainer.model_wrapped)


def load_optimizer_state_on_cpu(optimizer, scheduler, checkpoint: Path) -> None:
    """A checkpoint's optimizer and scheduler states loaded onto plain `cpu`, as transformers'
    Trainer loads them (nothing where either file is missing), but without its
    `map_location=cpu:<rank>` on CPU processes, which `torch.load` refuses."""
    import torch
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    optimizer_file, scheduler_file = checkpoint / OPTIMIZER_NAME, checkpoint / SCHEDULER_NAME
    if not (optimizer_file.is_file() and scheduler_file.is_file()):
        return
    optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
