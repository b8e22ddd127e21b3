"""The worked example the reward calculator opens with, so that a first look at the page shows
every weighted reward and the total for a completion in the format the rewards score, before
anyone types. It is a plain request: the page scores it through `/api/score` like any input."""

from __future__ import annotations

from typing import Any

from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat

EXAMPLE_QUESTION = "The bar chart shows 3 red apples and 4 green apples. How many apples in all?"
EXAMPLE_REASONING = "There are 3 red and 4 green apples, so 3 + 4 = 7."
EXAMPLE_ANSWER = "7"


def worked_example(fmt: AnswerFormat = DEFAULT_FORMAT) -> dict[str, Any]:
    """{"completion", "record"}: a correct, well-formed answer to an integer question, in the
    repo's answer format."""
    completion = fmt.completion(EXAMPLE_REASONING, EXAMPLE_ANSWER)
    record = {"question": EXAMPLE_QUESTION, "answer": EXAMPLE_ANSWER,
              "question_type": "free_form", "answer_type": "integer", "choices": None,
              "precision": None, "unit": None}
    return {"completion": completion, "record": record}
