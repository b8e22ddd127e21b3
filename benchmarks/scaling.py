"""GSPO training on 1 and 2 GPUs: tokens per second, seconds per optimizer step by phase and rank,
and per-GPU peak memory, through the train_gspo stage's own `vlmrl.training.gspo.train`.

Runs (`RUNS`, chosen with `--runs`):

  one          the 2B recipe's profile (recipes/mathvista-qwen3-vl-2b.yaml: NF4 weights, graph
               decoding over a float8 cache, micro-batches of 8 x 2 accumulation, a generation of 32
               rows for two optimizer steps) on `embedded:qwen3-vl-2b-shape`, in one process
  strong       the same global batch on 2 processes (ddp): each trains and generates half of it
  weak         the same batch per GPU on 2 processes: twice the global batch
  8b_one       the 8B recipe on `embedded:qwen3-vl-8b-shape` in bf16 (no 4-bit: sharding needs
               16-bit weights), eager decoding, in one process
  8b_sharded   the same on 2 processes under `--sharded-strategy` (fsdp, or zero3 where DeepSpeed
               is installed): per-GPU peak memory against one GPU's

Each run is a fresh process group: the one-process runs in a process that sees the first GPU
alone (what `auto` does on one GPU), the others under `accelerate launch` (vlmrl.distributed.launch), each
process on its own GPU. Every process records, per optimizer step, the seconds of each phase
(generation, old log-probabilities, the loss's forward, the backward, waiting for the slower rank)
with the device synchronised around each, and its generated tokens. The all-reduce of the LoRA
gradients runs inside the backward of the micro-batch that syncs (DDP overlaps it with the
backward); it is the backward with gradient sync minus the mean backward without it (the other
micro-batches of a gradient accumulation), after both ranks met at a barrier. Waiting for the
slower rank is measured at two barriers: after each generation (before the rewards are gathered)
and before each synced backward. An all-reduce of the gradients' size alone is timed after
training as a check. The random-init models never sample EOS, so every completion runs to
`--length` tokens.

Results merge into `--out` (`runs`: run -> its summary and per-rank records), so runs of separate
device calls accumulate; `--render` writes the tables into `--doc` between this script's markers:
the tokens per second and the verdicts in the block `:summary`, the phases per rank and the
8B shape's memory in the unnamed block.

Usage (on a host with 2 GPUs; tests/gpu/run_on_device.sh scaling installs what is missing):
  PYTHONPATH=src python benchmarks/scaling.py --runs one,strong,weak --length 1024 \\
      --warmup 2 --steps 2 --out benchmarks/results/scaling.json
  PYTHONPATH=src python benchmarks/scaling.py --runs 8b_one,8b_sharded --sharded-length 256 \\
      --warmup 0 --steps 2 --out benchmarks/results/scaling.json
  python benchmarks/scaling.py --render 2b.json 8b.json   # merged into --out, the tables into
                                                          # --doc (docs/benchmarks.md); no run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from doc_blocks import fields_of, read_results, write_doc_block
from gspo_measure import _sync, synced_timer
from scaling_tables import run_summary, scaling_summary, scaling_table

from vlmrl.pipeline.recipes import recipe_params

ROOT = Path(__file__).resolve().parents[1]
RECIPE_2B = ROOT / "recipes" / "mathvista-qwen3-vl-2b.yaml"
RECIPE_8B = ROOT / "recipes" / "mathvista-qwen3-vl-8b.yaml"
MODEL_2B, MODEL_8B = "embedded:qwen3-vl-2b-shape", "embedded:qwen3-vl-8b-shape"
SMOKE_MODEL = "embedded:tiny-qwen3-vl"
# The 8B runs' steps as measured (micro-batches of 8, two per optimizer step, four per
# generation), whatever micro-batch the 8B recipe trains in.
SHARDED_STEPS = {"gradient_accumulation_steps": 2, "steps_per_generation": 4}
RUNS: dict[str, dict[str, Any]] = {
    "one": {"recipe": RECIPE_2B, "model": MODEL_2B, "processes": 1, "batch": 8},
    "strong": {"recipe": RECIPE_2B, "model": MODEL_2B, "processes": 2, "batch": 8},
    "weak": {"recipe": RECIPE_2B, "model": MODEL_2B, "processes": 2, "batch": 16},
    "8b_one": {"recipe": RECIPE_8B, "model": MODEL_8B, "processes": 1, "batch": 8,
               "sharded": True, "grpo": SHARDED_STEPS},
    "8b_sharded": {"recipe": RECIPE_8B, "model": MODEL_8B, "processes": 2, "batch": 8,
                   "sharded": True, "grpo": SHARDED_STEPS},
}


# ------------------------------------------------------------------ params of a run

def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def run_params(name: str, length: int, total_steps: int, sharded_strategy: str = "fsdp",
               smoke: bool = False) -> dict[str, Any]:
    """The recipe of run `name` as params.yaml's dict, with the run's model, batch, process count
    and strategy, `length`-token completions and `total_steps` steps. `smoke`: the tiny model on
    a CPU (no 4-bit, no graph decoding, no compilation), to check this script without a GPU."""
    run = RUNS[name]
    raw = recipe_params(run["recipe"].stem, ROOT)
    processes = run["processes"]
    strategy = "none" if processes == 1 else sharded_strategy if run.get("sharded") else "ddp"
    overrides: dict[str, Any] = {
        "model.name": run["model"], "train.resume": False, "train.save_steps": 10**6,
        "train.distributed": {"strategy": strategy, "num_processes": processes,
                              "multi_gpu_strategy": "ddp", "config_file": None},
        "train.grpo.max_steps": total_steps, "train.grpo.max_completion_length": length,
        "train.grpo.per_device_train_batch_size": run["batch"],
        "train.grpo.log_completions": False, "train.grpo.report_to": "none",
        "train.grpo.generation_kwargs": {"max_cache_len": (512 + length + 63) // 64 * 64,
                                         "disable_compile": False}}
    overrides.update({f"train.grpo.{key}": value for key, value in run.get("grpo", {}).items()})
    eager = {"model.load_in_4bit": False, "train.graph_decoding": "eager",
             "train.kv_cache_dtype": "auto", "train.grpo.optim": "adamw_torch",
             "train.grpo.cache_implementation": None,
             "train.grpo.generation_kwargs": {"disable_compile": True}}
    if run.get("sharded"):  # 16-bit weights to shard, eager decoding, no 8-bit optimizer state
        overrides.update(eager)
    if smoke:
        overrides.update({**eager, "model.name": SMOKE_MODEL,
                          "train.grpo.gradient_checkpointing": False})
    for dotted, value in overrides.items():
        set_dotted(raw, dotted, value)
    return raw


# ------------------------------------------------------------------ one process of a run (worker)

def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def barrier_seconds() -> float:
    """Seconds until every rank reached this point (a one-element all-reduce), 0 alone."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    _sync()
    started = time.perf_counter()
    flag = torch.zeros(1, device="cuda" if _cuda() else "cpu")
    dist.all_reduce(flag)
    _sync()
    return time.perf_counter() - started


