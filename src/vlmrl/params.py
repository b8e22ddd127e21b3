"""params.yaml, read once per stage into one typed class per section.

Contract: a stage calls `load_params` once and hands the library typed sections (`ModelParams`,
`TrainParams`, ...), never the raw dict. Every section is a pydantic model with
`extra="forbid"`; a wrong value is one `ParamsError` line naming the key path and, for a
choice, the allowed values: `params.yaml model.backend: 'foo' is not one of auto, transformers,
unsloth`. A section is validated when a stage first asks for it, so a stage checks exactly the
sections dvc.yaml lists for it (a bad `rewards` section must fail train_gspo, not prepare_data).
Checks that need a runtime stay with the code that has it: `sft.args` and `train.grpo`
against the fields of `trl.SFTConfig` and `trl.GRPOConfig` (vlmrl.training.trainer.config),
`export.quantize` against llama.cpp (vlmrl.export.exporter), reward options against the registry
(vlmrl.rewards.functions). Reward names, which a typo breaks, are checked here, before a stage loads a
model (vlmrl.params_checks)."""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from vlmrl.errors import ParamsError  # defined there, beside the other user errors
from vlmrl.params_checks import check_group_size, check_reward_names, describe

PARAMS_FILE = Path("params.yaml")

Backend = Literal["auto", "transformers", "unsloth"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
ExportDtype = Literal["bfloat16", "float16"]  # the merge is never done in 4-bit
QuestionType = Literal["free_form", "multi_choice"]
AnswerType = Literal["integer", "float", "text", "list"]
# llama.cpp's convert_hf_to_gguf.py --outtype choices.
ConverterOuttype = Literal["f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0"]
QUESTION_TYPES: tuple[str, ...] = get_args(QuestionType)
ANSWER_TYPES: tuple[str, ...] = get_args(AnswerType)
CONVERTER_OUTTYPES: tuple[str, ...] = get_args(ConverterOuttype)
EMBEDDED_SOURCE = "embedded:synthetic"
EMBEDDED_TEXT_SOURCE = "embedded:arithmetic"  # GSM8K-style word problems (vlmrl.data.synth.arithmetic)
LOCAL_SOURCE, LOCAL_DATA_DIR = "local", "data/local"  # data.source: local reads data.path
RecordField = Literal["id", "question", "answer", "image", "choices", "question_type",
                      "answer_type", "precision", "unit", "source", "category"]  # data.columns


# ------------------------------------------------------------------ value types
# Validators raise ValueError even for a wrong type: pydantic reports only ValueError (and
# AssertionError) as a validation error with the field's location.


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer, got {value!r}")  # noqa: TRY004
    return value


def _positive_integer(value: Any, auto: bool = False) -> int | str:
    """A positive integer; with `auto`, also the word auto (a process count: vlmrl.distributed.launch)."""
    if auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive integer{' or auto' * auto}, got {value!r}")
    return value


def _number(value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)):
        raise ValueError(f"must be a finite number, got {value!r}")
    return float(value)


def _real(value: Any) -> int | float:
    """A finite number, kept as written: an integer stays an integer."""
    _number(value)
    return value


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")  # noqa: TRY004
    return value


def _name_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"must be a non-empty list, got {value!r}")
    return tuple(value)


def _list(value: Any) -> Any:
    """None (an empty YAML value) is an empty list; a bare string is not a list."""
    if value is None:
        return ()
    if isinstance(value, str):
        raise ValueError(f"must be a list, got {value!r}")  # noqa: TRY004
    return value


# Trainer-config keys the pipeline sets itself, from dvc.yaml's paths and other params sections
# (vlmrl.training.trainer.config builds the configs with them), so params.yaml may not set them.
PIPELINE_KEYS: dict[str, frozenset[str]] = {
    "sft.args": frozenset({"output_dir", "use_cpu", "completion_only_loss", "max_length",
                           "remove_unused_columns", "save_strategy"}),
    "train.grpo": frozenset({"output_dir", "save_steps", "save_strategy", "reward_weights",
                             "resume_from_checkpoint", "use_cpu"}),
}


