"""Evaluation of the base model (baseline_eval) and of the trained adapter (post_eval).

Both stages go through this one module, so the before/after comparison differs only in the
adapter: the same prompts, the same decoding settings, and the same reward functions and scorer
that training optimised (`vlmrl.rewards.functions.score_completion`). A number in the report therefore
means exactly what the reward meant during GSPO.

Deliberate choices:
- Inputs are checked before the model is loaded: a missing eval set or adapter should cost a
  second, not a model load, and the error names the stage that makes it.
- A response that breaks the scorer is scored wrong (with `score_error` recorded), never a
  crash: a policy that learned to emit garbage must show up in the metrics, not kill the stage.
- Throughput counts generation only (not model loading or scoring), and generated tokens stop at
  the first EOS, so padding of finished rows in a batch does not inflate tokens per second.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import load_from_disk
from tqdm.auto import tqdm

from vlmrl.distributed.data_parallel import gather_lists, start_processes
from vlmrl.distributed.launch import evaluation_processes
from vlmrl.errors import UserError
from vlmrl.models.backend import model_device
from vlmrl.models.loading import load_model
from vlmrl.models.merged_weights import check_adapter
from vlmrl.models.processor import (
    has_vision,
    model_inputs,
    render_chat,
    suppressed_generation_kwargs,
    tokenizer_of,
)
from vlmrl.models.sampling import sampling_kwargs, top_k_settings
from vlmrl.params import EvalParams, ModelParams, RewardsParams
from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat
from vlmrl.rewards.functions import build_rewards, reward_label, score_completion

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
REQUIRED_COLUMNS = ("pid", "prompt", "image", "answer", "question_type", "answer_type")
GROUP_COLUMNS = {"answer_type": "accuracy_by_answer_type", "category": "accuracy_by_category",
                 "source": "accuracy_by_source", "tier": "accuracy_by_tier"}


class EvalError(UserError, ValueError):
    """The eval set or a prompt cannot be evaluated; the message names the record or path."""


@dataclass(frozen=True)
class Generation:
    pid: str
    text: str
    generated_tokens: int


# ------------------------------------------------------------------ generation


def render_prompt(processor, row: Mapping[str, Any]) -> str:
    """The chat-template text of a row's prompt; it must hold exactly one image placeholder for
    a row with an image and none for a text-only row, or the processor would pair the wrong
    number of images with it."""
    if row.get("image") is not None and not has_vision(processor):
        raise EvalError(f"record pid={row.get('pid')} has an image but the model is a text "
                        "model; use a vision-language model or text-only data")
    text = render_chat(processor, row["prompt"])
    count, expected = text.count(IMAGE_PLACEHOLDER), int(row.get("image") is not None)
    if count != expected:
        raise EvalError(f"record pid={row.get('pid')}: the chat template rendered {count} image "
                        f"placeholders ({IMAGE_PLACEHOLDER}), expected {expected}")
    return text


def generation_kwargs(processor, settings: EvalParams) -> dict[str, Any]:
    """Sampling with a top-k cut goes through `vlmrl.models.sampling` on a CPU and a GPU alike:
    the same distribution, drawn among k tokens with common random numbers, so baseline and post
    draw the same tokens wherever the two policies agree (transformers' own sampler would draw
    them independently on a GPU)."""
    kwargs: dict[str, Any] = {"max_new_tokens": settings.max_new_tokens,
                              "do_sample": settings.do_sample,
                              "pad_token_id": tokenizer_of(processor).pad_token_id,
                              **suppressed_generation_kwargs(processor)}
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_p=settings.top_p,
                      top_k=settings.top_k)  # 0: no top-k cut (None would mean 50)
        fast = top_k_settings(True, settings.temperature, settings.top_k, settings.top_p,
                              suppress=kwargs["suppress_tokens"])
        if fast is not None:
            kwargs.update(sampling_kwargs(fast))
    return kwargs


def eos_token_ids(model, processor) -> set[int]:
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.add(tokenizer_of(processor).eos_token_id)
    return {i for i in ids if isinstance(i, int)}


def count_generated_tokens(new_tokens, eos_ids: set[int]) -> list[int]:
    """Per row: tokens up to and including the first EOS; the whole row when there is none.
    Anything after the first EOS is padding of a finished row."""
    counts = []
    for row in new_tokens.tolist():
        first_eos = next((i for i, token in enumerate(row) if token in eos_ids), None)
        counts.append(len(row) if first_eos is None else first_eos + 1)
    return counts


def batches(rows: Sequence[Mapping[str, Any]], size: int) -> Iterator[list[Mapping[str, Any]]]:
    """Works on a list or a `datasets.Dataset` (whose images decode only when indexed)."""
    for start in range(0, len(rows), size):
        yield [rows[i] for i in range(start, min(start + size, len(rows)))]


def generate_batch(model, processor, batch: list[Mapping[str, Any]], kwargs: dict[str, Any],
                   eos_ids: set[int]) -> list[Generation]:
    texts = [render_prompt(processor, row) for row in batch]
    images = [[row["image"]] if row.get("image") is not None else [] for row in batch]
    inputs = model_inputs(processor, texts, images if any(images) else None
                          ).to(model_device(model))
    with torch.inference_mode():
        output = model.generate(**inputs, **kwargs)
    new_tokens = output[:, inputs["input_ids"].shape[1]:].cpu()
    responses = tokenizer_of(processor).batch_decode(new_tokens, skip_special_tokens=True)
    counts = count_generated_tokens(new_tokens, eos_ids)
    return [Generation(str(row["pid"]), text, count)
            for row, text, count in zip(batch, responses, counts, strict=True)]


def generate_responses(model, processor, rows: Sequence[Mapping[str, Any]],
                       settings: EvalParams, shard: tuple[int, int] = (0, 1)
                       ) -> list[Generation]:
    """One response per row, batched with left padding (generation appends on the right).
    Sampling is seeded per batch, so a batch's random draws do not depend on how long the batches
    before it ran: baseline and post draw the same numbers for the same item and token.

    `shard` (index, count) splits the batches among processes: this one generates batches index,
    index + count, ...; every process gets all of them back in batch order. The batches and their
    seeds are those of one process, so the responses are too."""
    index, count = shard
    tokenizer_of(processor).padding_side = "left"
    kwargs = generation_kwargs(processor, settings)
    eos_ids = eos_token_ids(model, processor)
    starts = list(range(0, len(rows), settings.batch_size))
    mine: list[tuple[int, list[Generation]]] = []
    with tqdm(total=sum(min(settings.batch_size, len(rows) - starts[b])
                        for b in range(index, len(starts), count)),
              desc="generating", unit="sample") as progress:
        for batch_index in range(index, len(starts), count):
            start = starts[batch_index]
            batch = [rows[i] for i in range(start, min(start + settings.batch_size, len(rows)))]
            if settings.do_sample:
                torch.manual_seed(settings.seed * 100_003 + batch_index)
            mine.append((batch_index, generate_batch(model, processor, batch, kwargs, eos_ids)))
            progress.update(len(batch))
    parts = gather_lists(mine) if count > 1 else [mine]
    ordered = sorted((part for process in parts for part in process), key=lambda part: part[0])
    return [generation for _, generations in ordered for generation in generations]


# --------------------------------------------------------------------- scoring


def score_record(row: Mapping[str, Any], generation: Generation, weights: Mapping[str, Any],
                 options: dict[str, Any], names: list[str],
                 fmt: AnswerFormat = DEFAULT_FORMAT) -> dict[str, Any]:
    record = {"pid": str(row["pid"]), "question_type": row.get("question_type"),
              "answer_type": row.get("answer_type"), "category": row.get("category"),
              "source": row.get("source"), "tier": row.get("tier"), "gold": row.get("answer"),
              "response": generation.text}
    try:
        scored = score_completion(generation.text, row, weights, options, fmt)
        record.update(gold_normalized=scored["gold"], extracted=scored["extracted"],
                      normalized=scored["normalized"], correct=bool(scored["correct"]),
                      format_ok=bool(scored["format_ok"]))
        record.update({f"reward_{name}": scored["rewards"][name] for name in names})
        record.update(reward_total=float(scored["total"]), score_error=None)
    except Exception as error:  # noqa: BLE001 - any scorer failure scores the response wrong
        record.update(gold_normalized=None, extracted=None, normalized=None, correct=False,
                      format_ok=False)
        record.update({f"reward_{name}": None for name in names})
        record.update(reward_total=0.0, score_error=f"{type(error).__name__}: {error}"[:500])
    record["generated_tokens"] = generation.generated_tokens
    return record


def score_records(rows: Sequence[Mapping[str, Any]], generations: Sequence[Generation],
                  rewards: RewardsParams, fmt: AnswerFormat = DEFAULT_FORMAT
                  ) -> list[dict[str, Any]]:
    """Per-sample records, scored with the rewards (and weights) that training uses."""
    if len(rows) != len(generations):
        raise EvalError(f"{len(generations)} generations for {len(rows)} rows")
    names = [reward_label(name) for name in rewards.weights]
    weights, options = rewards.weights, rewards.options
    records = []
    for row, generation in zip(rows, generations, strict=True):
        if str(row["pid"]) != generation.pid:
            raise EvalError(f"generation for pid={generation.pid} paired with row pid={row['pid']}")
        records.append(score_record(row, generation, weights, options, names, fmt))
    return records


# ----------------------------------------------------------------- aggregation


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are not None (None rewards carry no signal); None if none."""
    present = [float(v) for v in values if v is not None]
    return sum(present) / len(present) if present else None


