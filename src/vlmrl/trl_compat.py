"""TRL 1.15's GRPOTrainer always computes per-token log-probabilities through a Triton kernel
(`trl.kernels.ChunkedLogProbFunction`), and Triton only ships with CUDA builds of torch. Where
Triton is missing, a plain-torch function with the same call signature and outputs takes its
place, chunked over tokens so the [tokens, vocab] logits never exist all at once. The other
adaptations here are for speed and memory on a GPU: compiled decoding (which TRL switches off) and
generation in chunks of rows (TRL generates a whole generation batch at once). `step_log_rows`
flattens a trainer's log history (GRPOTrainer's and SFTTrainer's) into rows for DVC plots;
`live_log` writes them at every logging step, so a long run can be watched (issue 24), and
`completions_table_to` sends TRL's sample completions table to a file instead of stdout."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from vlmrl.outputs import write_json_atomic

TOKEN_CHUNK = 256


class TorchChunkedLogProb:
    """Same contract as trl.kernels.ChunkedLogProbFunction.apply. Without logit soft-capping it
    runs `_fused_log_prob_function`: per chunk of tokens one matmul and a log-sum-exp forward, and
    in backward the logits only (kept up to 1 GiB, recomputed beyond), so no log-softmax, softmax
    or entropy graph over [tokens, vocab] is kept for autograd: with
    the 151,936-token vocabulary the passes over those tensors cost more than the matmul
    (`python benchmarks/cpu_kernels.py`)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        if final_logit_softcapping is not None:
            return _autograd_outputs(hidden, weight, bias, targets, temperature,
                                     final_logit_softcapping, logit_scale, outputs)
        extras = tuple(name for name in EXTRA_OUTPUTS if name in outputs)
        log_probs, entropy, *rest = _fused_log_prob_function().apply(
            hidden, weight, bias, targets, logit_scale / temperature, "entropy" in outputs,
            extras)
        named = dict(zip(extras, rest))
        return (log_probs, entropy if "entropy" in outputs else None,
                *(named.get(name) for name in EXTRA_OUTPUTS))


EXTRA_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")
KEEP_LOGITS_BYTES = 1 << 30