def _trainer_args(key_path: str) -> Callable[[Any], Any]:
    """The check of a trainer config's args (`sft.args`, `train.grpo`): a mapping (None, an empty
    YAML value, is an empty one) without the keys the pipeline sets. Their types are checked
    against the config's fields when it is built (vlmrl.training.trainer.config)."""

    def check(value: Any) -> Any:
        value = {} if value is None else value
        managed = sorted(set(value) & PIPELINE_KEYS[key_path]) if isinstance(value, Mapping) else []
        if managed:
            raise ValueError(f"{managed} are set by the pipeline; remove them")
        return value

    return check


Integer = Annotated[int, BeforeValidator(_integer)]
PositiveInteger = Annotated[int, BeforeValidator(_positive_integer)]
ProcessCount = Annotated[int | str, BeforeValidator(lambda value: _positive_integer(value, True))]
Number = Annotated[float, BeforeValidator(_number)]
Boolean = Annotated[bool, BeforeValidator(_boolean)]


# ---------------------------------------------------------------------- sections


class Section(BaseModel):
    """One params.yaml section; `from_params` turns any validation error into a ParamsError."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    SECTION: ClassVar[str] = ""

    @classmethod
    def from_params(cls, values: Any) -> Self:
        if not isinstance(values, Mapping):
            raise ParamsError(f"params.yaml {cls.SECTION} must be a mapping, got "
                              f"{type(values).__name__}")
        try:
            return cls.model_validate(dict(values))
        except ValidationError as error:
            raise ParamsError(describe(cls, error)) from None

    @classmethod
    def yaml_loc(cls, loc: tuple[Any, ...]) -> tuple[Any, ...]:
        """The params.yaml key path of a field's location (the same, unless a section maps
        its keys onto other fields)."""
        return loc


class ModelParams(Section):
    SECTION = "model"
    name: str
    backend: Backend = "auto"
    dtype: ModelDtype = "auto"
    load_in_4bit: Boolean = False
    seed: Integer = 0
    max_seq_length: PositiveInteger = 4096


class DataParams(Section):
    SECTION = "data"
    source: str = EMBEDDED_SOURCE  # or LOCAL_SOURCE, or a hub id (config, split, revision)
    path: str = LOCAL_DATA_DIR  # a dependency of prepare_data in dvc.yaml, so it must exist
    config: str | None = None
    split: str = "testmini"
    revision: str | None = None
    columns: dict[RecordField, str] = {}  # record field -> the data's column (vlmrl.data.columns)
    answer_pattern: str | None = None  # checked by vlmrl.data.columns
    synthetic_size: PositiveInteger = 160
    synthetic_read_size: Annotated[int, BeforeValidator(_integer), Field(ge=0)] = 0  # tier "read"
    seed: Integer = 42
    eval_size: Annotated[int, BeforeValidator(_integer), Field(ge=1)] = 100
    question_types: Annotated[tuple[QuestionType, ...], BeforeValidator(_list)] = ("free_form",)
    answer_types: Annotated[tuple[AnswerType, ...], BeforeValidator(_list)] = ("integer",
                                                                                 "float")
    image_size: Annotated[int, BeforeValidator(_integer), Field(ge=28)] = 512
    strict: Boolean = False

    @property
    def from_hub(self) -> bool:
        """Whether `source` is a hub dataset id: the only source that config, split and
        revision apply to."""
        return (self.source not in (EMBEDDED_SOURCE, EMBEDDED_TEXT_SOURCE, LOCAL_SOURCE)
                and not Path(self.source).exists())

    def describe(self) -> str:
        """The source as reports and the model card name it, with the split only for the hub."""
        if self.source == LOCAL_SOURCE:
            return f"`{self.path}` (local)"
        if not self.from_hub:
            return f"`{self.source}`"
        config = f", config `{self.config}`" if self.config else ""
        revision = f", revision `{self.revision}`" if self.revision else ""
        return f"`{self.source}` (hub{config}, split `{self.split}`{revision})"


class RewardsParams(Section):
    """`weights` (name -> weight; a list of names means weight 1 each) and, beside it in
    params.yaml, one mapping of keyword options per reward (`length_penalty: {min_chars: 50}`).
    Names are checked here (a built-in name or an import path); options against the registry
    by `vlmrl.rewards.functions.build_rewards`."""

    SECTION = "rewards"
    weights: dict[str, Number]
    options: dict[str, dict[str, Any]] = {}

    @field_validator("weights", mode="before")
    @classmethod
    def _names_weigh_one(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return {str(name): 1.0 for name in value}
        return value

    @classmethod
    def from_params(cls, values: Any) -> Self:
        if isinstance(values, Mapping):
            check_reward_names(values)
            values = {"options": {key: value for key, value in values.items()
                                  if key != "weights"},
                      **({"weights": values["weights"]} if "weights" in values else {})}
        return super().from_params(values)

    @classmethod
    def yaml_loc(cls, loc: tuple[Any, ...]) -> tuple[Any, ...]:
        return loc[1:] if loc[:1] == ("options",) else loc


class EvalParams(Section):
    SECTION = "eval"
    max_new_tokens: PositiveInteger = 512
    batch_size: PositiveInteger = 8
    do_sample: Boolean = False
    temperature: Annotated[float, BeforeValidator(_number), Field(gt=0)] = 1.0
    top_p: Annotated[float, BeforeValidator(_number), Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, BeforeValidator(_integer), Field(ge=0)] = 0  # 0: no top-k cut
    seed: Integer = 0
    num_processes: ProcessCount = "auto"  # auto: one process per GPU (vlmrl.distributed.launch)


class SftParams(Section):
    """The cold-start SFT (vlmrl.training.sft). `args` is passed to `trl.SFTConfig`;
    vlmrl.training.trainer.config checks its keys against SFTConfig's fields. Off (`enabled: false`, or
    `args.max_steps: 0`) the stage is a pass-through and GSPO starts from the base model."""

    SECTION = "sft"
    enabled: Boolean = False
    reasoning: str = "I read the image."  # the reasoning block's text; may hold {answer}
    max_nonfinite_steps: PositiveInteger = 3  # skipped non-finite steps in a row that stop it
    args: Annotated[dict[str, Any], BeforeValidator(_trainer_args("sft.args"))] = {}

    @field_validator("reasoning")
    @classmethod
    def _answer_field_only(cls, value: str) -> str:
        fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        if fields - {"answer"}:
            raise ValueError(f"may only use the field {{answer}}, got {sorted(fields)}")
        return value

    @property
    def trains(self) -> bool:
        return self.enabled and self.args.get("max_steps", -1) != 0  # checked: vlmrl.training.trainer.config


class LoraParams(Section):
    """`train.lora`: what train_gspo adapts and what verify_lora checks the adapter against."""

    SECTION = "train.lora"
    r: PositiveInteger
    # kept as written (16 stays an integer), as PEFT and Unsloth are given it
    alpha: Annotated[int | float, BeforeValidator(_real), Field(gt=0)]
    dropout: Annotated[float, BeforeValidator(_number), Field(ge=0, lt=1)]
    target_modules: Annotated[tuple[str, ...], BeforeValidator(_name_list)]


class TrainParams(Section):
    """`train.grpo` is passed to `trl.GRPOConfig` as is; vlmrl.training.trainer.config checks its keys
    against GRPOConfig's fields."""

    SECTION = "train"
    save_steps: PositiveInteger
    resume: Boolean = True
    max_generation_rows: PositiveInteger | None = None
    distributed: dict[str, Any] = {}  # checked by vlmrl.distributed.launch.DistributedParams
    graph_decoding: Literal["eager", "graph", "merged"] = "eager"  # GPU rollouts: vlmrl.training.rollout.graph_decode
    expandable_segments: Boolean = True  # the CUDA allocator's: vlmrl.distributed.launch.use_expandable_segments
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # graph decoding's cache: vlmrl.training.rollout.decode_attention
    training_attention: Literal["sdpa", "rolled"] = "sdpa"  # vlmrl.training.trainer.attention
    compile_layers: Boolean = False  # text decoder layers compiled outside generation: vlmrl.training.trainer.compiled_layers
    nf4_linears: Boolean = False  # the compiled layers' NF4 projections through vlmrl.training.trainer.nf4_linear
    keep_image_features: Boolean = False  # each image through the vision tower once a generation: vlmrl.models.image_features
    max_nonfinite_steps: PositiveInteger = 3  # skipped non-finite steps in a row that stop it
    lora: LoraParams
    grpo: Annotated[dict[str, Any], BeforeValidator(_trainer_args("train.grpo"))] = {}

    @classmethod
    def from_params(cls, values: Any) -> Self:
        if isinstance(values, Mapping) and isinstance(values.get("grpo"), Mapping):
            check_group_size(values["grpo"])
        return super().from_params(values)


