"""Several processes through `accelerate launch`, behind one DVC command (issue 22).

A stage whose params ask for more than this one process (`train.distributed`, `eval.num_processes`)
re-executes its own script under `accelerate launch` with the same arguments, waits for it and
returns its exit code; the launched workers see `VLMRL_LAUNCHED` and do the work. So `dvc.yaml`'s
command is the same for one process or eight, and the launched path is the ordinary stage script.

Rank 0 alone writes a stage's outputs; `is_main_process` reads the rank from the environment
torchrun gives every worker, so a stage can decide before torch is imported. Every launch keeps
NVLink multicast off (NCCL NVLS, torch symmetric memory, NVSHMEM): lent multi-GPU machines require
it, and a launched worker inherits the launcher's environment.

No torch here: the stage scripts import it through the library anyway, and the launcher process
only waits."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

from pydantic import model_validator

from vlmrl.params import ParamsError, PositiveInteger, Section, TrainParams

ACCELERATE_CONFIGS = Path(__file__).parent / "assets" / "accelerate_configs"
WORKER_ENV = "VLMRL_LAUNCHED"
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


# none runs in this process; the others relaunch the stage with the config file of that name.
Strategy = Literal["none", "ddp", "zero2", "zero3", "fsdp"]


class DistributedParams(Section):
    """`train.distributed`: how many processes train and how. The batch sizes in `train.grpo` are
    global: each of `num_processes` processes gets `per_device_train_batch_size / num_processes`
    rows (as accelerate's `split_batches`), so the optimizer and generation batches mean the same
    at any process count. (Here rather than in vlmrl.params, which is at its length limit.)"""

    SECTION = "train.distributed"
    num_processes: PositiveInteger = 1
    strategy: Strategy = "none"
    config_file: str | None = None  # an accelerate config of your own instead of the strategy's

    @model_validator(mode="after")
    def _strategy_for_processes(self) -> Self:
        if self.num_processes > 1 and self.strategy == "none":
            raise ValueError(f"num_processes {self.num_processes} needs a strategy (ddp, zero2, "
                             "zero3 or fsdp); strategy none runs one process")
        return self


def distributed_settings(train: TrainParams) -> DistributedParams:
    return DistributedParams.from_params(train.distributed)


@dataclass(frozen=True)
class Launch:
    """What `accelerate launch` is given: the config file, the process count and the mixed
    precision (from the model's dtype, as in one process; the config file's value is not used)."""

    config_file: Path
    num_processes: int
    mixed_precision: str = "no"


def launched_worker() -> bool:
    """True in a worker of `run_launched`, or of an `accelerate launch`/torchrun run by hand."""
    return os.environ.get(WORKER_ENV) == "1" or "LOCAL_RANK" in os.environ


def die_with_launcher() -> None:
    """torchrun starts each worker in a session of its own, so killing the stage (Ctrl-C on
    `dvc repro`, a killed job) would leave the workers training and writing checkpoints beside
    the next run; here a worker asks Linux to kill it when its launcher dies."""
    if not launched_worker() or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before the request
        os._exit(1)


def process_index() -> int:
    """This process's global rank as torchrun (or an MPI launcher) set it; 0 when not launched."""
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def is_main_process() -> bool:
    return process_index() == 0


def config_for(settings: DistributedParams) -> Path:
    """`train.distributed.config_file`, or the checked-in config of `strategy`."""
    if settings.config_file:
        path = Path(settings.config_file)
        if not path.is_file():
            raise ParamsError(f"params.yaml train.distributed.config_file: {path} is not a file")
        return path
    return ACCELERATE_CONFIGS / f"{settings.strategy}.yaml"


def training_launch(train: TrainParams, mixed_precision: str) -> Launch | None:
    """None where training runs in this process (`strategy: none`)."""
    settings = distributed_settings(train)
    if settings.strategy == "none":
        return None
    return Launch(config_for(settings), settings.num_processes, mixed_precision)


def evaluation_launch(num_processes: int) -> Launch | None:
    """Evaluation is data-parallel inference: plain DDP processes, one model each."""
    if num_processes == 1:
        return None
    return Launch(ACCELERATE_CONFIGS / "ddp.yaml", num_processes)


def launch_command(launch: Launch, script: Path | str, argv: Sequence[str]) -> list[str]:
    """`accelerate launch` on `script` with `argv`; port 0: accelerate picks a free one, so two
    stages (or two test runs) can launch at once."""
    return [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(launch.config_file),
            "--num_processes", str(launch.num_processes), "--num_machines", "1",
            "--mixed_precision", launch.mixed_precision, "--main_process_port", "0",
            str(script), *argv]


def worker_env() -> dict[str, str]:
    return {**os.environ, **NO_MULTICAST_ENV, WORKER_ENV: "1"}


def run_launched(launch: Launch, script: Path | str, argv: Sequence[str]) -> int:
    """Runs the script's workers and returns their exit code (non-zero if any failed)."""
    command = launch_command(launch, script, argv)
    print(f"launching {launch.num_processes} process(es) with {launch.config_file.name}: "
          + " ".join(command[1:]), flush=True)
    return subprocess.run(command, env=worker_env(), check=False).returncode
