"""The prompt an engine reads from fields besides the API's own is in the estimate
(gateway/routing/engine_prompt.py): token ids it prefills instead of the rendered messages, text its
chat template renders; nothing about them is refused."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.dialects.chat import chat_features
from gateway.dialects.names import CHAT, COMPLETIONS, RESPONSES
from gateway.dialects.responses import responses_features
from gateway.protocol.openai import ChatCompletionRequest
from gateway.protocol.responses import ResponsesRequest
from gateway.routing.engine_prompt import prompt_ids, prompt_text_tokens
from gateway.routing.params import EstimationConfig
from gateway.routing.tokens import TokenEstimator

ESTIMATOR = TokenEstimator(EstimationConfig())
HI = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "kimi-k3", "messages": HI, **fields})


def test_token_ids_replace_a_smaller_rendered_prompt() -> None:
    plain = chat_features(chat(), "kimi-k3", ESTIMATOR)
    for field in ({"input_ids": list(range(5000))},  # SGLang
                  {"kv_transfer_params": {"prompt_token_ids": list(range(5000))}}):  # vLLM
        features = chat_features(chat(**field), "kimi-k3", ESTIMATOR)
        assert (features.prompt_tokens, features.estimate_method) == (5000, "token_ids")
        assert features.prefix == plain.prefix
    few = chat_features(chat(input_ids=[1, 2]), "kimi-k3", ESTIMATOR)  # the engine may render the messages
    assert (few.prompt_tokens, few.estimate_method) == (plain.prompt_tokens, plain.estimate_method)


def test_ids_are_counted_whatever_their_items_and_only_where_an_engine_reads_them() -> None:
    assert prompt_ids(CHAT, {"input_ids": ["x"] * 9}) == 9  # the engine refuses them; the charge comes back
    assert prompt_ids(CHAT, {"input_ids": "1,2,3", "kv_transfer_params": [1, 2]}) == 0
    assert prompt_ids(CHAT, {"input_ids": [1] * 3, "kv_transfer_params": {"prompt_token_ids": [1] * 7}}) == 7
    assert prompt_ids(COMPLETIONS, {"input_ids": [1] * 9}) == 0  # `prompt` takes ids there
    assert prompt_ids(CHAT, None) == 0


def test_template_text_fields_add_to_the_estimate() -> None:
    documents = [{"title": "Weather", "text": "Sunny all week. " * 200}]
    kwargs = {"enable_thinking": False}
    plain = chat_features(chat(), "kimi-k3", ESTIMATOR).prompt_tokens
    with_fields = chat_features(chat(documents=documents, chat_template_kwargs=kwargs), "kimi-k3", ESTIMATOR)
    added = ESTIMATOR.utf8_tokens(orjson.dumps(documents) + orjson.dumps(kwargs))
    assert with_fields.prompt_tokens == plain + added > plain + 700
    earlier = [{"role": "user", "content": "What was the weather? " * 100}]
    wire = ResponsesRequest.model_validate({"model": "kimi-k3", "input": "And now?"})
    with_earlier = ResponsesRequest.model_validate({"model": "kimi-k3", "input": "And now?",
                                                    "previous_input_messages": earlier})
    grown = responses_features(with_earlier, "kimi-k3", ESTIMATOR).prompt_tokens
    assert grown == responses_features(wire, "kimi-k3", ESTIMATOR).prompt_tokens + ESTIMATOR.utf8_tokens(
        orjson.dumps(earlier))
    assert prompt_text_tokens(RESPONSES, {"documents": documents}, ESTIMATOR) == 0  # not a Responses field
    assert prompt_text_tokens(CHAT, {}, ESTIMATOR) == 0
