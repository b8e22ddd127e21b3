"""sft_cold_start: prime the answer format with TRL's SFTTrainer before GSPO (vlmrl.training.sft);
writes the starting LoRA adapter that baseline_eval applies and train_gspo continues.

Like train_gspo, where `train.distributed` resolves to several processes (by default one per
GPU, on a host with several) the script relaunches itself under `accelerate launch`
(vlmrl.distributed.launch) and rank 0 alone writes; the decision comes before torch is imported. A
pass-through SFT (nothing to train) always runs in this process, on the main machine alone where
several train together."""

from __future__ import annotations

from vlmrl.distributed.launch import (
    is_main_process,
    launch_unless_worker,
    other_machine,
    training_plan,
)
from vlmrl.errors import run_stage
from vlmrl.outputs import stage_outputs, training_stage_parser, write_json_atomic
from vlmrl.params import load_params
from vlmrl.reporting.metrics import write_stage_metrics


def main() -> int:
    """The stage: the cold-start SFT in this process or relaunched with one process per GPU, or a
    pass-through marker where `sft` trains nothing; rank 0 writes the starting adapter, the log
    and the metrics. Returns the exit status."""
    args = training_stage_parser(__doc__, "starting adapter directory").parse_args()

    outputs = (args.out, args.metrics, args.log, args.details, args.timings)
    params = load_params(args.params)  # a bad param fails here, before any file moves
    if not params.sft.trains and other_machine(params.train):
        print("sft_cold_start: nothing to train; node 0 writes the pass-through")
        return 0
    plan = training_plan(params.train, params.model, "sft_cold_start") \
        if params.sft.trains else None
    if launch_unless_worker(plan, params.sft.args, params.model, __file__, outputs,
                            args.params):
        return 0
    with stage_outputs(*outputs, owner=is_main_process()):
        from vlmrl.training.sft import run_sft  # torch: once the GPUs are chosen

        summary = run_sft(train_set=args.train_set, params=params, out=args.out, log=args.log)
        if summary is not None:
            write_json_atomic(args.log, summary.pop("log"))
            write_stage_metrics("sft_cold_start", summary, metrics=args.metrics,
                                details=args.details, timings=args.timings)
    if summary is not None:
        processes = summary.get("batch", {}).get("num_processes", 1)
        print(f"SFT: {summary['steps']} steps on {processes} process(es); starting adapter: "
              f"{summary['adapter']} ({args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_stage("sft_cold_start", main))