def accuracy_by(records: Sequence[Mapping[str, Any]], column: str) -> dict[str, float]:
    """Accuracy per value of `column`; records without a value (a text set's category) are in
    no group."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for record in records:
        if record.get(column) is not None:
            groups[str(record[column])].append(bool(record["correct"]))
    return {name: sum(flags) / len(flags) for name, flags in sorted(groups.items())}


def record_reward_names(records: Sequence[Mapping[str, Any]]) -> list[str]:
    keys = dict.fromkeys(key for record in records for key in record)
    return [key.removeprefix("reward_") for key in keys
            if key.startswith("reward_") and key != "reward_total"]


def aggregate(records: Sequence[Mapping[str, Any]], *, seconds: float,
              generated_tokens: int) -> dict[str, Any]:
    """Headline metrics, per-reward means, per-group accuracy and generation throughput."""
    if not records:
        raise EvalError("no records to aggregate")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise EvalError(f"generation time must be a positive number of seconds, got {seconds!r}")
    n = len(records)
    metrics: dict[str, Any] = {
        "n": n,
        "accuracy": sum(bool(r["correct"]) for r in records) / n,
        "format_compliance": sum(bool(r["format_ok"]) for r in records) / n,
        "mean_reward": sum(float(r["reward_total"]) for r in records) / n,
        "rewards": {name: mean([r.get(f"reward_{name}") for r in records])
                    for name in record_reward_names(records)},
        "score_errors": sum(r.get("score_error") is not None for r in records),
    }
    for column, key in GROUP_COLUMNS.items():
        metrics[key] = accuracy_by(records, column)
    metrics.update(seconds=seconds, generated_tokens=generated_tokens,
                   samples_per_second=n / seconds,
                   generated_tokens_per_second=generated_tokens / seconds,
                   mean_generated_tokens=generated_tokens / n)
    return metrics


# ------------------------------------------------------------------- pipeline


def check_eval_set(path: Path) -> None:
    if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path}: no prepared eval set there; the prepare_data stage "
                                f"makes it (dvc repro prepare_data)")


def load_eval_set(path: Path):
    dataset = load_from_disk(str(path))
    missing = [column for column in REQUIRED_COLUMNS if column not in dataset.column_names]
    if missing:
        raise EvalError(f"{path}: eval set lacks columns {missing}; re-run prepare_data")
    if len(dataset) == 0:
        raise EvalError(f"{path}: eval set is empty; check params.yaml `data.eval_size`")
    return dataset


def eval_shard(num_processes: int | str) -> tuple[int, int]:
    """(this process's index, the process count) of a launched evaluation, checked against
    `eval.num_processes` (`auto` resolved as the stage resolved it); (0, 1) in one process."""
    num_processes = evaluation_processes(num_processes)
    if num_processes == 1:
        return 0, 1
    index, count = start_processes(cpu=not torch.cuda.is_available())
    if count != num_processes:
        raise EvalError(f"params.yaml eval.num_processes is {num_processes} but {count} "
                        "processes were launched; let the stage launch itself")
    return index, count


def run_evaluation(eval_set_path: Path | str, model_params: ModelParams, settings: EvalParams,
                   rewards: RewardsParams, adapter: Path | str | None = None,
                   fmt: AnswerFormat = DEFAULT_FORMAT,
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """Generates on every eval row with the (optionally adapted) model and scores the responses.
    With `eval.num_processes` > 1 (a launched run) each process generates its share of the
    batches; rank 0 gets them all, scores and returns; the other ranks return None."""
    eval_set_path = Path(eval_set_path)
    check_eval_set(eval_set_path)
    if adapter is not None:
        check_adapter(Path(adapter))
    build_rewards(rewards.weights, rewards.options, fmt)  # a bad reward fails here, before the model
    dataset = load_eval_set(eval_set_path)
    shard = eval_shard(settings.num_processes)
    model, processor, _backend = load_model(model_params, adapter=adapter)
    start = time.perf_counter()
    generations = generate_responses(model, processor, dataset, settings, shard)
    seconds = time.perf_counter() - start
    if shard[0] != 0:
        return None  # rank 0 scores and writes
    records = score_records(dataset.remove_columns(["image"]), generations, rewards, fmt)
    metrics = aggregate(records, seconds=seconds,
                        generated_tokens=sum(g.generated_tokens for g in generations))
    return records, metrics