@functools.cache
def _fused_log_prob_function():
    """The autograd.Function, built on first use: this module imports no torch at import."""
    import torch

    def chunk_logits(hidden, weight, bias, scale):
        logits = torch.nn.functional.linear(hidden.float(), weight.float(),
                                            None if bias is None else bias.float())
        return logits.mul_(scale) if scale != 1.0 else logits

    class FusedLogProb(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, scale, with_entropy, extras):
            n = hidden.shape[0]
            log_probs = hidden.new_empty(n, dtype=torch.float32)
            lse = hidden.new_empty(n, dtype=torch.float32)
            entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
            extra = {name: hidden.new_empty(n, dtype=torch.bool if name == "is_top1" else torch.float32)
                     for name in extras}
            # Kept for backward where they fit (recomputing them costs a matmul), else recomputed
            keep = any(ctx.needs_input_grad[:3]) and n * weight.shape[0] * 4 <= KEEP_LOGITS_BYTES
            ctx.kept = [] if keep else None
            for start in range(0, n, TOKEN_CHUNK):
                part = slice(start, start + TOKEN_CHUNK)
                logits = chunk_logits(hidden[part], weight, bias, scale)
                if keep:
                    ctx.kept.append(logits)
                chunk_lse = torch.logsumexp(logits, -1)
                lse[part] = chunk_lse
                log_probs[part] = logits.gather(-1, targets[part, None]).squeeze(-1) - chunk_lse
                if "mean_logits" in extra:
                    extra["mean_logits"][part] = logits.mean(-1)
                if "is_top1" in extra:
                    extra["is_top1"][part] = logits.argmax(-1) == targets[part]
                if "log_sum_sq_probs" in extra:
                    extra["log_sum_sq_probs"][part] = torch.logsumexp(2 * logits, -1) - 2 * chunk_lse
                if with_entropy:  # H = lse - sum(p * logits)
                    probs = (logits - chunk_lse[:, None]).exp_()
                    entropy[part] = chunk_lse - torch.linalg.vecdot(probs, logits)
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
            ctx.scale = scale
            for value in extra.values():
                ctx.mark_non_differentiable(value)
            return (log_probs, entropy, *extra.values())

        @staticmethod
        def backward(ctx, grad_log_probs, grad_entropy, *_):
            hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
            need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
            grad_hidden = torch.zeros_like(hidden) if need_hidden else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
            kept, ctx.kept = ctx.kept, None  # used up in place: a second backward recomputes
            for index, start in enumerate(range(0, hidden.shape[0], TOKEN_CHUNK)):
                part = slice(start, start + TOKEN_CHUNK)
                logits = (kept[index] if kept is not None
                          else chunk_logits(hidden[part], weight, bias, ctx.scale))
                log_p = logits.sub_(lse[part, None])  # in place: the logits are not needed again
                probs = log_p.exp()
                g_lp = (grad_log_probs[part, None] if grad_log_probs is not None
                        else log_p.new_zeros(()))
                if grad_entropy is not None and entropy.numel():
                    # d lp/dz = onehot - p;  dH/dz = -p (log p + H):  grad = -p (g_lp + g_H (log p + H))
                    weight_of_p = log_p.add_(entropy[part, None]).mul_(grad_entropy[part, None])
                    grad = probs.mul_(weight_of_p.add_(g_lp)).neg_()
                else:
                    grad = probs.mul_(g_lp).neg_()
                if grad_log_probs is not None:
                    grad.scatter_add_(-1, targets[part, None], grad_log_probs[part, None])
                if ctx.scale != 1.0:
                    grad.mul_(ctx.scale)
                if need_hidden:
                    grad_hidden[part] = (grad @ weight.float()).to(hidden.dtype)
                if need_weight:
                    grad_weight.addmm_(grad.T, hidden[part].float())
                if need_bias:
                    grad_bias.add_(grad.sum(0))
            return (grad_hidden,
                    None if grad_weight is None else grad_weight.to(weight.dtype),
                    None if grad_bias is None else grad_bias.to(bias.dtype),
                    None, None, None, None)

    return FusedLogProb


def _autograd_outputs(hidden, weight, bias, targets, temperature, final_logit_softcapping,
                      logit_scale, outputs):
    """The plain-autograd version, for soft-capped logits (Gemma-style)."""
    import torch

    parts = [_chunk_outputs(hidden[start:start + TOKEN_CHUNK], weight, bias,
                            targets[start:start + TOKEN_CHUNK], temperature,
                            final_logit_softcapping, logit_scale, outputs)
             for start in range(0, hidden.shape[0], TOKEN_CHUNK)]
    if not parts:
        empty = hidden.new_zeros((0,), dtype=torch.float32) + hidden.sum() * 0
        parts = [(empty, *(empty.detach() if name in outputs else None
                           for name in ("entropy", "log_sum_sq_probs", "mean_logits",
                                        "is_top1")))]
    return tuple(None if part[0] is None else torch.cat(part) for part in zip(*parts))