class PhaseRecorder:
    """Per optimizer step (the trainer's `global_step` while it runs): each phase's seconds and
    the tokens generated, recorded as the trainer runs."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []  # [phase, step, seconds]
        self.steps: list[list[Any]] = []  # [step, seconds]
        self.tokens: list[list[int]] = []  # [step, generated tokens, completions]
        self.trainer = None

    def record(self, phase: str, seconds: float) -> None:
        self.calls.append([phase, self.trainer.state.global_step, round(seconds, 5)])

    def timed(self, original, phase_of):
        return synced_timer(original, phase_of, self.record)

    def attach(self, trainer) -> None:
        """Wraps the trainer's generation, log-probability, loss and backward calls."""
        import torch

        self.trainer = trainer
        generate = trainer._generate_single_turn

        def generate_and_wait(*args, **kwargs):
            _sync()
            started = time.perf_counter()
            completion_ids, logprobs = generate(*args, **kwargs)
            _sync()
            self.record("generation", time.perf_counter() - started)
            self.tokens.append([trainer.state.global_step,
                                sum(len(ids) for ids in completion_ids), len(completion_ids)])
            self.record("wait", barrier_seconds())
            return completion_ids, logprobs

        trainer._generate_single_turn = generate_and_wait
        logps = "_get_per_token_logps_and_entropies"
        setattr(trainer, logps, self.timed(
            getattr(trainer, logps), lambda: None if torch.is_grad_enabled() else "old_logps"))
        trainer.compute_loss = self.timed(trainer.compute_loss, lambda: "forward")
        accelerator = trainer.accelerator
        backward = self.timed(accelerator.backward, lambda: (
            "backward_sync" if accelerator.num_processes > 1 and accelerator.sync_gradients
            else "backward"))

        def backward_after_barrier(*args, **kwargs):
            if accelerator.num_processes > 1 and accelerator.sync_gradients:
                self.record("wait", barrier_seconds())
            return backward(*args, **kwargs)

        accelerator.backward = backward_after_barrier

    def callback(self):
        from transformers import TrainerCallback

        recorder = self

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                _sync()
                self.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                _sync()  # global_step already counts this step
                recorder.steps.append([state.global_step - 1,
                                       round(time.perf_counter() - self.started, 5)])

        return StepTimer()


