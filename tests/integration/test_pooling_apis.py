"""The pooling APIs through a real gateway on loopback in front of simulated vLLM workers: the real
`openai` SDK's `embeddings.create` (floats, and base64 as the SDK asks by default), rerank and score
with httpx; only a pool listing them in `apis` gets them (the generative pool before it is skipped;
none: 404 `api_not_served`), under the served model name, counted by the key's request limit,
charged to its token quota from the input, in the metrics and access log like the other APIs."""

from __future__ import annotations

import base64
import json
import logging
import struct
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.pooling import embedding_vector, normalised
from tests.integration.auth.conftest import ALICE_KEY, auth_section, start_a_window_now
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
POOLING = ["embeddings", "rerank", "score"]
SERVED = "served-embedder"


def gateway(start_sim: StartSim, start_gateway: StartGateway, **settings: Any) -> tuple[RunningGateway, RunningSim,
                                                                                      RunningSim]:
    """A generative pool (first, so cheapest) and a pool of a pooling model serving the pooling APIs."""
    generative = start_sim("vllm")
    embedder = start_sim("vllm", pooling=True, served_model_names=[SERVED], embedding_dimensions=48)
    gw = start_gateway([pool("gen", "vllm", [generative.url], 131072),
                        pool("embed", "vllm", [embedder.url], 32768, apis=POOLING, served_model_name=SERVED)],
                       **settings)
    return gw, generative, embedder


def metric(gw: RunningGateway, name: str, **labels: str) -> float:
    """The sum of the gateway's `/metrics` samples of `name` whose labels include `labels` (0 when
    none), as a PromQL selector picks them (`tests/support.metric_sum`)."""
    return gw.metric(name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}")


def test_the_openai_sdk_embeds_through_the_gateway_in_floats_and_base64(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    gw, generative, embedder = gateway(start_sim, start_gateway)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    caplog.set_level(logging.INFO, logger="gateway.access")
    raw = client.embeddings.with_raw_response.create(model="kimi-k3", input=["hello", "world"],
                                                     encoding_format="float")
    floats = raw.parse()
    assert raw.headers["x-kimi-gateway-pool"] == "embed"
    assert raw.headers["x-kimi-gateway-skipped-pools"] == "gen"  # it fits, but does not serve embeddings
    assert [d.index for d in floats.data] == [0, 1] and len(floats.data[0].embedding) == 48
    assert floats.data[0].embedding == pytest.approx(embedding_vector(SERVED, b"hello", 48))
    assert floats.model == SERVED and floats.usage.prompt_tokens == floats.usage.total_tokens == 4
    # The SDK's default: it asks for base64 and decodes the float32 values itself.
    decoded = client.embeddings.create(model="kimi-k3", input=["hello", "world"])
    for mine, theirs in zip(decoded.data, floats.data, strict=True):
        assert mine.embedding == pytest.approx(theirs.embedding, abs=1e-6)
    short = client.embeddings.create(model="kimi-k3", input="hello", dimensions=8, encoding_format="float")
    assert short.data[0].embedding == pytest.approx(normalised(embedding_vector(SERVED, b"hello", 48)[:8]))
    ids = client.embeddings.create(model="kimi-k3", input=[[1, 2, 3], [4, 5]], encoding_format="float")
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 5
    bodies = [record.body for record in embedder.engine.records]
    assert [b["model"] for b in bodies] == [SERVED] * 4
    assert bodies[1]["encoding_format"] == "base64" and bodies[2]["dimensions"] == 8
    assert generative.engine.records == []
    assert metric(gw, "kimi_gateway_requests_total", api="embeddings", pool="embed", status_class="2xx") == 4
    assert metric(gw, "kimi_gateway_tokens_total", pool="embed", kind="prompt") == 4 + 4 + 2 + 5
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(e["api"], e["pool"], e["status"], e["usage"]["prompt_tokens"]) for e in lines][:1] == \
        [("embeddings", "embed", 200, 4)]
    client.close()


