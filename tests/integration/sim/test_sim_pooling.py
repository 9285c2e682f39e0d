"""The simulator's pooling APIs over HTTP (gateway/sim/pooling.py): served only by a pooling worker,
in vLLM's shapes and words, recorded and faulted like its generation requests."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable

import httpx
import pytest

from gateway.sim.pooling import embedding_vector
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]


def test_a_generative_worker_does_not_serve_them(start_sim: StartSim) -> None:
    srv = start_sim("vllm")
    for path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
        assert httpx.post(srv.url + path, json={"model": "kimi-k3", "input": "x"}).status_code == 404


@pytest.mark.parametrize("engine", ["vllm", "sglang", "ascend"])
def test_embeddings_in_vllms_shape(start_sim: StartSim, engine: str) -> None:
    srv = start_sim(engine, pooling=True)
    got = httpx.post(srv.url + "/v1/embeddings", json={"model": "kimi-k3", "input": ["hello", "hello"],
                                                       "encoding_format": "base64", "dimensions": 16})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["object"] == "list" and body["id"].startswith("embd-") and body["model"] == "kimi-k3"
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    first, second = (list(struct.unpack("<16f", base64.b64decode(d["embedding"]))) for d in body["data"])
    assert first == second and sum(v * v for v in first) == pytest.approx(1.0, abs=1e-5)
    assert first[:4] != pytest.approx(embedding_vector("kimi-k3", b"hello", 64)[:4])  # renormalised after the cut
    record = srv.engine.records[0]
    assert record.path == "/v1/embeddings" and record.status == 200 and record.completed and record.prompt_tokens == 4


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/v1/embeddings", {"model": "kimi-k3", "input": "x", "encoding_format": "bytes"}, 400, "validation error"),
    ("/v1/embeddings", {"model": "kimi-k3", "input": "x", "dimensions": 0}, 400, "Dimensions must be greater than 0"),
    ("/v1/embeddings", {"model": "kimi-k3"}, 400, "Field required"),
    ("/v1/embeddings", {"model": "other", "input": "x"}, 404, "The model `other` does not exist."),
    ("/v1/embeddings", {"model": "kimi-k3", "input": "x" * 600}, 400, "maximum context length"),
    ("/v1/rerank", {"model": "kimi-k3", "query": "q", "documents": []}, 400,
     "At least one text_pair element must be given"),
    ("/v1/rerank", {"model": "kimi-k3", "query": "q", "documents": ["d"], "top_n": -1}, 400, "validation error"),
    ("/score", {"model": "kimi-k3", "queries": ["a", "b"], "documents": ["c"] * 3}, 400,
     "Input lengths must be either 1:1, 1:N or N:N"),
])
def test_the_engines_refusals(start_sim: StartSim, path: str, body: dict[str, object], status: int,
                              words: str) -> None:
    srv = start_sim("vllm", pooling=True, max_context_tokens=128)
    got = httpx.post(srv.url + path, json=body)
    assert got.status_code == status, got.text
    assert words in got.json()["error"]["message"]


def test_rerank_ranks_and_cuts_at_top_n_on_every_path(start_sim: StartSim) -> None:
    srv = start_sim("vllm", pooling=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        got = httpx.post(srv.url + path, json={"model": "kimi-k3", "query": "x", "documents": ["a", "b", "x", "c"],
                                               "top_n": 3}).json()
        scores = [r["relevance_score"] for r in got["results"]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True) and got["results"][0]["index"] == 2
        assert set(got["usage"]) == {"prompt_tokens", "total_tokens"}


def test_a_fault_fails_a_pooling_request_as_it_fails_a_generation(start_sim: StartSim) -> None:
    srv = start_sim("vllm", pooling=True, faults={"fail_status": 503, "fail_count": 1})
    failed = httpx.post(srv.url + "/v1/score", json={"model": "kimi-k3", "text_1": "a", "text_2": "b"})
    assert failed.status_code == 503
    served = httpx.post(srv.url + "/v1/score", json={"model": "kimi-k3", "text_1": "a", "text_2": "b"})
    assert served.status_code == 200 and served.json()["data"][0]["object"] == "score"
    assert [r.fault for r in srv.engine.records] == ["fail_status", None]