def allreduce_probe(numel: int, repeats: int = 5) -> float | None:
    """Median seconds of an all-reduce of `numel` float32 values (the LoRA gradients' size)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    buffer = torch.ones(numel, device="cuda" if _cuda() else "cpu")
    times = []
    for _ in range(repeats + 1):
        barrier_seconds()
        started = time.perf_counter()
        dist.all_reduce(buffer)
        _sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def memory_record() -> dict[str, float | None]:
    import torch

    if not torch.cuda.is_available():
        return {"peak_allocated_gib": None, "peak_reserved_gib": None, "device_used_gib": None}
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "device_used_gib": round((total - free) / 2**30, 2)}


def worker(args: argparse.Namespace) -> None:
    """One process of run `args.worker`: trains through vlmrl.training.gspo.train with the recorder
    attached and writes its record to `<result-dir>/rank<RANK>.json`."""
    from vlmrl.distributed.launch import die_with_launcher, process_index
    from vlmrl.params import Params
    from vlmrl.training import gspo as training

    die_with_launcher()  # a run stopped at its time limit takes its workers with it
    rank = process_index()
    out = args.result_dir / f"rank{rank}.json"
    raw = json.loads(args.params_json.read_text())
    recorder = PhaseRecorder()
    make_trainer = training.make_trainer

    def make_and_record(*make_args, **kwargs):
        trainer = make_trainer(*make_args, **kwargs)
        recorder.attach(trainer)
        return trainer

    training.make_trainer = make_and_record  # train() looks it up when it builds the trainer
    work = Path(tempfile.mkdtemp(prefix=f"scaling-{args.worker}-"))
    record: dict[str, Any] = {"rank": rank}
    try:
        from vlmrl.distributed.launch import use_expandable_segments

        use_expandable_segments(Params(raw).train.expandable_segments)  # before CUDA starts
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        training.train(train_set=args.train_set, params=Params(raw), adapter_out=work / "adapter",
                       checkpoints=work / "checkpoints", callbacks=[recorder.callback()])
        record["train_seconds"] = round(time.perf_counter() - started, 2)
        record.update(memory_record())
        trainable = sum(p.numel() for p in recorder.trainer.model.parameters() if p.requires_grad)
        record.update(world=recorder.trainer.accelerator.num_processes,
                      trainable_parameters=trainable, allreduce_probe_s=allreduce_probe(trainable))
    except Exception as error:  # noqa: BLE001  (recorded: the table says why a run failed)
        traceback.print_exc()
        record["error"] = f"{type(error).__name__}: {error}"[:2000]
    record.update(calls=recorder.calls, steps=recorder.steps, tokens=recorder.tokens)
    out.write_text(json.dumps(record))
    shutil.rmtree(work, ignore_errors=True)  # the adapter rank 0 wrote: not what is measured


# ------------------------------------------------------------------ the runs (parent)

def load_results(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {"runs": {}}


def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Results of several calls as one: the runs of each, later ones replacing earlier ones of
    the same name; the device line of the last (each call names its own in its runs' order)."""
    result: dict[str, Any] = {"runs": {}}
    for part in parts:
        result["runs"].update(part["runs"])
        if "device" in part:
            result["device"] = part["device"]
    return result


def save_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def first_gpu_env() -> dict[str, str]:
    """The environment of a one-process run: the first visible GPU alone, as `auto` keeps it."""
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = chosen.split(",")[0] if chosen else "0"
    return {**os.environ, "CUDA_VISIBLE_DEVICES": first}


def run_command(name: str, raw: dict[str, Any], argv: list[str], smoke: bool
                ) -> tuple[list[str], dict[str, str]]:
    """The command and environment of run `name`: this script's worker, in one process or under
    `accelerate launch` with the run's strategy."""
    from vlmrl.distributed.launch import (
        DistributedParams,
        Launch,
        config_for,
        launch_command,
        worker_env,
    )

    settings = DistributedParams.from_params(raw["train"]["distributed"])
    if settings.num_processes == 1:
        return [sys.executable, __file__, *argv], first_gpu_env()
    launch = Launch(config_for(settings), settings.num_processes, "no" if smoke else "bf16")
    return launch_command(launch, __file__, argv), worker_env()


