"""Several processes through `accelerate launch`, behind one DVC command.

A stage whose params ask for more than this one process (`train.distributed`, `eval.num_processes`)
re-executes its own script under `accelerate launch` with the same arguments, waits for it and
returns its exit code; the launched workers see `VLMRL_LAUNCHED` and do the work. So `dvc.yaml`'s
command is the same for one process or eight, and the launched path is the ordinary stage script.
`auto` (the default of both) means one process per visible GPU where there are several, and this
one process otherwise; a stage that runs in its own process on a host with several GPUs keeps
the first one (`keep_one_gpu`), since TRL's trainers refuse the nn.DataParallel that
transformers' Trainer would otherwise wrap the model in. GPUs are counted with nvidia-smi
(`visible_gpus`), so the decision is made before torch initialises CUDA.

Several machines (`train.distributed.num_machines`, or NNODES with NODE_RANK, MASTER_ADDR and
MASTER_PORT: vlmrl.distributed.settings) run the same stage on each machine; the launchers meet
and watch each other (vlmrl.distributed.nodes) around one multi-node `accelerate launch` each.

Rank 0 alone writes a stage's outputs; `is_main_process` reads the rank from the environment
torchrun gives every worker, so a stage can decide before torch is imported. Every launch keeps
NVLink multicast off (NCCL NVLS, torch symmetric memory, NVSHMEM): lent multi-GPU machines require
it, and a launched worker inherits the launcher's environment.

No torch here: the launcher process only decides and waits."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.distributed.nodes import SKIP, Identity, NodeError, Nodes, identity, meet, watch
from vlmrl.distributed.settings import UP_TO_DATE_ENV, DistributedParams, machines
from vlmrl.params import PARAMS_FILE, ModelParams, ParamsError, TrainParams

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "accelerate_configs"
WORKER_ENV = "VLMRL_LAUNCHED"
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


def visible_gpus() -> int:
    """The CUDA GPUs this process would see, without importing torch (so CUDA is not initialised
    before a stage has chosen its GPUs): the `GPU` lines of `nvidia-smi -L`, narrowed by
    CUDA_VISIBLE_DEVICES as CUDA narrows them; 0 where nvidia-smi is missing or fails."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listed.returncode != 0:
        return 0
    physical = sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return physical if chosen is None else min(physical, len(listed_devices(chosen, physical)))


