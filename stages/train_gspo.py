"""train_gspo: LoRA on the language model with TRL's GRPOTrainer in GSPO mode.

Where `train.distributed` resolves to several processes (by default one per GPU, on a host with
several) the script relaunches itself under `accelerate launch` (vlmrl.distributed.launch) and rank 0 alone
writes the outputs; on several machines (`train.distributed.num_machines`, or NNODES and NODE_RANK)
each machine runs this script and only node 0's rank 0 writes. The decision comes before torch is imported (vlmrl.training.gspo imports it), so
a run in this process on a host with several GPUs can still keep to one of them."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from vlmrl.distributed.launch import (
    is_main_process,
    launch_unless_worker,
    training_plan,
    use_expandable_segments,
)
from vlmrl.errors import run_stage
from vlmrl.outputs import atomic_dir, stage_outputs, training_stage_parser, write_json_atomic
from vlmrl.params import load_params
from vlmrl.reporting.metrics import write_stage_metrics


def main() -> int:
    """The stage: GSPO training in this process or relaunched with one process per GPU (or
    machine), resumed from its checkpoints where a run was cut off; rank 0 writes the adapter,
    the logs, the sample completions, the curves and the metrics. Returns the exit status."""
    parser = training_stage_parser(__doc__, "adapter directory")
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--completions", type=Path, required=True)
    parser.add_argument("--samples", type=Path, required=True,
                        help="TRL's sample completions table (train.grpo.log_completions)")
    parser.add_argument("--curves", type=Path, required=True,
                        help="PNG of the training curves, redrawn at every checkpoint save")
    parser.add_argument("--start-adapter", type=Path,
                        help="the sft_cold_start stage's output: its adapter is continued "
                             "(a fresh one if that SFT was a pass-through)")
    args = parser.parse_args()

    outputs = (args.out, args.metrics, args.details, args.log, args.completions, args.samples,
               args.curves, args.timings)
    params = load_params(args.params)  # a bad param fails here, before any file moves
    use_expandable_segments(params.train.expandable_segments)  # before torch initialises CUDA
    plan = training_plan(params.train, params.model, "train_gspo")
    if launch_unless_worker(plan, params.train.grpo, params.model, __file__, outputs,
                            args.params):
        return 0
    with stage_outputs(*outputs, owner=is_main_process()):
        from vlmrl.training.gspo import LiveOutputs, train  # torch: once the GPUs are chosen

        result = train(train_set=args.train_set, params=params, adapter_out=args.out,
                       checkpoints=args.checkpoints, sft_out=args.start_adapter,
                       live=LiveOutputs(args.log, args.curves, args.samples))
        if result is not None:
            write_outputs(args, result)
    if result is not None:
        batch = result.summary["batch"]
        print(f"trained {result.summary['steps']} steps in {result.summary['runtime_seconds']} s "
              f"on {batch['num_processes']} process(es), global batch {batch['global_batch_size']} "
              f"({batch['num_processes']} x {batch['per_device_train_batch_size']} x "
              f"{batch['gradient_accumulation_steps']} accumulation); adapter in {args.out}")
    return 0


def write_outputs(args: argparse.Namespace, result) -> None:
    """Writes a finished training's declared outputs beside the adapter: the sample completions
    (TRL's parquet files), the per-step log, the metrics and the training curves.

    Args:
        args: the command line, for the output paths.
        result: the `vlmrl.training.gspo.TrainResult` that `train` returned on rank 0.
    """
    from vlmrl.training.gspo import plot_training_curves

    with atomic_dir(args.completions) as staging:
        for parquet in sorted(result.completions_dir.glob("*.parquet")):
            shutil.copy2(parquet, staging / parquet.name)
    write_json_atomic(args.log, result.log_rows)
    write_stage_metrics("train_gspo", result.summary, metrics=args.metrics, details=args.details,
                        timings=args.timings)
    plot_training_curves(result.log_rows, args.curves)


if __name__ == "__main__":
    raise SystemExit(run_stage("train_gspo", main))
