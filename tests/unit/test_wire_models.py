"""The OpenAI request models against their documented JSON Schema (/openapi.json). Integer fields take
JSON's integral numbers: `5.0` is the integer 5 in JSON's data model and in JSON Schema's `integer`
(Schemathesis sent `"max_tokens": 22102109.0` and got a 400), and the engines' own parsers read it so;
`5.5`, `"5"` and `true` stay refused."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest

CHAT: dict[str, Any] = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}]}


def test_integral_floats_are_integers() -> None:
    chat = ChatCompletionRequest.model_validate(orjson.loads(orjson.dumps(
        {**CHAT, "max_tokens": 22102109.0, "max_completion_tokens": 7.0, "n": 2.0})))
    assert (chat.max_tokens, chat.max_completion_tokens, chat.n) == (22102109, 7, 2)
    assert type(chat.max_tokens) is int
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2.0, 3]})
    assert ids.prompt == [1, 2, 3] and all(type(i) is int for i in ids.prompt)
    batch = CompletionRequest.model_validate({"model": "m", "prompt": [[1.0], [2, 3.0]]})
    assert batch.prompt == [[1], [2, 3]]


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 5.5), ("max_tokens", "5"), ("max_tokens", True),
                                              ("n", 1.25), ("max_tokens", float("inf")), ("max_tokens", 0.0),
                                              ("max_tokens", 2.0**31)])
def test_other_numbers_stay_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, field: value})


@pytest.mark.parametrize("prompt", [[1, 2.5], [[1], [2.5]], [1.5], [True, 1],
                                    [-1], [[3], [2**31]], [2**70], [[2**70, 1]]])
def test_token_ids_stay_whole_numbers(prompt: list[Any]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})


def test_an_empty_prompt_list_is_refused_by_the_model_as_documented() -> None:
    """/openapi.json says every prompt list has `minItems: 1` (Schemathesis sent `"prompt": []` as valid)."""
    with pytest.raises(ValidationError, match="it must not be empty"):
        CompletionRequest.model_validate({"model": "m", "prompt": []})
    prompt = CompletionRequest.model_json_schema()["properties"]["prompt"]["anyOf"]
    assert [branch.get("minItems") for branch in prompt] == [None, 1, 1, 1]


def test_the_other_apis_output_limits_take_integral_numbers_too() -> None:
    """The Responses API's `max_output_tokens` and Anthropic's `max_tokens` (Schemathesis sent
    `"max_output_tokens": 544.0`)."""
    from gateway.protocol.anthropic import MessagesRequest
    from gateway.protocol.responses import ResponsesRequest

    response = ResponsesRequest.model_validate({"model": "m", "input": "hi", "max_output_tokens": 544.0})
    assert response.max_output_tokens == 544
    message = {"model": "m", "max_tokens": 16.0, "messages": [{"role": "user", "content": "hi"}]}
    assert MessagesRequest.model_validate(message).max_tokens == 16
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "max_output_tokens": 5.5})
    assert ResponsesRequest.model_json_schema()["properties"]["max_output_tokens"]["anyOf"][0]["minimum"] == 1
    # An empty input list is refused, as documented (`minItems: 1`; Schemathesis sent `"input": []`).
    assert ResponsesRequest.model_json_schema()["properties"]["input"]["anyOf"][1]["minItems"] == 1
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": []})


def test_token_ids_hold_the_vocabulary_range() -> None:
    """Hypothesis sent `[[2**70]]` to /v1/completions and got a 500 (the prefix hasher's JSON encoder
    refuses integers beyond 64 bits); an id is a vocabulary index, 0 .. 2**31 - 1."""
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [[0, 2**31 - 1]]})
    assert ids.prompt == [[0, 2**31 - 1]]
    with pytest.raises(ValidationError) as refused:
        CompletionRequest.model_validate({"model": "m", "prompt": [[5], [1, 2**70]]})
    assert refused.value.errors()[0]["loc"][-2:] == (1, 1)
