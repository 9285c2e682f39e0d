"""The pooling APIs' wire models (gateway/protocol/pooling.py) and dialects (gateway/dialects/pooling.py):
the shapes vLLM and SGLang accept, what a request counts (the longest sequence is its context, all of
them its quota charge, nothing reserved for output, no prefix), the engine's body, their usage, and
which pools serve them."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.config import parse_config
from gateway.dialects.names import CHAT, EMBEDDINGS, POOLING_APIS, RERANK, SCORE
from gateway.dialects.registry import dialect_for
from gateway.dispatch.ledger import quota_used
from gateway.errors import ApiNotServed, ContextLengthExceeded, InvalidRequest, ModelNotFound
from gateway.observability.record import RequestRecord
from gateway.parsing import BodyParser, ForwardBody, encode_for
from gateway.routing.pools import fitting_pools, serves
from gateway.sim.config import SimConfig
from gateway.sim.pooling import embeddings_answer, rerank_answer, score_answer
from gateway.sim.worker_state import SimWorkerState

POOLS = [{"name": "gen", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 4096},
         {"name": "embed", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 8192,
          "apis": ["embeddings", "rerank", "score"], "served_model_name": "served-embedder"}]
CONFIG = parse_config({"pools": POOLS, "affinity": {"enabled": True}}, environ={})
PARSER = BodyParser(CONFIG)


def routed(api: Any, payload: dict[str, Any]) -> Any:
    """The routing features of `payload` as the serving process builds them."""
    decoded, _ = PARSER.decode(api, orjson.dumps(payload))
    wire, model, _ = PARSER.validate(api, decoded)
    return PARSER.features(wire, model, None, None)


def refusal(api: Any, payload: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        routed(api, payload)
    return info.value


@pytest.mark.parametrize("value", [
    "hello", ["hello", "world"], [1, 2, 3], [1.0, 2, 3], [[1, 2], [3]], [[1.0, 2], [3.0]], [],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}],
    [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
    [{"text": "a caption", "image": "data:image/png;base64,AAAA"}],  # SGLang's multimodal input
])
def test_embeddings_accept_every_input_shape_vllm_and_sglang_accept(value: Any) -> None:
    request = routed(EMBEDDINGS, {"model": "kimi-k3", "input": value, "encoding_format": "base64",
                                  "dimensions": 32, "truncate_prompt_tokens": -1, "future_field": {"x": 1}})
    assert request.api == EMBEDDINGS and request.stream is False and request.output_tokens == 0
    assert request.prefix is None  # affinity is on, but nothing is hashed: no KV cache to route to


def test_embeddings_take_chat_messages_as_vllm_does() -> None:
    one = routed(EMBEDDINGS, {"model": "kimi-k3", "messages": [{"role": "user", "content": "x" * 400}]})
    batch = routed(EMBEDDINGS, {"model": "kimi-k3", "messages": [[{"role": "user", "content": "x" * 400}]] * 3})
    assert batch.prompt_tokens == one.prompt_tokens and batch.batch_prompt_tokens == 3 * one.batch_prompt_tokens
    template = CONFIG.estimation.tokens_per_request + CONFIG.estimation.tokens_per_message
    assert one.prompt_tokens > template


@pytest.mark.parametrize(("payload", "param"), [
    ({"model": "kimi-k3"}, None),  # nothing to embed
    ({"model": "kimi-k3", "input": 5}, "input"),
    ({"model": "kimi-k3", "input": ["a", 1]}, "input[1]"),
    ({"model": "kimi-k3", "input": [1, "a"]}, "input[1]"),
    ({"model": "kimi-k3", "input": [1, -2]}, "input[1]"),
    ({"input": "hello"}, "model"),
    ({"model": 7, "input": "hello"}, "model"),
])
def test_a_bad_embeddings_body_is_a_400_naming_its_field(payload: dict[str, Any], param: str | None) -> None:
    error = refusal(EMBEDDINGS, payload)
    assert error.status == 400 and error.param == param
    assert orjson.loads(error.to_bytes())["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_model_not_found() -> None:
    with pytest.raises(ModelNotFound) as info:
        routed(EMBEDDINGS, {"model": "text-embedding-3-small", "input": "hi"})
    assert info.value.status == 404 and orjson.loads(info.value.to_bytes())["error"]["code"] == "model_not_found"


def test_each_input_is_its_own_sequence_the_longest_is_the_context_all_are_charged() -> None:
    short, long = "a few words", "many more words here " * 50
    one = routed(EMBEDDINGS, {"model": "kimi-k3", "input": long})
    both = routed(EMBEDDINGS, {"model": "kimi-k3", "input": [short, long, long]})
    assert both.prompt_tokens == one.prompt_tokens
    assert both.batch_prompt_tokens == 2 * one.prompt_tokens + routed(EMBEDDINGS, {"model": "kimi-k3",
                                                                                  "input": short}).prompt_tokens
    assert both.quota_tokens(1024) == both.batch_prompt_tokens  # nothing reserved for output
    assert both.context_tokens(1024) == both.prompt_tokens
    ids = routed(EMBEDDINGS, {"model": "kimi-k3", "input": [[1] * 7, [2] * 30]})
    assert (ids.prompt_tokens, ids.batch_prompt_tokens, ids.estimate_method) == (30, 37, "token_ids")


def test_rerank_counts_the_query_with_each_document() -> None:
    query, document = "what is a pool?", "a set of interchangeable workers " * 20
    request = routed(RERANK, {"model": "kimi-k3", "query": query, "documents": [document, "short"], "top_n": 1,
                              "return_documents": False})
    alone = routed(EMBEDDINGS, {"model": "kimi-k3", "input": query + "\n" + document})
    assert request.prompt_tokens == alone.prompt_tokens
    assert request.batch_prompt_tokens > request.prompt_tokens and request.output_tokens == 0
    multimodal = routed(RERANK, {"model": "kimi-k3", "query": {"content": [{"type": "text", "text": query}]},
                                 "documents": {"content": [{"type": "image_url", "image_url": {"url": "x"}}]}})
    assert "image" in multimodal.modalities and multimodal.estimate_method == "bytes+default"
    assert refusal(RERANK, {"model": "kimi-k3", "documents": ["a"]}).param == "query"
    assert refusal(RERANK, {"model": "kimi-k3", "query": 3, "documents": ["a"]}).param == "query"


@pytest.mark.parametrize(("first", "second"), [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                                               ("data_1", "data_2"), ("query", "items")])
def test_score_takes_every_pair_of_names_vllm_and_sglang_take(first: str, second: str) -> None:
    one = routed(SCORE, {"model": "kimi-k3", first: "the query", second: ["doc one", "doc two", "doc three"]})
    assert one.batch_prompt_tokens == 3 * one.prompt_tokens
    pairs = routed(SCORE, {"model": "kimi-k3", first: ["q one", "q two"], second: ["d one", "d two"]})
    assert pairs.batch_prompt_tokens == 2 * pairs.prompt_tokens


def test_score_needs_two_sides() -> None:
    assert refusal(SCORE, {"model": "kimi-k3", "text_1": "only one"}).status == 400
    assert refusal(SCORE, {"model": "kimi-k3", "text_1": "a", "items": ["b"]}).status == 400


def test_the_lower_bound_refuses_an_input_no_pool_holds_before_validation() -> None:
    huge = "x" * (8 * 8192 + 64)  # more characters than 8192 tokens can be, at 8 a token at most
    for api, payload in [(EMBEDDINGS, {"model": "kimi-k3", "input": ["short", huge]}),
                         (EMBEDDINGS, {"model": "kimi-k3", "input": [[1] * 8193]}),
                         (RERANK, {"model": "kimi-k3", "query": "q", "documents": [huge]}),
                         (SCORE, {"model": "kimi-k3", "text_1": huge, "text_2": "d"})]:
        with pytest.raises(ContextLengthExceeded) as info:
            PARSER.decode(api, orjson.dumps({**payload, "model": 5}))  # refused before the model is even read
        assert info.value.param == dialect_for(api).prompt_param or info.value.param == "input"
    # A batch of many inputs, each of which fits, is not refused for their sum.
    PARSER.decode(EMBEDDINGS, orjson.dumps({"model": "kimi-k3", "input": ["x" * 8000] * 20}))


def test_a_token_id_batch_over_the_limit_is_refused() -> None:
    config = parse_config({"pools": POOLS, "max_prompt_ids": 10}, environ={})
    with pytest.raises(InvalidRequest) as info:
        BodyParser(config).decode(EMBEDDINGS, orjson.dumps({"model": "kimi-k3", "input": [[1] * 6, [2] * 6]}))
    assert info.value.param == "input"


def test_only_pools_listing_the_pooling_apis_serve_them() -> None:
    gen, embed = CONFIG.pools
    for api in POOLING_APIS:
        assert not serves(gen, api) and serves(embed, api)
    assert serves(gen, CHAT) and not serves(embed, CHAT)  # `apis` lists what a pool serves, all of it
    request = routed(EMBEDDINGS, {"model": "kimi-k3", "input": "hi"})
    assert [p.name for p in fitting_pools(request, CONFIG.pools)] == ["embed"]
    with pytest.raises(ApiNotServed) as info:
        fitting_pools(request, [gen])
    assert info.value.status == 404


@pytest.mark.parametrize("offloaded", [False, True])
def test_the_engine_gets_the_body_as_sent_with_the_served_model_name(offloaded: bool) -> None:
    payload = {"model": "kimi-k3", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8,
               "stream": True, "extra_body_field": [1, {"deep": None}], "max_tokens": None}
    encoded = ForwardBody.of(payload, "served-embedder", False) if offloaded else payload
    body = orjson.loads(encode_for(encoded, "served-embedder", False))
    assert body == {"model": "served-embedder", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8,
                    "stream": True, "extra_body_field": [1, {"deep": None}]}


def test_a_parse_process_routes_a_pooling_body_to_its_pool() -> None:
    parsed = PARSER.parse(SCORE, orjson.dumps({"model": "kimi-k3", "text_1": "a", "text_2": ["b", "c"]}), None, None)
    assert parsed.request is not None and parsed.forward is not None
    assert orjson.loads(parsed.forward.first)["model"] == "served-embedder"


@pytest.mark.parametrize(("usage", "normal"), [
    ({"prompt_tokens": 12, "total_tokens": 12}, {"prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 12}),
    ({"prompt_tokens": 12, "total_tokens": 12, "completion_tokens": 0},
     {"prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 12}),
    ({"total_tokens": 30}, {"prompt_tokens": 30, "completion_tokens": 0, "total_tokens": 30}),  # vLLM's older rerank
    ({"prompt_tokens": "12"}, {}),
])
def test_the_engines_usage_in_the_names_the_quota_settles_by(usage: dict[str, Any], normal: dict[str, Any]) -> None:
    for api in POOLING_APIS:
        assert dialect_for(api).answer_usage(usage, False) == normal


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only"])
def test_a_binary_encoding_the_gateway_cannot_relay_is_refused_up_front(encoding: str) -> None:
    error = refusal(EMBEDDINGS, {"model": "kimi-k3", "input": "hi", "encoding_format": encoding})
    assert (error.status, error.param, error.code) == (400, "encoding_format", "unsupported_value")
    routed(EMBEDDINGS, {"model": "kimi-k3", "input": "hi", "encoding_format": "somethingnew"})  # the engine's to judge


def test_the_quota_settles_on_the_engines_prompt_tokens() -> None:
    request = routed(EMBEDDINGS, {"model": "kimi-k3", "input": ["some text"] * 4})
    record = RequestRecord(request_id="r", api=EMBEDDINGS, key="alice")
    record.usage = dialect_for(EMBEDDINGS).answer_usage({"prompt_tokens": 13, "total_tokens": 13}, False)
    assert quota_used(record, request, request.quota_tokens(1024), failed=False) == 13
    record.usage = dialect_for(RERANK).answer_usage({"total_tokens": 21}, False)  # vLLM's older rerank usage
    assert quota_used(record, request, request.quota_tokens(1024), failed=False) == 21


SHORT = [f"doc {i}" for i in range(200)]


@pytest.mark.parametrize(("api", "payload"), [
    (RERANK, {"query": "which one?", "documents": SHORT}),
    (SCORE, {"text_1": "which one?", "text_2": SHORT}),
    (SCORE, {"queries": SHORT, "documents": SHORT}),
    (EMBEDDINGS, {"input": SHORT}),
])
def test_a_pooling_reservation_covers_the_special_tokens_the_engine_adds(api: Any, payload: dict[str, Any]) -> None:
    """Many short inputs, each tokenized by the engine with its model's special tokens (the simulator
    as an XLM-RoBERTa cross-encoder: 4 a sequence): the key's reservation is at least what the engine
    then reports (and settles by); without the special tokens it was under half of it."""
    engine = SimWorkerState(SimConfig(engine="vllm", max_context_tokens=8192, pooling=True, pooling_special_tokens=4))
    answer = {RERANK: rerank_answer, SCORE: score_answer, EMBEDDINGS: embeddings_answer}[api]
    reply, _ = answer(engine, {"model": "kimi-k3", **payload})
    assert reply.status == 200, reply.body
    used = orjson.loads(reply.body)["usage"]["prompt_tokens"]
    request = routed(api, {"model": "kimi-k3", **payload})
    assert request.quota_tokens(1024) >= used, (request.quota_tokens(1024), used)
