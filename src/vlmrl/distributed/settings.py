"""`train.distributed` as a stage reads it: the typed params section, and the multi-machine keys
that the environment variables torchrun, Slurm and accelerate users export take the place of, so
that one params.yaml serves every machine of a run. No torch here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from vlmrl.distributed.nodes import Nodes
from vlmrl.params import ParamsError, PositiveInteger, ProcessCount, Section

# none runs in this process; the others relaunch the stage with the config file of that name;
# auto picks one of them by the number of GPUs (`resolve`).
Strategy = Literal["auto", "none", "ddp", "zero2", "zero3", "fsdp"]
MultiProcessStrategy = Literal["ddp", "zero2", "zero3", "fsdp"]
NonNegative = Annotated[int, Field(ge=0, strict=True)]
Port = Annotated[int, Field(ge=1, le=65534, strict=True)]  # and the next one, for the launchers


class DistributedParams(Section):
    """`train.distributed`: how many processes train (sft_cold_start and train_gspo) and how.
    `strategy: auto` with `num_processes: auto` trains with one process per visible GPU under
    `multi_gpu_strategy` where there are several GPUs, in this process otherwise. The batch
    sizes in `train.grpo` and `sft.args` are global: each of `num_processes` processes gets
    `per_device_train_batch_size / num_processes` rows (as accelerate's `split_batches`), so the
    optimizer and generation batches mean the same at any process count. With several
    machines, `num_processes` counts the processes of all of them (accelerate's meaning; auto:
    one per GPU on each). (Here rather than in vlmrl.params, which is at its length limit.)"""

    SECTION = "train.distributed"
    num_processes: ProcessCount = "auto"
    strategy: Strategy = "auto"
    # what auto launches with several processes: ddp where the model fits one GPU, zero3 or
    # fsdp where it must be sharded
    multi_gpu_strategy: MultiProcessStrategy = "ddp"
    config_file: str | None = None  # an accelerate config of your own instead of the strategy's
    # Several machines in one run (vlmrl.distributed.nodes); the environment variables of
    # MACHINE_ENV, where set, take their place, so that one params.yaml serves every machine.
    num_machines: PositiveInteger = 1
    machine_rank: NonNegative = 0  # 0: the main machine, whose process 0 writes the outputs
    main_process_ip: str | None = None  # the main machine's address, as every machine reaches it
    main_process_port: Port = 29500  # torch's rendezvous; the launchers meet on the next port
    rdzv_timeout: PositiveInteger = 600  # seconds to join, or to stay silent, before all stop

    @model_validator(mode="after")
    def _strategy_for_processes(self) -> Self:
        if self.num_processes not in (1, "auto") and self.strategy == "none":
            raise ValueError(f"num_processes {self.num_processes} needs a strategy (auto, ddp, "
                             "zero2, zero3 or fsdp); strategy none runs one process")
        return self

    @property
    def several_machines(self) -> bool:
        return self.num_machines > 1

    def nodes(self) -> Nodes:
        """The machines as vlmrl.distributed.nodes meets them (`machines` resolved them)."""
        return Nodes(self.num_machines, self.machine_rank, self.main_process_ip or "",
                     self.main_process_port, float(self.rdzv_timeout))


# params.yaml key -> the environment variables that set it, first found first: the names
# torchrun, Slurm scripts and accelerate users already export on every machine.
MACHINE_ENV: dict[str, tuple[str, ...]] = {
    "num_machines": ("NNODES", "WORLD_SIZE"), "machine_rank": ("NODE_RANK", "MACHINE_RANK"),
    "main_process_ip": ("MASTER_ADDR",), "main_process_port": ("MASTER_PORT",)}
UP_TO_DATE_ENV = "VLMRL_NODES_UP_TO_DATE"  # set on node 0 where DVC has the stage up to date


def machines(settings: DistributedParams,
             environ: Mapping[str, str] = os.environ) -> DistributedParams:
    """`settings` with the multi-machine keys taken from the environment where it sets them,
    checked together; a single machine ignores the rank, address and port (its processes meet
    on a free local port). Only a stage's own process reads these: in a launched worker,
    WORLD_SIZE and MASTER_* are torchrun's."""
    update: dict[str, Any] = {}
    for key, names in MACHINE_ENV.items():
        name = next((name for name in names if environ.get(name, "").strip()), None)
        if name is not None:
            update[key] = env_value(key, name, environ[name].strip())
    found = settings.model_copy(update=update)
    if not found.several_machines:
        return found
    where = {key: next((f"{name}={environ[name].strip()}" for name in MACHINE_ENV[key]
                        if key in update and environ.get(name, "").strip()),
                       f"train.distributed.{key}") for key in MACHINE_ENV}
    if found.machine_rank >= found.num_machines:
        raise ParamsError(f"params.yaml train.distributed.machine_rank {found.machine_rank} "
                          f"({where['machine_rank']}) must be below num_machines "
                          f"{found.num_machines} ({where['num_machines']})")
    if not found.main_process_ip:
        raise ParamsError(f"params.yaml train.distributed.main_process_ip is needed with "
                          f"num_machines {found.num_machines} ({where['num_machines']}): the "
                          "main machine's address, or MASTER_ADDR")
    if found.strategy == "none":
        raise ParamsError(f"params.yaml train.distributed.strategy none runs one process on one "
                          f"machine; num_machines {found.num_machines} ({where['num_machines']}) "
                          "needs auto, ddp, zero2, zero3 or fsdp")
    return found


def env_value(key: str, name: str, text: str) -> int | str:
    """An environment variable's value for `key`, checked as params.yaml's would be."""
    if key == "main_process_ip":
        return text
    low, high = {"num_machines": (1, None), "machine_rank": (0, None),
                 "main_process_port": (1, 65534)}[key]
    value = int(text) if text.isdigit() else -1
    if value < low or (high is not None and value > high):
        allowed = f"an integer in [{low}, {high}]" if high else f"an integer >= {low}"
        raise ParamsError(f"environment variable {name} (train.distributed.{key}): must be "
                          f"{allowed}, got {text!r}")
    return value
