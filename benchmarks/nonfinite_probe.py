"""Where does a GSPO run first go non-finite? (The case it was written for: transformers bf16 on
data seed 7 logged `grad_norm: nan` at step 3 and then died in a CUDA assert; what it found is in
docs/benchmarks-history.md.) For one seed, a plain copy of the
project runs prepare_data and sft_cold_start as dvc.yaml says, then train_gspo in this process
with every module's forward output checked for NaN or infinity, autograd's anomaly mode naming
the first backward function that returns NaN, and per step: the log row and the largest absolute
LoRA weight. Nothing is fixed here; the JSON says what was
seen first.

    python benchmarks/nonfinite_probe.py --seed 7 --set model.dtype=bfloat16 --out probe.json
    tests/gpu/run_on_device.sh nonfinite --seed 7        # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from doc_blocks import render_results
from learning import SEED_KEYS, parse_override, run_without_dvc, write_doc_block
from project_repo import copy_project

MAX_EVENTS = 20


class Probe(TrainerCallback):
    """Forward hooks on every module (installed when training begins, removed at its end) and
    per-step facts."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.handles: list[Any] = []
        self.step = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_hook(self.forward_hook(name)))

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self.handles:
            handle.remove()

    def forward_hook(self, name: str):
        def hook(module, inputs, output):
            if len(self.events) >= MAX_EVENTS:
                return
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            tensor = getattr(tensor, "logits", tensor)
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                return
            if bool(torch.isfinite(tensor).all()):
                return
            finite_inputs = [t for t in inputs if isinstance(t, torch.Tensor)
                             and t.is_floating_point()]
            self.events.append({
                "step": self.step + 1, "module": name, "class": type(module).__name__,
                "grad_enabled": torch.is_grad_enabled(), "dtype": str(tensor.dtype),
                "nan": int(torch.isnan(tensor).sum()), "inf": int(torch.isinf(tensor).sum()),
                "input_max_abs": [float(t.detach().float().abs().max()) if t.numel() else None
                                  for t in finite_inputs],
            })
        return hook

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.step = state.global_step
        lora = [p.detach().float().abs().max() for n, p in model.named_parameters()
                if p.requires_grad]
        self.steps.append({"step": state.global_step,
                           "lora_max_abs": float(torch.stack(lora).max()) if lora else None})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.steps and logs:
            self.steps[-1].setdefault("log", {}).update(
                {k: v for k, v in logs.items() if isinstance(v, (int, float))})


def probe_seed(seed: int, overrides: dict[str, Any], workdir: Path) -> dict[str, Any]:
    from vlmrl.params import load_params
    from vlmrl.training.gspo import train

    repo = copy_project(workdir / f"seed-{seed}", {**dict.fromkeys(SEED_KEYS, seed),
                                                   **overrides})
    run_without_dvc(repo, stages=("prepare_data", "sft_cold_start"))
    os.chdir(repo)
    probe = Probe()
    torch.autograd.set_detect_anomaly(True, check_nan=True)
    started, error = time.perf_counter(), None
    try:
        train(train_set=Path("data/prepared/train"), params=load_params(Path("params.yaml")),
              adapter_out=Path("data/models/adapter"), checkpoints=Path("data/checkpoints/p"),
              sft_out=Path("data/models/sft"), callbacks=[probe])
    except Exception as caught:  # noqa: BLE001 - what the probe looks for: reported, not raised
        error = {"type": type(caught).__name__, "message": str(caught)[:4000],
                 "traceback": traceback.format_exc()[-6000:]}
    finally:
        torch.autograd.set_detect_anomaly(False)
        os.chdir(ROOT)
    return {"seed": seed, "seconds": round(time.perf_counter() - started, 1),
            "first_nonfinite_forward": probe.events[:1], "forward_events": probe.events,
            "backward_error": error, "steps": probe.steps}


def render(results: dict[str, Any]) -> str:
    """One row per probed seed: what went non-finite first, forward or backward, and where."""
    lines = [(f"Probed {results['date']} on {results['device']}; overrides: "
              f"{results['overrides'] or 'none'}. Written by `benchmarks/nonfinite_probe.py`."),
             "",
             ("| seed | GSPO steps completed | first non-finite forward output | first backward "
              "function returning NaN (autograd anomaly mode) | largest LoRA weight | seconds |"),
             "| --- | ---: | --- | --- | ---: | ---: |"]
    for run in results["runs"]:
        forward = run["first_nonfinite_forward"]
        forward_text = (f"step {forward[0]['step']}: `{forward[0]['module']}`" if forward
                        else "none")
        error = run["backward_error"]
        steps = run["steps"]
        backward = (f"step {len(steps) + 1}: {error['message'].splitlines()[0]}" if error
                    else "none")
        largest = max((s["lora_max_abs"] for s in steps if s["lora_max_abs"] is not None),
                      default=float("nan"))
        lines.append(f"| {run['seed']} | {len(steps)} | {forward_text} | {backward} "
                     f"| {largest:.4f} | {run['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, nargs="+", default=[7])
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/nonfinite_probe.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument("--from-json", type=Path, metavar="RESULTS",
                        help="probe nothing: write the table of a results file into --doc")
    args = parser.parse_args()
    if args.from_json is not None:
        write_doc_block(args.doc, render_results(args.from_json, render), ":nonfinite")
        return
    overrides = dict(parse_override(text) for text in args.overrides)
    results = []
    with tempfile.TemporaryDirectory(prefix="vlmrl-probe-") as tmp:
        for seed in args.seed:
            results.append(probe_seed(seed, overrides, Path(tmp)))
            print(json.dumps(results[-1], indent=1)[:6000], flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": device,
                                    "overrides": overrides, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