def _chunk_outputs(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    import torch

    logits = torch.nn.functional.linear(hidden, weight, bias).float() * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    target_log_probs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = (-(log_probs.exp() * log_probs).sum(-1)) if "entropy" in outputs else None
    with torch.no_grad():
        log_sum_sq = (torch.logsumexp(2 * log_probs, dim=-1)
                      if "log_sum_sq_probs" in outputs else None)
        mean_logits = logits.mean(-1) if "mean_logits" in outputs else None
        is_top1 = (logits.argmax(-1) == targets) if "is_top1" in outputs else None
    return target_log_probs, entropy, log_sum_sq, mean_logits, is_top1


def install_cpu_fallback() -> bool:
    """Puts the torch version in place when Triton is missing, or when there is no GPU for its
    kernel (a CUDA build of torch ships Triton, and on a machine without a GPU the kernel fails
    with "0 active drivers"); True if it did."""
    import torch
    import trl.trainer.utils as trl_utils

    kernel = trl_utils._ChunkedLogProbFunction
    if kernel is TorchChunkedLogProb or (kernel is not None and torch.cuda.is_available()):
        return False
    trl_utils._ChunkedLogProbFunction = TorchChunkedLogProb
    return True


def enable_compiled_generation(trainer) -> None:
    """TRL builds its generation config with `disable_compile=True`; a static KV cache only pays
    off with compiled decoding. transformers 5.17 also never compiles a bitsandbytes 4-bit model,
    although compiling it works with bitsandbytes 0.50 (measured: benchmarks/gspo_step.py)."""
    trainer.generation_config.disable_compile = False
    allow_compiling_bnb_4bit()


# The versions the bitsandbytes compile patch was measured with (benchmarks/gspo_step.py): a
# later transformers may compile 4-bit models itself, or break in ways the patch would hide.
BNB_PATCH_VERSIONS = {"transformers": "5.17", "bitsandbytes": "0.50"}


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def allow_compiling_bnb_4bit(versions: Mapping[str, str | None] | None = None) -> bool:
    """Lets transformers compile a bitsandbytes 4-bit model's decoding, only under the versions
    of BNB_PATCH_VERSIONS (warns and leaves transformers alone otherwise); True if patched.
    `versions` (package -> installed version or None) defaults to what is installed."""
    from importlib.metadata import PackageNotFoundError, version

    if versions is None:
        versions = {}
        for package in BNB_PATCH_VERSIONS:
            try:
                versions[package] = version(package)
            except PackageNotFoundError:
                versions[package] = None
    if versions.get("bitsandbytes") is None:
        return False  # no 4-bit model can exist: nothing to patch
    mismatched = {package: found for package, found in versions.items()
                  if found is None or _major_minor(found) != BNB_PATCH_VERSIONS[package]}
    if mismatched:
        warnings.warn(
            f"not letting transformers compile bitsandbytes 4-bit decoding: the patch was "
            f"written for {BNB_PATCH_VERSIONS}, found {dict(versions)}; 4-bit decoding runs "
            "uncompiled (slower, still correct)", stacklevel=2)
        return False
    try:
        from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    except ImportError:
        return False
    Bnb4BitHfQuantizer.is_compileable = property(lambda self: True)
    return True


def limit_generation_rows(trainer, rows: int) -> None:
    """TRL generates a whole generation batch (per_device_train_batch_size x
    steps_per_generation rows) in one `generate` call, so a static KV cache is sized for all of
    it. Generating it `rows` at a time keeps the cache, and the memory, to one chunk's size,
    while one batch can still serve several optimizer steps (GSPO's off-policy updates)."""
    original = trainer._generate_single_turn
    announced = False

    def generate_in_chunks(prompt_ids, images, multimodal_fields, num_generations,
                           has_tool_images=False):
        nonlocal announced
        if len(prompt_ids) <= rows:
            return original(prompt_ids, images, multimodal_fields, num_generations,
                            has_tool_images)
        if not announced:
            print(f"generating {len(prompt_ids)} rows per generation batch in chunks of {rows}")
            announced = True
        completion_ids: list = []
        logprobs: list | None = []
        for chunk_ids, chunk_images, chunk_fields in split_generation_inputs(
                prompt_ids, images, multimodal_fields, rows):
            ids, chunk_logprobs = original(chunk_ids, chunk_images, chunk_fields,
                                           num_generations, has_tool_images)
            completion_ids += ids
            logprobs = None if chunk_logprobs is None or logprobs is None else (
                logprobs + list(chunk_logprobs))
        return completion_ids, logprobs

    trainer._generate_single_turn = generate_in_chunks


def split_generation_inputs(prompt_ids: list, images: list | None, fields: dict, rows: int):
    """Yields (prompt_ids, images, multimodal fields) for each run of `rows` prompts. Qwen-VL
    processors flatten every image's patches into one `pixel_values` and give each image a row of
    `image_grid_thw` (t x h x w patches); per-prompt fields are lists with one entry per prompt."""
    count = len(prompt_ids)
    images_per_prompt = [len(found or []) for found in images] if images else [0] * count
    image_start = _offsets(images_per_prompt)
    grid = fields.get("image_grid_thw")
    patch_start = _offsets(grid.prod(-1).tolist() if grid is not None else [])
    for start in range(0, count, rows):
        end = min(start + rows, count)
        first_image, last_image = image_start[start], image_start[end]
        chunk = {}
        for key, value in fields.items():
            if key == "image_grid_thw":
                chunk[key] = value[first_image:last_image]
            elif key == "pixel_values" and grid is not None:
                chunk[key] = value[patch_start[first_image]:patch_start[last_image]]
            elif isinstance(value, list) and len(value) == count:
                chunk[key] = value[start:end]
            else:
                raise ValueError(
                    f"params.yaml `train.max_generation_rows`: cannot split the processor's "
                    f"`{key}` field ({type(value).__name__}) across generation chunks; only "
                    "Qwen-VL image fields and per-prompt lists can be split. Remove the param.")
        yield (prompt_ids[start:end], images[start:end] if images else images, chunk)


def _offsets(sizes: list[int]) -> list[int]:
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + int(size))
    return offsets


