"""Measures, on a GPU, the cold-start SFT and GSPO settings of the GPU stage tests
(tests/gpu/test_stages_gpu.py `SMALL`), so that they are chosen from numbers: for each SFT
candidate (learning rate, steps) the sft_cold_start stage's own `run_sft`, then the train_gspo
stage's own `train` continuing that adapter, both in this one process (the model is loaded once
per run, as the stages do). Per GSPO optimizer step it records reward, reward std, the share of
groups with reward std 0, grad norm and clip ratio (TRL's log), and for every row the sequence
log importance ratio log(pi/pi_old) and the advantage (captured from TRL's loss), from which the
clip ratio of any epsilon pair follows: a row counts as clipped when its ratio is below 1 - eps
with a negative advantage or above 1 + eps_high with a positive one. The ratios of step 2 (the
first off-policy step) do not depend on epsilon, since step 1 is on-policy and never clipped.

`--gspo-lrs` runs GSPO at other learning rates from the first candidate's SFT adapter.
`--repeat` runs the first candidate's SFT and GSPO a second time with the same params, to see
whether two runs with one seed repeat on this GPU (nothing sets
torch.use_deterministic_algorithms here, as the stages do not).

Usage (on the GPU machine; tests/gpu/run_on_device.sh sets up the environment):
  PYTHONPATH=src python benchmarks/gspo_settings_probe.py --sft 2e-3:8,5e-3:12 --out probe.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

STEP_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "grad_norm",
             "clip_ratio_region_mean", "clip_ratio_low_mean", "clip_ratio_high_mean",
             "completions_mean_length", "rewards_format_reward_mean",
             "rewards_correctness_reward_mean")
EPSILONS = [(3e-4, 4e-4), (1e-3, 1.5e-3), (3e-3, 4e-3), (1e-2, 1.5e-2), (3e-2, 4e-2),
            (1e-1, 1.5e-1), (2e-1, 2.8e-1)]
RATIOS: list[dict[str, Any]] = []


def capture_ratios() -> None:
    """Wraps TRL's GRPOTrainer._compute_loss to record each row's sequence log ratio against
    the generation-time log-probabilities, and its advantage."""
    import trl

    original = trl.GRPOTrainer._compute_loss

    def compute_loss(self, model, inputs):
        seen: dict[str, Any] = {}
        getter = self._get_per_token_logps_and_entropies

        def get_logps(*args, **kwargs):
            out = getter(*args, **kwargs)
            seen["logps"] = out[0].detach()
            return out

        self._get_per_token_logps_and_entropies = get_logps
        try:
            return original(self, model, inputs)
        finally:
            del self._get_per_token_logps_and_entropies
            old = inputs.get("old_per_token_logps")
            if old is not None and "logps" in seen:
                mask = inputs["completion_mask"].float()
                seq = ((seen["logps"] - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
                RATIOS.append({"step": self.state.global_step + 1,
                               "log_ratio": [round(x, 6) for x in seq.float().tolist()],
                               "advantage": [round(x, 4) for x in
                                             inputs["advantages"].view(-1).float().tolist()]})

    trl.GRPOTrainer._compute_loss = compute_loss


def clip_ratio(records: list[dict[str, Any]], low: float, high: float) -> float:
    rows = [(r, a) for record in records for r, a in zip(record["log_ratio"],
                                                          record["advantage"])]
    clipped = sum(1 for r, a in rows
                  if (a < 0 and r < math.log(1 - low)) or (a > 0 and r > math.log(1 + high)))
    return clipped / len(rows) if rows else float("nan")


def ratio_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    summary = {}
    for step, found in sorted(by_step.items()):
        ratios = sorted(abs(r) for record in found for r in record["log_ratio"])
        summary[step] = {
            "rows": len(ratios),
            "abs_log_ratio_median": ratios[len(ratios) // 2] if ratios else None,
            "abs_log_ratio_max": ratios[-1] if ratios else None,
            "nonzero_advantage": sum(1 for record in found for a in record["advantage"] if a),
            "clip_ratio_by_epsilon": {f"{low:g}/{high:g}": round(clip_ratio(found, low, high), 3)
                                      for low, high in EPSILONS},
        }
    return summary


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    from test_stages_gpu import set_params

    raw = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        set_params(raw, dotted, value)
    return raw


def run_candidate(raw: dict[str, Any], train_set: Path, work: Path, name: str,
                  sft_out: Path | None = None) -> dict[str, Any]:
    """SFT (unless `sft_out` is given) and GSPO from its adapter; the per-step log and ratios."""
    import torch

    from vlmrl.params import Params
    from vlmrl.training.sft import run_sft
    from vlmrl.training.gspo import train

    params = Params(raw)
    result: dict[str, Any] = {"name": name}
    started = time.perf_counter()
    if sft_out is None:
        sft_out = work / f"sft-{name}"
        sft = run_sft(train_set=train_set, params=params, out=sft_out)
        result["sft_losses"] = [round(row["loss"], 4) for row in sft["log"] if "loss" in row]
        result["sft_seconds"] = round(time.perf_counter() - started, 1)
    del RATIOS[:]
    started = time.perf_counter()
    trained = train(train_set=train_set, params=params, adapter_out=work / f"adapter-{name}",
                    checkpoints=work / f"checkpoints-{name}", sft_out=sft_out)
    result["gspo_seconds"] = round(time.perf_counter() - started, 1)
    result["steps"] = [{"step": row["step"], **{k: row[k] for k in STEP_KEYS if k in row}}
                       for row in trained.log_rows if "loss" in row]
    result["ratios"] = ratio_summary(RATIOS)
    result["raw_ratios"] = list(RATIOS)
    result["sft_out"] = str(sft_out)
    gc.collect()
    torch.cuda.empty_cache()
    return result


def print_candidate(result: dict[str, Any]) -> None:
    print(f"== {result['name']}: sft losses {result.get('sft_losses')}", flush=True)
    for row in result["steps"]:
        print("   " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in row.items()), flush=True)
    for step, found in result["ratios"].items():
        print(f"   ratios step {step}: {json.dumps(found)}", flush=True)


def parse_value(text: str) -> Any:
    """A number where `text` is one (YAML reads `5e-5` as a string), else YAML's reading."""
    import yaml

    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        return yaml.safe_load(text)


