"""The reward calculator's request (`POST /api/score`) as pydantic models, and the one client error
that any invalid request becomes.

The models say what each field must be; `parse_score_request` turns the first problem into an
`ApiError` whose message names the field and what it got ("record.precision must be a whole
number of decimal places (0, 1, 2, ...) or null, got -1"), and whose `field` key names it for the
page. Unknown fields are reported before anything else: they are usually a misspelt field that
also shows up as missing. Status: 400 for a body that is not a JSON object, 413 for a completion
over `MAX_COMPLETION_BYTES`, 422 otherwise. The body is parsed with `json.loads` and the result
validated, so any JSON Python reads (lone surrogates, NaN) reaches validation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from vlmrl.rewards.functions import RECORD_COLUMNS
from vlmrl.ui.errors import ApiError

__all__ = ["ANSWER_TYPES", "MAX_COMPLETION_BYTES", "QUESTION_TYPES", "GoldRecord",
           "ScoreRequest", "parse_score_request"]

MAX_COMPLETION_BYTES = 1_000_000

QuestionType = Literal["free_form", "multi_choice"]
AnswerType = Literal["integer", "float", "text", "list"]
QUESTION_TYPES: tuple[str, ...] = get_args(QuestionType)
ANSWER_TYPES: tuple[str, ...] = get_args(AnswerType)

# Problems whose message is written here in full; their HTTP status.
OWN_PROBLEMS = {"completion_empty": 422, "completion_too_large": 413, "choices_required": 422}


def checked_completion(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("completion_empty", "is empty: paste or type a model response")
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_COMPLETION_BYTES:
        raise PydanticCustomError("completion_too_large", f"is {size:,} bytes; the limit is "
                                                          f"{MAX_COMPLETION_BYTES:,} bytes (1 MB)")
    return text


def not_blank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("blank", "is blank")
    return text


def whole_number(value: float | None) -> float | None:
    if value is not None and value != int(value):
        raise PydanticCustomError("not_whole", "is not a whole number")
    return value


class GoldRecord(BaseModel):
    """A gold record as `score_completion` takes it. pid, question, category and source (the
    eval set's records carry them) are accepted and ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    answer: Annotated[str, AfterValidator(not_blank)] = Field(
        description="the gold answer, a non-empty string")
    question_type: QuestionType = Field(description=f"one of {', '.join(QUESTION_TYPES)}")
    answer_type: AnswerType = Field(description=f"one of {', '.join(ANSWER_TYPES)}")
    choices: list[str] | None = Field(
        None, description="a list of strings (the options of a multi_choice question) or null")
    precision: Annotated[float | None, AfterValidator(whole_number)] = Field(
        None, ge=0, allow_inf_nan=False,
        description="a whole number of decimal places (0, 1, 2, ...) or null")
    unit: str | None = Field(None, description="a string or null")
    pid: Any = None
    question: Any = None
    category: Any = None
    source: Any = None

    @field_validator("choices")
    @classmethod
    def choices_of_multi_choice(cls, choices: list[str] | None,
                                info: ValidationInfo) -> list[str] | None:
        if not choices and info.data.get("question_type") == "multi_choice":
            raise PydanticCustomError("choices_required",
                                      "must list the options of a multi_choice question")
        return choices or None

    def scoring_record(self) -> dict[str, Any]:
        """The columns `score_completion` reads, precision as a float."""
        return self.model_dump(include=set(RECORD_COLUMNS))


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    completion: Annotated[str, AfterValidator(checked_completion)] = Field(
        description="the model's response, a string")
    record: GoldRecord = Field(
        description="the gold record, an object with answer, question_type and answer_type")


def parse_score_request(body: bytes) -> ScoreRequest:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object with `completion` and `record`")
    try:
        return ScoreRequest.model_validate(payload)
    except ValidationError as error:
        raise first_problem(error.errors()) from None


# ------------------------------------------------------------------ messages


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def shown(value: Any) -> str:
    """What the client sent, short: scalars as JSON, containers by their type."""
    if isinstance(value, (dict, list)):
        return json_type(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def path_of(loc: Sequence[int | str]) -> str:
    """("record", "choices", 1) -> "record.choices[1]"."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def described_field(loc: Sequence[int | str]) -> tuple[tuple[str, ...], str | None]:
    """The deepest model field on loc and its description."""
    model: type[BaseModel] | None = ScoreRequest
    names: tuple[str, ...] = ()
    description = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        info = model.model_fields[part]
        names, description = (*names, part), info.description
        annotation = info.annotation
        model = annotation if isinstance(annotation, type) and issubclass(
            annotation, BaseModel) else None
    return names, description


def unknown_fields(extras: list[ErrorDetails]) -> ApiError:
    parent = extras[0]["loc"][:-1]
    names = [path_of(error["loc"]) for error in extras if error["loc"][:-1] == parent]
    model: type[BaseModel] = ScoreRequest
    for part in parent:
        model = model.model_fields[str(part)].annotation  # type: ignore[assignment]
    return ApiError(422, f"unknown field(s) {', '.join(names)}; expected "
                         f"{', '.join(model.model_fields)}", field=names[0])


def first_problem(errors: list[ErrorDetails]) -> ApiError:
    """One `ApiError` for the first problem; unknown fields (shallowest first) come first."""
    extras = sorted((e for e in errors if e["type"] == "extra_forbidden"),
                    key=lambda e: len(e["loc"]))
    if extras:
        return unknown_fields(extras)
    error = errors[0]
    path = path_of(error["loc"])
    names, description = described_field(error["loc"])
    field = ".".join(names) or path
    if error["type"] == "missing":
        return ApiError(422, f"{path} is missing", field=field)
    if error["type"] in OWN_PROBLEMS:
        return ApiError(OWN_PROBLEMS[error["type"]], f"{path} {error['msg']}", field=field)
    if description is None:
        return ApiError(422, f"{path}: {error['msg']}", field=field)
    got = (f", got {shown(error['input'])}" if path == field
           else f"; {path} is {shown(error['input'])}")
    return ApiError(422, f"{field} must be {description}{got}", field=field)

