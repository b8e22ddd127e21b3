"""The private TRL and transformers names the trainer subclasses (vlmrl.training.trainer.trainers) and GRPO's
graph decoding (vlmrl.training.rollout) override, call or read, in one table, and the check that runs when a trainer is made. A private name carries no
promise: renamed or re-signed upstream, an override of it would never be called (chunked
generation would stop capping memory, a resume on CPU processes would stop loading the optimizer
state) and nothing would fail. The check turns that into one line naming the class, the name and
the versions the subclass was tested with. No torch at import."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version

from vlmrl.errors import UserError

# What the subclasses were written and tested against.
TESTED_VERSIONS = {"trl": "1.15.x", "transformers": "5.17.x"}
TRAINER = "<trainer>"  # the owner of a row that is looked up on the class being extended
INSTANCE = "<trainer instance>"  # an attribute its constructor sets: checked once it has run
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """A name relied on: `owner` (a module path, `module:Class` for a class of that module, or
    TRAINER for the trainer class being extended, which may be Unsloth's replacement of TRL's),
    what `owner` is called in messages, and the parameter names the override or call was written
    for (None: an attribute read, not a method)."""
    owner: str
    shown_as: str
    name: str
    parameters: tuple[str, ...] | None


CHUNKED_LOGPROB = PrivateName("trl.trainer.utils", "trl.trainer.utils", "_ChunkedLogProbFunction",
                              None)
# Read by GRPO's graph decoding (vlmrl.training.rollout): a renamed position helper would fail deep
# inside the first rollout, and a renamed attention attribute would read as None, leaving the
# grouped decode attention silently unused.
ROLLOUT_NAMES = (
    PrivateName("transformers.generation.utils:GenerationMixin", "transformers.GenerationMixin",
                "_prepare_position_ids_for_generation", ("self", "inputs_tensor", "model_kwargs")),
    PrivateName("transformers:PretrainedConfig", "transformers.PretrainedConfig",
                "_attn_implementation", None),
)
GRPO_NAMES = (
    PrivateName(TRAINER, "trl.GRPOTrainer", "_generate_single_turn",
                ("self", "prompt_ids", "images", "multimodal_fields", "num_generations",
                 "has_tool_images")),
    PrivateName(TRAINER, "trl.GRPOTrainer", "_generate_and_score_completions", ("self", "inputs")),
    PrivateName(TRAINER, "transformers.Trainer", "_save_rng_state", ("self", "output_dir")),
    PrivateName(TRAINER, "transformers.Trainer", "_load_optimizer_and_scheduler",
                ("self", "checkpoint")),
    CHUNKED_LOGPROB,
    *ROLLOUT_NAMES,
)
# Old log-probabilities only where needed (vlmrl.training.trainer.mixins.OldLogProbsWhereNeeded): on TRL's own
# GRPOTrainer only (Unsloth's replacement scores with its own signature and is left as it is).
OLD_LOGPS_NAMES = (
    PrivateName(TRAINER, "trl.GRPOTrainer", "_prepare_inputs", ("self", "generation_batch")),
    PrivateName(TRAINER, "trl.GRPOTrainer", "_get_per_token_logps_and_entropies",
                ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                 "compute_entropy", "compute_aux_loss", "pixel_values", "image_grid_thw",
                 "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")),
    PrivateName(INSTANCE, "trl.GRPOTrainer", "_step", None),
    PrivateName(INSTANCE, "trl.GRPOTrainer", "_buffered_inputs", None),
)
SFT_NAMES = (CHUNKED_LOGPROB,)


class UpstreamChangedError(UserError):
    """A private TRL or transformers name the trainer subclasses rely on is gone or re-signed."""


def installed_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def installed_versions() -> str:
    return ", ".join(f"{package} {installed_version(package) or 'not installed'}"
                     for package in TESTED_VERSIONS)


def check_private_names(trainer_class: type, names: Iterable[PrivateName],
                        trainer: object | None = None) -> None:
    """Raises UpstreamChangedError, in one line, for the first name of `names` that `trainer_class`
    (for TRAINER rows), `trainer` (for INSTANCE rows, skipped without it) or its owner lacks, or
    whose parameters differ from those expected."""
    for row in names:
        if row.owner == INSTANCE:
            if trainer is None:
                continue
            found = getattr(trainer, row.name, _MISSING)
        elif row.owner == TRAINER:
            found = _defined(trainer_class, row.name)
        else:  # None is a value (TRL 1.15's kernel without Triton)
            found = getattr(_owner(row, trainer_class), row.name, _MISSING)
        if found is _MISSING:
            problem = "is missing"
        elif row.parameters is not None and _parameters(found) != row.parameters:
            problem = (f"takes ({', '.join(_parameters(found) or ('?',))}), not the "
                       f"({', '.join(row.parameters)}) it was written for")
        else:
            continue
        tested = " and ".join(f"{package} {spec}" for package, spec in TESTED_VERSIONS.items())
        raise UpstreamChangedError(
            f"{row.shown_as}.{row.name} {problem}: vlmrl's trainer subclass "
            f"(vlmrl.training.trainer.private_names) was tested with {tested}, found {installed_versions()}; "
            f"install the tested versions or update the subclass{_not_trl(row, trainer_class)}")


def _not_trl(row: PrivateName, trainer_class: type) -> str:
    """Where the class checked is not TRL's own (Unsloth replaces trl.GRPOTrainer), its name."""
    if row.owner != TRAINER or trainer_class.__module__.split(".")[0] == "trl":
        return ""
    return f" (the class checked: {trainer_class.__module__}.{trainer_class.__qualname__})"


def _defined(trainer_class: type, name: str) -> object:
    """`name` as the first class in `trainer_class`'s MRO defines it with its own signature: a
    pass-through wrapper `(self, *args, **kwargs)` (Unsloth wraps some of GRPOTrainer's methods
    so, without functools.wraps) is skipped for the method it wraps further up."""
    first = _MISSING
    for cls in trainer_class.__mro__:
        if name in cls.__dict__:
            first = getattr(trainer_class, name) if first is _MISSING else first
            if not _passes_through(cls.__dict__[name]):
                return cls.__dict__[name]
    return first


def _passes_through(function: object) -> bool:
    try:
        kinds = [p.kind for p in inspect.signature(function).parameters.values()]
    except (TypeError, ValueError):
        return False
    return kinds[1:] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def _owner(row: PrivateName, trainer_class: type) -> object:
    """What `row.owner` names (a class missing from its module: an object without the name)."""
    if row.owner == TRAINER:
        return trainer_class
    module, _, class_name = row.owner.partition(":")
    found = importlib.import_module(module)
    return getattr(found, class_name, None) if class_name else found


def _parameters(function: object) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
