"""Time the export stage step by step: merge, reload, each GGUF conversion, quantization and
the checks.

The export runs after every training run and its converter calls dominate it, so this shows
where the time goes (wall and CPU seconds, the converter subprocesses included) and the figures
the checks produced. Without --adapter it makes an adapter with random lora_B on the model of
params.yaml (`train.lora`), so it runs on a fresh checkout; without a prepared eval set it
prepares one from params.yaml `data`.

Usage: python benchmarks/export_time.py [--params params.yaml] [--adapter DIR] [--eval-set DIR]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from vlmrl.export.exporter import run_export
from vlmrl.params import Params, load_params


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def random_adapter(params: Params, out: Path) -> Path:
    import peft
    import torch

    from vlmrl.models.embedded import resolve_model_path
    from vlmrl.models.loading import load_transformers_model

    settings, lora = params.model, params.train.lora
    model = load_transformers_model(resolve_model_path(settings), settings)
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules),
                             exclude_modules=r".*\.visual\..*", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    model.save_pretrained(out)
    return out


def prepared_eval_set(params: Params, out: Path) -> Path:
    from vlmrl.data.prepare import load_raw_records, prepare, to_dataset

    settings = params.data
    to_dataset(prepare(load_raw_records(settings), settings).eval).save_to_disk(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--eval-set", type=Path, default=Path("data/prepared/eval"))
    args = parser.parse_args()

    params = load_params(args.params)
    with tempfile.TemporaryDirectory(prefix="export-bench-") as scratch:
        scratch = Path(scratch)
        adapter = args.adapter or random_adapter(params, scratch / "adapter")
        eval_set = (args.eval_set if (args.eval_set / "dataset_info.json").is_file()
                    else prepared_eval_set(params, scratch / "eval"))
        wall, cpu = time.perf_counter(), cpu_seconds()
        metrics = run_export(params=params, adapter=adapter, eval_set=eval_set,
                             merged_out=scratch / "merged", gguf_out=scratch / "gguf",
                             show_progress=False)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu

    print(f"model {params.model.name}, export dtype {params.export.dtype}")
    print(f"{'step':<40} {'seconds':>9}")
    for name, seconds in metrics["timings_s"].items():
        print(f"{name:<40} {seconds:>9.2f}")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s (converter subprocesses included)")
    print("\nfile sizes:")
    for name, size in metrics["files"].items():
        if name.endswith((".gguf", ".safetensors")):
            print(f"  {Path(name).name:<28} {size / 2**20:>9.1f} MiB")
    print("\nmax |logit difference|:")
    for name, value in metrics["logit_max_abs_diff"].items():
        print(f"  {name:<28} {value:>11.3g}")
    print(f"  (f16 tolerance {metrics['tolerances']['gguf_f16_vs_merged']:.3g})")


if __name__ == "__main__":
    main()