def listed_devices(chosen: str, physical: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES' entries up to the first one CUDA would not accept (as CUDA reads
    it): indices below `physical`, GPU or MIG UUIDs."""
    entries = []
    for entry in (part.strip() for part in chosen.split(",")):
        valid = (entry.isdigit() and int(entry) < physical) or entry.startswith(("GPU-", "MIG-"))
        if not valid:
            break
        entries.append(entry)
    return entries


def world_size() -> int | None:
    """The process count torchrun gave a launched worker; None outside a launched run."""
    size = os.environ.get("WORLD_SIZE", "")
    return int(size) if launched_worker() and size.isdigit() else None


def resolve(settings: DistributedParams, gpus: int,
            world: int | None = None) -> DistributedParams:
    """`settings` with a concrete strategy (none: this process) and process count, the count of
    every machine's processes together. `auto` processes: `world` in a launched worker, else
    one per GPU where there are several, else 1, on each of `num_machines` machines; `auto`
    strategy: `multi_gpu_strategy` for more than one process, else none. A count that does not
    divide among the machines, or asks more processes of a machine than `gpus` (where there
    are any), is a params error."""
    machines = settings.num_machines
    count = settings.num_processes
    if count == "auto":
        count = world or machines * (gpus if gpus > 1 and settings.strategy != "none" else 1)
    strategy = settings.strategy
    if strategy == "auto":
        strategy = settings.multi_gpu_strategy if count > 1 else "none"
    if world is None and count % machines:
        raise ParamsError(f"params.yaml train.distributed.num_processes ({count}) counts the "
                          f"processes of all {machines} machines and must divide among them")
    if world is None and 0 < gpus < count // machines:
        what = (f"({count}) is more than" if machines == 1 else
                f"({count}) over {machines} machines is {count // machines} each, more than")
        raise ParamsError(f"params.yaml train.distributed.num_processes {what} the {gpus} GPUs "
                          "visible here; one process per GPU at most (auto: one per GPU)")
    return settings.model_copy(update={"strategy": strategy, "num_processes": count})


def distributed_settings(train: TrainParams) -> DistributedParams:
    """`train.distributed` resolved for this process: a launched worker takes its world size,
    any other process the GPUs it sees (one, once a stage has kept one GPU)."""
    world = world_size()
    return resolve(DistributedParams.from_params(train.distributed),
                   0 if world else visible_gpus(), world)


def keep_one_gpu(gpus: int, why: str) -> None:
    """Where a stage runs in this process on a host with several GPUs, shows it only the first
    (CUDA_VISIBLE_DEVICES, before CUDA is initialised) and says so in one line: with several
    GPUs visible, transformers' Trainer would wrap the model in nn.DataParallel, which TRL's
    trainers refuse."""
    if gpus <= 1:
        return
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    first = chosen.split(",")[0].strip() if chosen else "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = first
    print(f"{why}: one process on GPU {first} of the {gpus} visible "
          f"(CUDA_VISIBLE_DEVICES={first})", flush=True)


# The CUDA allocator's settings; torch reads the first of these that is set.
ALLOC_CONF_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def use_expandable_segments(enabled: bool,
                            environ: MutableMapping[str, str] = os.environ) -> bool:
    """`train.expandable_segments`: PyTorch's CUDA allocator maps memory into segments that grow
    in place (what Unsloth sets on import). Without it, the first training micro-batch after a
    generation took several times as long as the others on the H100, its forward and backward
    both; with it, about what they take, at the same peak (`benchmarks/gspo_step.py`'s phase
    table in docs/benchmarks.md). Set through the allocator's public setting, the environment
    variable torch reads when CUDA initialises: a stage sets it before importing torch, and its
    launched workers inherit it. A user's own entries stay, their `expandable_segments` too.
    True if it changed the environment."""
    if not enabled:
        return False
    name = next((name for name in ALLOC_CONF_ENVS if environ.get(name, "").strip()),
                "PYTORCH_CUDA_ALLOC_CONF")
    entries = [entry.strip() for entry in environ.get(name, "").split(",") if entry.strip()]
    if any(entry.split(":")[0].strip() == "expandable_segments" for entry in entries):
        return False
    environ[name] = ",".join([*entries, "expandable_segments:True"])
    return True


def unsloth_chosen(requested: str) -> bool:
    """Whether `model.backend` resolves to Unsloth: only where it names it (`auto` is
    transformers, as vlmrl.models.backend.pick_backend decides)."""
    return requested == "unsloth"


def training_plan(train: TrainParams, model: ModelParams, stage: str) -> DistributedParams:
    """What a training stage does, decided before torch initialises CUDA: `train.distributed`
    resolved on this host and checked against the model. Where it runs in this process on
    several GPUs it keeps one; Unsloth trains on one GPU, so `auto` keeps one for it too (an
    explicit strategy or count with Unsloth is a params error, as is Unsloth on several
    machines). The machines come from params and the environment (`machines`). A launched
    worker only resolves."""
    if launched_worker():
        return distributed_settings(train)
    gpus = visible_gpus()
    settings = machines(DistributedParams.from_params(train.distributed))
    resolved = resolve(settings, gpus)
    unsloth = unsloth_chosen(model.backend)
    if unsloth and resolved.strategy != "none" and settings.strategy == "auto" == (
            settings.num_processes) and not settings.several_machines:
        keep_one_gpu(gpus, f"{stage}: Unsloth trains on one GPU (model.backend: transformers "
                           "trains on all)")
        return resolved.model_copy(update={"strategy": "none", "num_processes": 1})
    check_strategy(resolved, "unsloth" if unsloth else model.backend, model.load_in_4bit)
    if resolved.strategy == "none":
        keep_one_gpu(gpus, f"{stage}: train.distributed.strategy {settings.strategy}, "
                           f"num_processes {settings.num_processes}")
    return resolved


def check_strategy(settings: DistributedParams, backend: str, load_in_4bit: bool) -> None:
    """Settings the launched path does not support, named before anything loads."""
    if settings.strategy == "none":
        return
    if backend == "unsloth":
        raise ParamsError("params.yaml train.distributed.strategy "
                          f"{settings.strategy}: Unsloth trains on one GPU; set "
                          "model.backend: transformers (or strategy: none)")
    if load_in_4bit and settings.strategy in ("zero3", "fsdp"):
        raise ParamsError(f"params.yaml model.load_in_4bit with train.distributed.strategy "
                          f"{settings.strategy}: sharding 4-bit weights is not supported "
                          "here; use ddp or zero2")


def check_world(world: int, num_processes: int, script: str) -> None:
    """The trainer's process count against `train.distributed`'s: a run launched by hand with
    another count would split the batch wrongly."""
    if world != num_processes:
        raise ParamsError(f"params.yaml train.distributed.num_processes is {num_processes} but "
                          f"{world} processes were launched; let the stage launch itself "
                          f"(python {script} ...)")


def evaluation_processes(setting: int | str) -> int:
    """`eval.num_processes` for the evaluation this process takes part in: `auto` is the world
    size of a launched worker, and 1 in a process that was not launched (a stage that evaluates
    in its own process, or a caller of vlmrl.evaluation.evaluate)."""
    if setting != "auto":
        return int(setting)
    return world_size() or 1


def evaluation_plan(setting: int | str, model: ModelParams, stage: str) -> int:
    """The evaluation's process count on this host, decided before torch initialises CUDA; a
    run of one process on several GPUs keeps one (`auto` with Unsloth, which runs on one GPU,
    too)."""
    if launched_worker():
        return evaluation_processes(setting)
    gpus = visible_gpus()
    if setting == "auto" and gpus > 1 and unsloth_chosen(model.backend):
        keep_one_gpu(gpus, f"{stage}: Unsloth runs on one GPU (model.backend: transformers "
                           "evaluates on all)")
        return 1
    count = int(setting) if setting != "auto" else max(1, gpus)
    if 0 < gpus < count:
        raise ParamsError(f"params.yaml eval.num_processes ({count}) is more than the {gpus} "
                          "GPUs visible here; one process per GPU at most (auto: one per GPU)")
    if count == 1:
        keep_one_gpu(gpus, f"{stage}: eval.num_processes {setting}")
    return count


@dataclass(frozen=True)
class Launch:
    """What `accelerate launch` is given: the config file, the process count and the mixed
    precision (from the model's dtype, as in one process; the config file's value is not used)."""

    config_file: Path
    num_processes: int  # on every machine together
    mixed_precision: str = "no"
    nodes: Nodes | None = None  # several machines: this one's place among them


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


def training_launch(settings: DistributedParams, mixed_precision: str) -> Launch | None:
    """None where training runs in this process (resolved strategy none)."""
    if settings.strategy == "none":
        return None
    return Launch(config_for(settings), settings.num_processes, mixed_precision,
                  settings.nodes() if settings.several_machines else None)


def evaluation_launch(num_processes: int) -> Launch | None:
    """Evaluation is data-parallel inference: plain DDP processes, one model each."""
    if num_processes == 1:
        return None
    return Launch(ACCELERATE_CONFIGS / "ddp.yaml", num_processes)


def launch_command(launch: Launch, script: Path | str, argv: Sequence[str]) -> list[str]:
    """`accelerate launch` on `script` with `argv`. One machine: port 0, so that accelerate picks
    a free one and two stages (or two test runs) can launch at once. Several: this machine's
    rank, the main machine's address and port, and torch's static rendezvous, which waits
    `rdzv_timeout` for the machines (by then the launchers have met: `run_on_nodes`)."""
    command = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", str(launch.config_file),
               "--num_processes", str(launch.num_processes)]
    nodes = launch.nodes
    if nodes is None:
        command += ["--num_machines", "1", "--mixed_precision", launch.mixed_precision,
                    "--main_process_port", "0"]
    else:
        command += ["--num_machines", str(nodes.count), "--machine_rank", str(nodes.rank),
                    "--main_process_ip", nodes.address, "--main_process_port", str(nodes.port),
                    "--rdzv_backend", "static", "--rdzv_conf", f"timeout={nodes.timeout:g}",
                    "--mixed_precision", launch.mixed_precision]
    return [*command, str(script), *argv]


def worker_env() -> dict[str, str]:
    return {**os.environ, **NO_MULTICAST_ENV, WORKER_ENV: "1"}


def launch_unless_worker(plan: DistributedParams | None, trainer_args: Mapping[str, Any],
                         model: ModelParams, script: Path | str, outputs: Sequence[Path],
                         params_file: Path = PARAMS_FILE) -> bool:
    """The launcher's half of a training stage. Where `plan` asks for several processes and this
    process is none of them, runs the stage script's workers under `accelerate launch` with this
    process's arguments (on several machines, once the machines have met) and returns True once
    they succeeded (rank 0 wrote the outputs); where one failed, brings back the outputs a killed
    rank 0 could not (vlmrl.outputs) and exits with their status, or raises the NodeError that
    names the machine that failed. On node 0, with UP_TO_DATE_ENV set (DVC has the stage up to
    date), it only tells the other machines so and returns True. Otherwise returns False and
    this process does the work (a launched worker first asks to die with its launcher).

    Args:
        plan: `training_plan`'s decision, or None for a stage with nothing to train.
        trainer_args: the trainer's params section (`train.grpo`, `sft.args`), whose precision
            flags the launch passes to accelerate.
        outputs: the stage's outputs, which rank 0 writes.
        params_file: the stage's params file, which every machine must hold the same.
    """
    several = plan is not None and plan.several_machines and not launched_worker()
    if os.environ.get(UP_TO_DATE_ENV) == "1" and not launched_worker():
        if several:
            meet(plan.nodes(), identity(script, sys.argv[1:], params_file), SKIP)
        return True
    if plan is None or plan.strategy == "none" or launched_worker():
        die_with_launcher()
        return False
    from vlmrl.models.backend import mixed_precision  # torch, not initialising CUDA

    launch = training_launch(plan, mixed_precision(trainer_args, model))
    if several:
        me = identity(script, sys.argv[1:], params_file)
        finish_launched(run_on_nodes(launch, script, sys.argv[1:], me), outputs)
    else:
        finish_launched(run_launched(launch, script, sys.argv[1:]), outputs)
    return True


def other_machine(train: TrainParams) -> bool:
    """Whether this process is the launcher of a machine other than the main one of a
    multi-machine run, which writes nothing: a stage with nothing to train leaves its
    pass-through to node 0."""
    if launched_worker():
        return False
    settings = machines(DistributedParams.from_params(train.distributed))
    return settings.several_machines and settings.machine_rank > 0


def finish_launched(code: int | BaseException, outputs: Sequence[Path]) -> None:
    """After the workers: a failure exits with their status (or raises the NodeError that
    stopped them), with the outputs that a killed rank 0 left moved aside brought back."""
    if code:
        from vlmrl.outputs import recover_outputs

        recover_outputs(*outputs)
        if isinstance(code, BaseException):
            print(file=sys.stderr, flush=True)  # ends a progress bar's line before the error's
            raise code
        raise SystemExit(code)


def run_launched(launch: Launch, script: Path | str, argv: Sequence[str]) -> int:
    """Runs the script's workers and returns their exit code (non-zero if any failed)."""
    command = launch_command(launch, script, argv)
    print(f"launching {launch.num_processes} process(es) with {launch.config_file.name}: "
          + " ".join(command[1:]), flush=True)
    return subprocess.run(command, env=worker_env(), check=False).returncode


def run_on_nodes(launch: Launch, script: Path | str, argv: Sequence[str],
                 me: Identity) -> int | NodeError:
    """This machine's share of a multi-machine run: meets the other machines' launchers, runs
    its workers and watches the others until they end (vlmrl.distributed.nodes). Returns the
    workers' exit code, or the NodeError naming the machine that failed, left or never came."""
    nodes = launch.nodes
    try:
        peers, answer = meet(nodes, me)
        if answer == SKIP:
            print(f"{nodes.name()}: node 0 has the stage up to date; nothing to train here",
                  flush=True)
            return 0
        command = launch_command(launch, script, argv)
        print(f"{nodes.name()}: launching {launch.num_processes // nodes.count} of "
              f"{launch.num_processes} process(es) with {launch.config_file.name}: "
              + " ".join(command[1:]), flush=True)
        return watch(nodes, peers, subprocess.Popen(command, env=worker_env()))
    except NodeError as error:
        return error
