"""The reference notebook's LoRA check compared a fraction with an element count, so it passed
whatever the adapter held. An untrained adapter (every `lora_B` still zero) is the mistake that
check was meant to catch: it loads, runs and evaluates exactly like the base model. So the adapter
is loaded onto the base model the way every later stage loads it, and checked from what PEFT
actually built there (a key that matched no module leaves that module's `lora_B` at its zero
init), from its config against params.yaml, and by its effect on the logits of a fixed input."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer

from vlmrl.models.forward import adapter_and_base_logits, first_eval_row, question_inputs
from vlmrl.models.loading import load_model
from vlmrl.models.merged_weights import check_adapter_weights
from vlmrl.models.processor import has_vision
from vlmrl.params import LoraParams, ModelParams
from vlmrl.reporting.checks import Check

MODULE_GROUPS = ("q", "k", "v", "o", "gate", "up", "down")
LANGUAGE_MODEL_MARK = ".language_model."
TEXT_LAYERS_MARK = ".layers."


@dataclass(frozen=True)
class LoraModule:
    """One adapted module as PEFT built it on the base model."""

    name: str
    lora_a: Any  # torch.Tensor, (r, in_features)
    lora_b: Any  # torch.Tensor, (out_features, r)
    scaling: float

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def group(self) -> str:
        return self.leaf.removesuffix("_proj")


@dataclass
class VerifyReport:
    adapter: str
    checks: list[Check]
    tensors: dict[str, int]
    groups: dict[str, dict[str, float]]
    logit_delta: dict[str, float]
    adapter_config: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checks_failed": len(self.failed),
            "adapter": self.adapter,
            "checks": {c.name: {"passed": c.passed, "detail": c.detail} for c in self.checks},
            "tensors": self.tensors,
            "groups": self.groups,
            "logit_delta": self.logit_delta,
            "adapter_config": self.adapter_config,
        }

    def failure_message(self) -> str:
        failed = self.failed
        lines = [f"LoRA adapter {self.adapter} failed {len(failed)} of {len(self.checks)} checks:"]
        lines += [f"  - {check.name}: {check.detail}" for check in failed]
        return "\n".join(lines)


# ---------------------------------------------------------------------- checks


def lora_modules(model) -> list[LoraModule]:
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter_name in module.active_adapters:
            if adapter_name not in module.lora_A:
                continue
            found.append(LoraModule(
                name=name.removeprefix("base_model.model."),
                lora_a=module.lora_A[adapter_name].weight.detach().float().cpu(),
                lora_b=module.lora_B[adapter_name].weight.detach().float().cpu(),
                scaling=float(module.scaling[adapter_name]),
            ))
    return found


def check_lora_b_nonzero(modules: list[LoraModule]) -> Check:
    if not modules:
        return Check("lora_b_nonzero", False, "the adapter adapted no module at all")
    zero = [m.name + ".lora_B" for m in modules if int(torch.count_nonzero(m.lora_b)) == 0]
    if zero:
        return Check("lora_b_nonzero", False,
                     f"{len(zero)} of {len(modules)} lora_B matrices are all zero (untrained "
                     "or not loaded): " + ", ".join(zero))
    return Check("lora_b_nonzero", True, f"all {len(modules)} lora_B matrices are non-zero")


def check_rank(config: Mapping[str, Any], modules: list[LoraModule], spec: LoraParams) -> Check:
    problems = []
    if config.get("r") != spec.r:
        problems.append(f"adapter_config r={config.get('r')}, params train.lora.r={spec.r}")
    if config.get("rank_pattern"):
        problems.append(f"adapter_config has a rank_pattern {config['rank_pattern']}")
    wrong = sorted({m.lora_a.shape[0] for m in modules if m.lora_a.shape[0] != spec.r})
    if wrong:
        problems.append(f"lora_A matrices of rank {wrong} where params say {spec.r}")
    return _check("rank", problems, f"r={spec.r}")


def check_alpha(config: Mapping[str, Any], spec: LoraParams) -> Check:
    problems = []
    alpha = config.get("lora_alpha")
    if alpha is None or not math.isclose(float(alpha), spec.alpha):
        problems.append(f"adapter_config lora_alpha={alpha}, "
                        f"params train.lora.alpha={float(spec.alpha)}")
    if config.get("alpha_pattern"):
        problems.append(f"adapter_config has an alpha_pattern {config['alpha_pattern']}")
    return _check("alpha", problems, f"alpha={spec.alpha:g}")


def check_dropout(config: Mapping[str, Any], spec: LoraParams) -> Check:
    dropout = config.get("lora_dropout")
    if dropout is None or not math.isclose(float(dropout), spec.dropout):
        return Check("dropout", False, f"adapter_config lora_dropout={dropout}, "
                                       f"params train.lora.dropout={spec.dropout}")
    return Check("dropout", True, f"dropout={spec.dropout:g}")


def check_target_modules(config: Mapping[str, Any], modules: list[LoraModule],
                         spec: LoraParams) -> Check:
    """What was adapted must be what params name. A regex in adapter_config (Unsloth writes one)
    is judged by the modules it matched."""
    wanted = set(spec.target_modules)
    problems = []
    configured = config.get("target_modules")
    if isinstance(configured, list) and set(configured) != wanted:
        problems.append(f"adapter_config target_modules {sorted(configured)} != params "
                        f"{sorted(wanted)}")
    adapted = {m.leaf for m in modules}
    if adapted != wanted:
        missing, extra = sorted(wanted - adapted), sorted(adapted - wanted)
        problems.append(f"adapted modules differ from params: missing {missing}, extra {extra}")
    return _check("target_modules", problems, f"adapted {sorted(adapted)}")


def check_language_model_only(modules: list[LoraModule], vision: bool = True) -> Check:
    """A vision-language model's adapter stays in `.language_model.`; a text model's in its
    decoder layers (never the embedding or the head)."""
    mark = LANGUAGE_MODEL_MARK if vision else TEXT_LAYERS_MARK
    outside = [m.name for m in modules if mark not in f".{m.name}"]
    if outside:
        return Check("language_model_only", False,
                     f"{len(outside)} adapted modules lie outside the language model (vision "
                     "tower or head): " + ", ".join(outside[:20])
                     + (" ..." if len(outside) > 20 else ""))
    return Check("language_model_only", True,
                 f"all {len(modules)} adapted modules are in the language model")


def check_logit_delta(delta: Mapping[str, float], tolerance: float) -> Check:
    moved = delta["max_abs"]
    if not math.isfinite(moved):
        return Check("logit_delta", False, f"the adapter's logits are not finite ({moved})")
    if moved <= tolerance:
        return Check("logit_delta", False,
                     f"the adapter changes the logits of the fixed image+question by at most "
                     f"{moved:.3g}, not more than verify.logit_tolerance={tolerance:g}: it does "
                     "nothing")
    return Check("logit_delta", True, f"max |delta logit| {moved:.3g} > {tolerance:g}")


def _check(name: str, problems: list[str], ok_detail: str) -> Check:
    return Check(name, not problems, "; ".join(problems) if problems else ok_detail)


# --------------------------------------------------------------------- figures


def tensor_counts(modules: list[LoraModule]) -> dict[str, int]:
    return {
        "adapted_modules": len(modules),
        "lora_A": len(modules),
        "lora_B": len(modules),
        "zero_lora_B": sum(int(torch.count_nonzero(m.lora_b)) == 0 for m in modules),
        "parameters": sum(m.lora_a.numel() + m.lora_b.numel() for m in modules),
    }


def group_norms(modules: list[LoraModule]) -> dict[str, dict[str, float]]:
    """Frobenius norms per projection group, summed in quadrature over layers; `delta_w` is the
    norm of scaling * B @ A, the change the adapter makes to the weights."""
    sums: dict[str, dict[str, float]] = {}
    for module in modules:
        group = sums.setdefault(module.group, {"modules": 0, "lora_A": 0.0, "lora_B": 0.0,
                                               "delta_w": 0.0})
        group["modules"] += 1
        group["lora_A"] += float(module.lora_a.pow(2).sum())
        group["lora_B"] += float(module.lora_b.pow(2).sum())
        group["delta_w"] += module.scaling ** 2 * delta_w_squared_norm(module)
    ordered = sorted(sums, key=lambda g: (MODULE_GROUPS.index(g) if g in MODULE_GROUPS else 99, g))
    return {name: {"modules": sums[name]["modules"],
                   **{key: math.sqrt(sums[name][key]) for key in ("lora_A", "lora_B", "delta_w")}}
            for name in ordered}


def delta_w_squared_norm(module: LoraModule) -> float:
    """||B A||_F^2 = trace((B^T B)(A A^T)): r x r products instead of the full weight."""
    a, b = module.lora_a.double(), module.lora_b.double()
    return float(((b.T @ b) * (a @ a.T)).sum())


def logit_delta(base, adapted) -> dict[str, float]:
    diff = (adapted - base).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "positions": int(diff.shape[-2]), "vocab": int(diff.shape[-1])}


# ------------------------------------------------------------------ the check


def read_adapter_config(adapter: Path) -> dict[str, Any]:
    path = Path(adapter) / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{adapter}: no LoRA adapter (adapter_config.json) there; the "
                                "train_gspo stage makes it (dvc repro train_gspo)")
    return json.loads(path.read_text(encoding="utf-8"))


def verify_adapter(model_settings: ModelParams, adapter: Path | str, eval_set: Path | str,
                   spec: LoraParams, logit_tolerance: float) -> VerifyReport:
    """Loads the base model with the adapter and runs every check; raises only when something
    cannot be loaded at all, failed checks are in the report."""
    adapter = Path(adapter)
    config = read_adapter_config(adapter)
    check_adapter_weights(adapter)  # before the model: a corrupt file is one line, not a traceback
    row = first_eval_row(eval_set)
    model, processor, _backend = load_model(model_settings, adapter=adapter)
    adapted_logits, base_logits = adapter_and_base_logits(model,
                                                          question_inputs(processor, row))
    modules = lora_modules(model)
    delta = logit_delta(base_logits, adapted_logits)
    checks = [
        check_lora_b_nonzero(modules),
        check_rank(config, modules, spec),
        check_alpha(config, spec),
        check_dropout(config, spec),
        check_target_modules(config, modules, spec),
        check_language_model_only(modules, has_vision(processor)),
        check_logit_delta(delta, logit_tolerance),
    ]
    return VerifyReport(
        adapter=str(adapter), checks=checks, tensors=tensor_counts(modules),
        groups=group_norms(modules), logit_delta=delta | {"tolerance": logit_tolerance},
        adapter_config={key: config.get(key) for key in (
            "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "peft_version")},
    )


def report_summary(report: VerifyReport) -> str:
    lines = [f"{'PASS' if c.passed else 'FAIL'} {c.name}: {c.detail}" for c in report.checks]
    lines.append(f"tensors: {report.tensors}")
    lines.append("norms per group: " + ", ".join(
        f"{g}: B={v['lora_B']:.3g} dW={v['delta_w']:.3g}" for g, v in report.groups.items()))
    lines.append(f"logit delta: max {report.logit_delta['max_abs']:.3g}, "
                 f"mean {report.logit_delta['mean_abs']:.3g}")
    return "\n".join(lines)