def sft_overrides(item: str) -> dict[str, Any]:
    """`lr:steps[:scheduler]` as sft.args overrides."""
    lr, steps, *scheduler = item.split(":")
    overrides: dict[str, Any] = {"sft.args.learning_rate": float(lr),
                                 "sft.args.max_steps": int(steps)}
    if scheduler:
        overrides["sft.args.lr_scheduler_type"] = scheduler[0]
    return overrides


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="transformers-bf16")
    parser.add_argument("--sft", default="5e-3:12", help="lr:steps[:scheduler] candidates (scheduler: sft.args.lr_scheduler_type, "
                             "default the tests'), comma-separated")
    parser.add_argument("--gspo", default="", help="extra train.grpo overrides, key=value,...")
    parser.add_argument("--gspo-lrs", default="",
                        help="GSPO learning rates to try from the first candidate's SFT adapter")
    parser.add_argument("--repeat", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gspo-probe"))
    args = parser.parse_args()

    import torch
    import yaml
    from test_stages_gpu import CONFIGS, MODEL, SMALL

    from vlmrl.data.prepare import load_raw_records, prepare, to_dataset
    from vlmrl.models.embedded import ensure_embedded_model
    from vlmrl.params import Params

    started = time.perf_counter()
    ensure_embedded_model(MODEL, seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    torch.cuda.empty_cache()
    gspo = {f"train.grpo.{k}": parse_value(v) for k, v in
            (item.split("=", 1) for item in args.gspo.split(",") if item)}
    raw = with_overrides(yaml.safe_load((ROOT / "params.yaml").read_text()),
                         {**SMALL, **CONFIGS[args.config], "train.grpo.log_completions": False,
                          **gspo})
    settings = Params(raw).data
    train_set = args.work / "train"
    to_dataset(prepare(load_raw_records(settings), settings).train).save_to_disk(str(train_set))
    print(f"setup {time.perf_counter() - started:.0f} s", flush=True)
    capture_ratios()

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"device": device, "config": args.config,
                              "gspo_overrides": gspo, "candidates": []}
    for item in args.sft.split(","):
        candidate = with_overrides(raw, sft_overrides(item))
        name = "lr{}-steps{}{}".format(*item.split(":")[:2],
                                      "".join(f"-{x}" for x in item.split(":")[2:]))
        result = run_candidate(candidate, train_set, args.work, name)
        print_candidate(result)
        report["candidates"].append(result)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    first = report["candidates"][0]
    candidate = with_overrides(raw, sft_overrides(args.sft.split(",")[0]))
    for gspo_lr in [float(x) for x in args.gspo_lrs.split(",") if x]:
        result = run_candidate(with_overrides(candidate, {"train.grpo.learning_rate": gspo_lr}),
                               train_set, args.work, f"{first['name']}-gspo-lr{gspo_lr:g}",
                               sft_out=Path(first["sft_out"]))
        print_candidate(result)
        report["candidates"].append(result)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.repeat:
        again_sft = run_candidate(candidate, train_set, args.work, first["name"] + "-again")
        again_gspo = run_candidate(candidate, train_set, args.work, first["name"] + "-gspo-again",
                                   sft_out=Path(first["sft_out"]))
        for result in (again_sft, again_gspo):
            print_candidate(result)
        report["repeat"] = {"sft_and_gspo": again_sft, "gspo_from_first_sft": again_gspo}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