def test_a_base64_embedding_is_little_endian_float32(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw, _, _ = gateway(start_sim, start_gateway)
    got = httpx.post(gw.url + "/v1/embeddings",
                     json={"model": "kimi-k3", "input": "hello", "encoding_format": "base64"})
    assert got.status_code == 200, got.text
    raw = base64.b64decode(got.json()["data"][0]["embedding"])
    assert list(struct.unpack("<48f", raw)) == pytest.approx(embedding_vector(SERVED, b"hello", 48), abs=1e-6)


def test_rerank_and_score_through_the_gateway(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw, generative, embedder = gateway(start_sim, start_gateway)
    with httpx.Client(base_url=gw.url) as client:
        ranked = client.post("/v1/rerank", json={"model": "kimi-k3", "query": "a pool of workers",
                                                 "documents": ["an engine", "a pool of workers", "a policy"],
                                                 "top_n": 2})
        assert ranked.status_code == 200, ranked.text
        assert ranked.headers["x-kimi-gateway-pool"] == "embed"
        body = ranked.json()
        assert body["id"].startswith("rerank-") and len(body["results"]) == 2
        assert body["results"][0] == {"index": 1, "document": {"text": "a pool of workers", "multi_modal": None},
                                      "relevance_score": pytest.approx(1.0)}
        assert body["usage"]["prompt_tokens"] > 0
        scored = client.post("/v1/score", json={"model": "kimi-k3", "text_1": "same", "text_2": ["same", "other"]})
        assert scored.status_code == 200, scored.text
        data = scored.json()["data"]
        assert [d["index"] for d in data] == [0, 1] and data[0]["score"] == pytest.approx(1.0)
        assert data[1]["score"] < 0.99
        mismatched = client.post("/v1/score", json={"model": "kimi-k3", "text_1": ["a", "b"], "text_2": ["c"] * 3})
    assert mismatched.status_code == 400  # the engine's own refusal, in OpenAI's shape
    assert mismatched.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    assert [r.body["model"] for r in embedder.engine.records] == [SERVED] * 3 and generative.engine.records == []
    for api in ("rerank", "score"):
        assert metric(gw, "kimi_gateway_requests_total", api=api, pool="embed", status_class="2xx") == 1


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"model": "kimi-k3", "input": 5}, "input"),
    ("/v1/embeddings", {"model": "kimi-k3"}, None),
    ("/v1/rerank", {"model": "kimi-k3", "documents": ["a"]}, "query"),
    ("/v1/score", {"model": "kimi-k3", "text_1": "a"}, None),
])
def test_a_bad_body_is_a_400_in_openais_shape_and_reaches_no_engine(
        start_sim: StartSim, start_gateway: StartGateway, path: str, body: dict[str, Any], param: str | None) -> None:
    gw, _, embedder = gateway(start_sim, start_gateway)
    got = httpx.post(gw.url + path, json=body)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert embedder.engine.records == []


def test_an_engines_refusal_comes_back_in_openais_shape(start_sim: StartSim, start_gateway: StartGateway) -> None:
    gw, _, _ = gateway(start_sim, start_gateway)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="kimi-k3", input="hello", dimensions=0)
    assert "Dimensions must be greater than 0" in str(info.value)
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    assert missing.value.code == "model_not_found"
    client.close()


def test_no_pool_serving_the_api_is_a_404(start_sim: StartSim, start_gateway: StartGateway) -> None:
    generative = start_sim("vllm", pooling=True)  # it would answer; the pool does not say it serves them
    gw = start_gateway([pool("gen", "vllm", [generative.url], 131072)])
    for path, body in [("/v1/embeddings", {"model": "kimi-k3", "input": "hi"}),
                       ("/v1/rerank", {"model": "kimi-k3", "query": "q", "documents": ["d"]}),
                       ("/v1/score", {"model": "kimi-k3", "text_1": "a", "text_2": "b"})]:
        got = httpx.post(gw.url + path, json=body)
        assert got.status_code == 404, got.text
        assert got.json()["error"]["code"] == "api_not_served"
    assert generative.engine.records == []


@pytest.mark.parametrize("limiter", ["memory"])
def test_a_keys_limits_count_pooling_requests_and_their_input_tokens(
        start_sim: StartSim, start_gateway: StartGateway, limiter: str) -> None:
    gw, _, embedder = gateway(start_sim, start_gateway, auth=auth_section({"requests_per_minute": 3,
                                                                            "tokens_per_minute": 400}))
    start_a_window_now(gw)
    headers = {"authorization": f"Bearer {ALICE_KEY}"}
    with httpx.Client(base_url=gw.url, headers=headers) as client:
        assert httpx.post(gw.url + "/v1/embeddings", json={"model": "kimi-k3", "input": "hi"}).status_code == 401
        too_many_tokens = client.post("/v1/embeddings", json={"model": "kimi-k3", "input": "word " * 2000})
        assert too_many_tokens.status_code == 429, too_many_tokens.text  # its estimate alone is over the limit
        assert client.post("/v1/embeddings", json={"model": "kimi-k3", "input": "hi"}).status_code == 200
        assert client.post("/v1/rerank", json={"model": "kimi-k3", "query": "q", "documents": ["d"]}).status_code == 200
        refused = client.post("/v1/score", json={"model": "kimi-k3", "text_1": "a", "text_2": "b"})
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"  # the 4th request this minute
    assert len(embedder.engine.records) == 2


def test_a_rerank_the_engine_charges_past_the_keys_budget_is_refused_up_front(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A rerank of 100 one-word documents on a cross-encoder that wraps each (query, document) pair in
    4 special tokens (XLM-RoBERTa's `<s> q </s></s> d </s>`; the simulator's tokenizer does the same):
    the engine charges 600 tokens. A key with 400 tokens a minute is refused before the engine sees
    it, since the reservation counts the special tokens; without them it reserved 200, the engine
    ran it, and the key was charged three times its reservation, past its budget."""
    embedder = start_sim("vllm", pooling=True, served_model_names=[SERVED], pooling_special_tokens=4)
    gw = start_gateway([pool("embed", "vllm", [embedder.url], 32768, apis=POOLING, served_model_name=SERVED)],
                       auth=auth_section({"tokens_per_minute": 400}))
    start_a_window_now(gw)
    rerank = {"model": "kimi-k3", "query": "q", "documents": ["word"] * 100}
    with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ALICE_KEY}"}) as client:
        refused = client.post("/v1/rerank", json=rerank)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "tokens"
        assert embedder.engine.records == []
        served = client.post("/v1/rerank", json={**rerank, "documents": rerank["documents"][:30]})
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == 30 * (1 + 1 + 4)  # "q" 1, "word" 1, 4 special
