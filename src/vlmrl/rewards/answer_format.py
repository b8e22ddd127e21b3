"""The answer format is one contract between the prompt that asks for it, the SFT targets that
teach it, the scorer that reads the answer out of it, the rewards that pay for it and the pages
that show it. So the tag pair of each block, the system prompt and the format bonus live in one
params.yaml section, `answer_format`, and every one of those reads this module's `AnswerFormat`.

Defaults: the MathVista recipe (`<REASONING>` and `<SOLUTION>`, one point per well-formed
block). The GSM8K recipe, as the classic GRPO reasoning tutorials write it, uses `<THINK>` /
`<SOLUTION>` and a 0.5 bonus. The system prompt may name the tags through `{reasoning_open}`,
`{reasoning_close}`, `{solution_open}` and `{solution_close}`, so changing a tag changes the
prompt with it."""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, field_validator, model_validator

from vlmrl.params import Params, Section, _number

SYSTEM_PROMPT_TEMPLATE = (
    "You are a careful visual maths solver. Look at the image and think step by step. "
    "Write your reasoning between {reasoning_open} and {reasoning_close}, then give only the "
    "final answer between {solution_open} and {solution_close}."
)
PLACEHOLDERS = ("reasoning_open", "reasoning_close", "solution_open", "solution_close")


@dataclass(frozen=True)
class AnswerFormat:
    reasoning_open: str = "<REASONING>"
    reasoning_close: str = "</REASONING>"
    solution_open: str = "<SOLUTION>"
    solution_close: str = "</SOLUTION>"
    system_prompt: str = SYSTEM_PROMPT_TEMPLATE
    format_bonus: float = 1.0  # format_reward's points per well-formed block

    def tags(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in PLACEHOLDERS}

    def system_text(self) -> str:
        """The system prompt with the tags filled in."""
        return self.system_prompt.format(**self.tags())

    def completion(self, reasoning: str, answer: str) -> str:
        """A completion in this format: one reasoning block, then one solution block."""
        return (f"{self.reasoning_open}{reasoning}{self.reasoning_close}"
                f"{self.solution_open}{answer}{self.solution_close}")


DEFAULT_FORMAT = AnswerFormat()


def _tag_pair(value: Any) -> tuple[str, str]:
    if (isinstance(value, str) or not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(tag, str) and tag.strip() for tag in value)):
        raise ValueError(f"must be a pair of non-empty tags [open, close], got {value!r}")
    if value[0] == value[1] or value[0] in value[1] or value[1] in value[0]:
        raise ValueError(f"the open and close tags must differ and not contain each other, "
                         f"got {list(value)!r}")
    return (value[0], value[1])


class AnswerFormatParams(Section):
    """params.yaml's `answer_format`; a params file without the section gets the defaults."""

    SECTION = "answer_format"
    reasoning_tags: Annotated[tuple[str, str], BeforeValidator(_tag_pair)] = (
        DEFAULT_FORMAT.reasoning_open, DEFAULT_FORMAT.reasoning_close)
    solution_tags: Annotated[tuple[str, str], BeforeValidator(_tag_pair)] = (
        DEFAULT_FORMAT.solution_open, DEFAULT_FORMAT.solution_close)
    system_prompt: str = SYSTEM_PROMPT_TEMPLATE
    format_bonus: Annotated[float, BeforeValidator(_number)] = DEFAULT_FORMAT.format_bonus

    @field_validator("system_prompt")
    @classmethod
    def _known_placeholders(cls, value: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as error:
            raise ValueError(f"is not a valid template ({error}); write a literal brace as "
                             "{{ or }}") from None
        unknown = sorted(fields - set(PLACEHOLDERS))
        if unknown:
            raise ValueError(f"names unknown placeholder(s) {', '.join(unknown)}; known: "
                             f"{', '.join(PLACEHOLDERS)}")
        return value

    @model_validator(mode="after")
    def _blocks_differ(self) -> AnswerFormatParams:
        tags = [*self.reasoning_tags, *self.solution_tags]
        if len(set(tags)) != len(tags):
            raise ValueError("the reasoning and solution tags must all differ")
        return self

    def to_format(self) -> AnswerFormat:
        return AnswerFormat(self.reasoning_tags[0], self.reasoning_tags[1],
                            self.solution_tags[0], self.solution_tags[1], self.system_prompt,
                            self.format_bonus)


def answer_format(params: Params | Mapping[str, Any]) -> AnswerFormat:
    """The run's answer format from its params (the defaults when the section is absent)."""
    raw = params.raw if isinstance(params, Params) else params
    return AnswerFormatParams.from_params(raw.get(AnswerFormatParams.SECTION) or {}).to_format()