def measure(name: str, args: argparse.Namespace, train_set: Path, budget_left: float
            ) -> dict[str, Any]:
    run = RUNS[name]
    sharded = run.get("sharded", False)
    length = args.sharded_length if sharded else args.length
    raw = run_params(name, length, args.warmup + args.steps, args.sharded_strategy, args.smoke)
    result_dir = Path(tempfile.mkdtemp(prefix=f"scaling-{name}-"))
    params_json = result_dir / "params.json"
    params_json.write_text(json.dumps(raw))
    argv = ["--worker", name, "--result-dir", str(result_dir), "--params-json",
            str(params_json), "--train-set", str(train_set)]
    command, env = run_command(name, raw, argv, args.smoke)
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    try:
        subprocess.run(command, env=env, timeout=max(30.0, min(args.run_timeout_s, budget_left)),
                       check=False)
    except subprocess.TimeoutExpired:
        print(f"{name}: timed out", flush=True)
    records = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    shutil.rmtree(result_dir, ignore_errors=True)
    summary = run_summary(records, args.warmup)
    if records and len(records) < run["processes"] and "error" not in summary:
        summary = {"error": f"{len(records)} of {run['processes']} ranks wrote a record"}
    summary.update(strategy=raw["train"]["distributed"]["strategy"], model=raw["model"]["name"],
                   completion_length=length, warmup_steps=args.warmup,
                   global_batch=raw["train"]["grpo"]["per_device_train_batch_size"],
                   wall_seconds=round(time.perf_counter() - started, 1), records=records)
    return summary


def prepare(args: argparse.Namespace, names: list[str]) -> Path:
    """The models the runs need, built on the GPU in a process of their own (this one keeps no
    CUDA context beside the runs), and the project's synthetic set."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gspo_worker import prepare_train_set

    models = sorted({SMOKE_MODEL if args.smoke else RUNS[n]["model"] for n in names})
    for model in models:
        code = ("import torch; from vlmrl.models.embedded import ensure_embedded_model; "
                f"print(ensure_embedded_model({model!r}, seed=0, "
                "device='cuda' if torch.cuda.is_available() else 'cpu'))")
        subprocess.run([sys.executable, "-c", code], check=True)
    return prepare_train_set(args.work, args.dataset_size, 64 if args.smoke else 512)


def device_line() -> str:
    code = ("import torch; p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() "
            "else None; print(f'{torch.cuda.device_count()} x {p.name} "
            "({p.total_memory / 2**30:.0f} GiB)' if p else 'CPU (no CUDA)')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False).stdout.strip() or "unknown device"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="one,strong,weak",
                        help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--length", type=int, default=1024, help="completion tokens, 2B runs")
    parser.add_argument("--sharded-length", type=int, default=256,
                        help="completion tokens, 8B runs")
    parser.add_argument("--sharded-strategy", default="fsdp", choices=("fsdp", "zero3"))
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed optimizer steps (compilation, the first generation)")
    parser.add_argument("--steps", type=int, default=2,
                        help="timed optimizer steps (2: one generation serves two)")
    parser.add_argument("--dataset-size", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=500,
                        help="stop starting runs when less than --min-run-s of this is left")
    parser.add_argument("--min-run-s", type=float, default=150,
                        help="a run needs about this long on the 2-GPU host (2B, 1024 tokens)")
    parser.add_argument("--run-timeout-s", type=float, default=300)
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model on the CPU: checks this script, measures nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/scaling.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument("--render", type=Path, nargs="+", metavar="JSON",
                        help="write the tables of earlier runs' JSON into --doc and the runs into "
                             "--out; run nothing. Several files (device calls) are merged, later "
                             "runs replacing earlier ones of the same name")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "scaling")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--params-json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--train-set", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.render:
        with fields_of(", ".join(map(str, args.render)), "scaling.py --render"):
            results = merged([read_results(path) for path in args.render])
            summary, details = scaling_summary(results), scaling_table(results)
        if [path.resolve() for path in args.render] != [args.out.resolve()]:
            save_results(args.out, results)  # the device calls' files, kept as one
        write_doc_block(args.doc, summary, Path(__file__).name, ":summary")
        write_doc_block(args.doc, details, Path(__file__).name)
        return 0
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    started = time.perf_counter()
    os.environ.setdefault("VLMRL_CACHE", str(args.work / "cache"))
    train_set = prepare(args, names)
    results = load_results(args.out)
    results["device"] = device_line()
    print(f"{results['device']}; setup {time.perf_counter() - started:.0f} s", flush=True)
    for name in names:
        left = args.budget_s - (time.perf_counter() - started)
        if left < args.min_run_s:
            print(f"{name}: skipped, {left:.0f} s of the budget left", flush=True)
            continue
        results["runs"][name] = {**measure(name, args, train_set, left),
                                 "device": results["device"]}
        save_results(args.out, results)
        shown = {k: v for k, v in results["runs"][name].items() if k != "records"}
        print(json.dumps(shown), flush=True)
    print(scaling_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
