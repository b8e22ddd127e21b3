"""params.yaml, read once per stage into one typed class per section.

Contract: a stage calls `load_params` once and hands the library typed sections (`ModelParams`,
`TrainParams`, ...), never the raw dict. Every section is a pydantic model with
`extra="forbid"`; a wrong value is one `ParamsError` line naming the file, the key path, the
value and what is allowed: `params.yaml model.backend: 'foo' is not one of auto, transformers,
unsloth`. A section is validated when a stage first asks for it, so a stage checks exactly the
sections dvc.yaml lists for it (a bad `rewards` section must fail train_gspo, not prepare_data),
before any model loads; `Params.check` validates them all (`vlmrl recipe --check`). Besides the field types: reward and embedded model names, the ranges of the trainer
configs' values and GRPO's batch arithmetic (vlmrl.params_checks). Checks that need a runtime
stay with the code that has it: `sft.args` and `train.grpo` against the fields of
`trl.SFTConfig` and `trl.GRPOConfig` (vlmrl.params_checks.config_values, when the stage builds
the config), `export.quantize` against llama.cpp (vlmrl.export.exporter), reward options against
the registry (vlmrl.rewards.functions)."""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, Literal, Self, TypeVar, get_args, overload

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from vlmrl.errors import ParamsError  # defined there, beside the other user errors
from vlmrl.params_checks import (  # the value types' checks, and those beyond a field's type
    _boolean,
    _integer,
    _list,
    _name_list,
    _number,
    _positive_integer,
    _real,
    _trainer_args,
    check_embedded_model,
    check_reward_names,
    check_trainer_args,
    describe,
)

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
    name: Annotated[str, AfterValidator(check_embedded_model)]  # a hub id or an embedded model
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

    @field_validator("source")
    @classmethod
    def _known_embedded_source(cls, value: str) -> str:
        embedded = (EMBEDDED_SOURCE, EMBEDDED_TEXT_SOURCE)
        if value.startswith("embedded:") and value not in embedded:
            raise ValueError(f"unknown embedded data set {value!r}; known: {', '.join(embedded)}")
        return value

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
    """The cold-start SFT (vlmrl.training.sft). `args` is passed to `trl.SFTConfig`; its values'
    ranges are checked here, its keys against SFTConfig's fields when the stage builds it. Off
    (`enabled: false`, or `args.max_steps: 0`) the stage is a pass-through and GSPO starts from
    the base model."""

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

    @classmethod
    def from_params(cls, values: Any) -> Self:
        if isinstance(values, Mapping):
            check_trainer_args("sft.args", values.get("args"))
        return super().from_params(values)

    @property
    def trains(self) -> bool:
        return self.enabled and self.args.get("max_steps", -1) != 0  # 0: off (vlmrl.params_checks)


class LoraParams(Section):
    """`train.lora`: what train_gspo adapts and what verify_lora checks the adapter against."""

    SECTION = "train.lora"
    r: PositiveInteger
    # kept as written (16 stays an integer), as PEFT and Unsloth are given it
    alpha: Annotated[int | float, BeforeValidator(_real), Field(gt=0)]
    dropout: Annotated[float, BeforeValidator(_number), Field(ge=0, lt=1)]
    target_modules: Annotated[tuple[str, ...], BeforeValidator(_name_list)]


class TrainParams(Section):
    """`train.grpo` is passed to `trl.GRPOConfig` as is; its values' ranges and batch arithmetic
    are checked here, its keys against GRPOConfig's fields when the stage builds it."""

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
        if isinstance(values, Mapping):
            check_trainer_args("train.grpo", values.get("grpo"))
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

SectionT = TypeVar("SectionT", bound=Section)


class TypedSection(Generic[SectionT]):
    """A `Params` attribute that is one section typed by its class (`kind`): validated when a
    stage first reads it, so a stage checks only the sections it reads, then kept."""

    def __init__(self, kind: type[SectionT]) -> None:
        self.kind = kind

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name  # the instance attribute the typed section is kept in

    @overload
    def __get__(self, params: None, owner: type | None = None) -> Self: ...

    @overload
    def __get__(self, params: Params, owner: type | None = None) -> SectionT: ...

    def __get__(self, params: Params | None, owner: type | None = None) -> SectionT | Self:
        if params is None:
            return self
        with in_file(params.source):
            typed = self.kind.from_params(params.section(self.kind.SECTION))
        params.__dict__[self.name] = typed  # later reads find it there
        return typed


class Params:
    """params.yaml as a stage reads it: the raw mapping (for fingerprints and the model card)
    and one typed, cached attribute per section (`TypedSection`). `source` is the file the
    mapping came from, which every ParamsError of a section names."""

    SECTIONS = ("model", "data", "rewards", "eval", "sft", "train", "verify", "export", "upload")
    # Read by other packages: the answer format by vlmrl.rewards.answer_format.
    OTHER_SECTIONS = ("answer_format",)

    def __init__(self, raw: Mapping[str, Any], source: Path | str = PARAMS_FILE) -> None:
        self.raw = raw
        self.source = source

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

    def check(self) -> None:
        """Every section validated, as each stage validates the sections it reads, and no
        section this project does not know (a misspelt one would be ignored)."""
        with in_file(self.source):
            unknown = sorted(set(self.raw) - {*self.SECTIONS, *self.OTHER_SECTIONS})
            if unknown:
                raise ParamsError(f"params.yaml has unknown sections {unknown}; known: "
                                  f"{', '.join((*self.SECTIONS, *self.OTHER_SECTIONS))}")
        for name in self.SECTIONS:
            getattr(self, name)

    model = TypedSection(ModelParams)
    data = TypedSection(DataParams)
    rewards = TypedSection(RewardsParams)
    eval = TypedSection(EvalParams)
    sft = TypedSection(SftParams)
    train = TypedSection(TrainParams)
    verify = TypedSection(VerifyParams)
    export = TypedSection(ExportParams)
    upload = TypedSection(UploadParams)


@contextmanager
def in_file(source: Path | str) -> Iterator[None]:
    """A ParamsError raised inside names `source` where it names params.yaml: the checks word
    their messages for the file the stages read, and a recipe or another params file is named
    for what it is, once."""
    try:
        yield
    except ParamsError as error:
        prefix, message = f"{PARAMS_FILE} ", str(error)
        if str(source) == str(PARAMS_FILE) or not message.startswith(prefix):
            raise
        raise ParamsError(f"{source} {message.removeprefix(prefix)}") from None


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
    return Params(read_params_file(path), source=path)