def step_log_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trainer log entries as flat rows for DVC plots ('clip_ratio/region_mean' ->
    'clip_ratio_region_mean')."""
    rows = []
    for entry in log_history:
        if "step" not in entry or "train_runtime" in entry:
            continue
        row = {"step": entry["step"]}
        for key, value in entry.items():
            if isinstance(value, (int, float)) and key != "step":
                row[flat_key(key)] = value
        rows.append(row)
    return rows


def flat_key(key: str) -> str:
    return key.replace("/", "_").replace("-", "_")


# ---------------------------------------------------------------- live logs

def finite_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without NaN or infinite values, which JSON and DVC's plots do not take."""
    return [{key: value for key, value in row.items()
             if not (isinstance(value, float) and not math.isfinite(value))} for row in rows]


def live_log(path: Path, rows_of: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
             on_save: Callable[[list[dict[str, Any]]], None] | None = None):
    """A trainer callback that rewrites `path` (a JSON list of rows, which `dvc plots` reads;
    it reads no JSON lines) with every row so far at each logging step, and calls `on_save`
    with them at each checkpoint save. A resumed run's history comes back with its checkpoint,
    so the file always holds the whole run."""
    from transformers import TrainerCallback  # lazily: this module must import without torch

    class LiveLog(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write_json_atomic(path, rows_of(state.log_history))

        def on_save(self, args, state, control, **kwargs):
            if on_save is not None and state.is_world_process_zero:
                on_save(rows_of(state.log_history))

    return LiveLog()


@contextlib.contextmanager
def completions_table_to(path: Path) -> Iterator[None]:
    """With `log_completions`, GRPOTrainer prints a rich table of sample completions to stdout
    at every logging step, burying the stage's own lines; within this block it is appended to
    `path` instead (created at once, so the declared output exists even with the option off)."""
    from trl.trainer import grpo_trainer

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("Sample completions of each logging step (train.grpo.log_completions, "
                    "num_completions_to_print)\n", encoding="utf-8")
    original = grpo_trainer.print_prompt_completions_sample

    def to_file(*args: Any, **kwargs: Any) -> None:
        with path.open("a", encoding="utf-8") as handle, contextlib.redirect_stdout(handle):
            original(*args, **kwargs)

    grpo_trainer.print_prompt_completions_sample = to_file
    try:
        yield
    finally:
        grpo_trainer.print_prompt_completions_sample = original