class VerifyParams(Section):
    SECTION = "verify"
    logit_tolerance: Annotated[float, BeforeValidator(_number), Field(ge=0)]


class ExportParams(Section):
    SECTION = "export"
    dtype: ExportDtype = "bfloat16"
    gguf_outtypes: Annotated[tuple[ConverterOuttype, ...], BeforeValidator(_list)] = ("f16",
                                                                                      "q8_0")
    quantize: Annotated[tuple[str, ...], BeforeValidator(_list)] = ("Q4_K_M",)
    logit_atol: Annotated[float, BeforeValidator(_number), Field(gt=0)] = 0.05
    # a fraction of the adapter's own effect on the logits
    logit_rtol: Annotated[float, BeforeValidator(_number), Field(ge=0, lt=1)] = 0.25

    @field_validator("gguf_outtypes")
    @classmethod
    def _f16_first(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if "f16" not in value:
            raise ValueError("must include f16: the parity check and `export.quantize` start "
                             "from the f16 file")
        return value

    def merged_tolerance(self, adapter_effect: float) -> float:
        """16-bit rounding of the merged weights moves the logits more the deeper the model; a
        merge that lost the adapter moves them by the adapter's whole effect."""
        return max(self.logit_atol, self.logit_rtol * adapter_effect)


# S3's smallest multipart part, 5 MiB: a lower threshold would make parts S3 refuses.
MIN_PART_MB = 5


class UploadParams(Section):
    """Where and how the upload stage and `vlmrl pull` reach S3 (vlmrl.publish)."""

    SECTION = "upload"
    bucket: str = ""  # none: the upload stage writes the manifest locally and uploads nothing
    prefix: str = "vlmrl/qwen3-vl"
    version: str = ""
    endpoint_url: str = ""
    region: str = "us-east-1"
    overwrite: Boolean = False
    multipart_threshold_mb: Annotated[float, BeforeValidator(_number),
                                      Field(ge=MIN_PART_MB)] = 64
    max_attempts: Annotated[int, BeforeValidator(_integer), Field(ge=1)] = 5
    checksum: Boolean = True
    promote: Boolean = False
    create_bucket: Boolean = False

    @classmethod
    def from_params(cls, values: Any) -> Self:
        """An empty value (`bucket:` in YAML is None) means the default."""
        if isinstance(values, Mapping):
            values = {name: value for name, value in values.items() if value is not None}
        return super().from_params({} if values is None else values)


# -------------------------------------------------------------------------- root


class Params:
    """params.yaml as a stage reads it: the raw mapping (for fingerprints and the model card)
    and one typed, cached property per section."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def section(self, name: str) -> dict[str, Any]:
        """The raw `name` section; a dotted name walks into nested sections."""
        node: Any = self.raw
        for part in name.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ParamsError(f"params.yaml has no `{name}` section")
            node = node[part]
        if not isinstance(node, Mapping):
            raise ParamsError(f"params.yaml {name} must be a mapping, got {type(node).__name__}")
        return dict(node)

    def _typed(self, kind: type[Section]) -> Any:
        return kind.from_params(self.section(kind.SECTION))

    @cached_property
    def model(self) -> ModelParams:
        return self._typed(ModelParams)

    @cached_property
    def data(self) -> DataParams:
        return self._typed(DataParams)

    @cached_property
    def rewards(self) -> RewardsParams:
        return self._typed(RewardsParams)

    @cached_property
    def eval(self) -> EvalParams:
        return self._typed(EvalParams)

    @cached_property
    def sft(self) -> SftParams:
        return self._typed(SftParams)

    @cached_property
    def train(self) -> TrainParams:
        return self._typed(TrainParams)

    @cached_property
    def verify(self) -> VerifyParams:
        return self._typed(VerifyParams)

    @cached_property
    def export(self) -> ExportParams:
        return self._typed(ExportParams)

    @cached_property
    def upload(self) -> UploadParams:
        return self._typed(UploadParams)


def read_params_file(path: Path | str = PARAMS_FILE) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found (run from the repository root)")
    with path.open(encoding="utf-8") as handle:
        raw = yaml.safe_load(handle) or {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping at the top level")
    return raw


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    return Params(read_params_file(path))
