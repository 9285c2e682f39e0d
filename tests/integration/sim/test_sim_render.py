"""vLLM's render and tokenize endpoints on the simulator: GenerateRequest shape, token ids that agree
with the usage count and the prefix cache, vLLM's error answers, and which engines serve them."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from gateway.sim.tokens import VOCAB_SIZE, output_text
from tests.support import RunningSim

StartSim = Callable[..., RunningSim]

CHAT_RENDER = "/v1/chat/completions/render"
TEXT_RENDER = "/v1/completions/render"
GENERATE_REQUEST_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}
"""Fields of vLLM's `GenerateRequest` (vllm/entrypoints/serve/disagg/protocol.py), the render routes'
response model."""
SHARED = "You are a careful assistant. " * 40  # 1,160 bytes: 18 full 16-token blocks at 4 bytes a token


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]


def test_chat_render_is_a_generate_request_whose_ids_match_the_usage(start_sim: StartSim) -> None:
    srv = start_sim()
    body = {"model": "kimi-k3", "messages": _messages("What is a KV cache?"), "max_tokens": 5}
    rendered = httpx.post(srv.url + CHAT_RENDER, json=body)
    assert rendered.status_code == 200
    assert rendered.headers["content-type"] == "application/json"
    out = rendered.json()
    assert set(out) == GENERATE_REQUEST_KEYS
    assert out["model"] == "kimi-k3" and out["stream"] is False and out["priority"] == 0
    assert out["sampling_params"]["max_tokens"] == 5
    ids = out["token_ids"]
    assert all(type(i) is int and 0 <= i < VOCAB_SIZE for i in ids)
    usage = httpx.post(srv.url + "/v1/chat/completions", json=body).json()["usage"]
    assert len(ids) == usage["prompt_tokens"]
    assert srv.engine.records[-1].path == "/v1/chat/completions"  # rendering served nothing: one record
    assert len(srv.engine.records) == 1


def test_shared_prefix_gives_shared_leading_ids_as_the_prefix_cache_sees_it(start_sim: StartSim) -> None:
    srv = start_sim(kv_capacity_tokens=100_000)
    first, second = (httpx.post(srv.url + CHAT_RENDER, json={"messages": _messages(q)}).json()["token_ids"]
                     for q in ("What is a KV cache?", "Why does prefill dominate TTFT?"))
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    # The second request's cached tokens (the prefix cache's view of the same bytes) are all in the
    # common prefix of the ids, and the ids part no later than one block after that.
    for question in ("What is a KV cache?", "Why does prefill dominate TTFT?"):
        usage = httpx.post(srv.url + "/v1/chat/completions",
                           json={"messages": _messages(question), "max_tokens": 1}).json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * 18 and cached <= common < cached + 16
    assert first[:common] == second[:common] and first != second


def test_completion_render_answers_one_generate_request_per_prompt(start_sim: StartSim) -> None:
    srv = start_sim()
    out = httpx.post(srv.url + TEXT_RENDER, json={"prompt": ["abcdefgh", SHARED], "max_tokens": 2}).json()
    assert isinstance(out, list) and len(out) == 2
    assert all(set(item) == GENERATE_REQUEST_KEYS for item in out)
    assert len(out[0]["token_ids"]) == 2 and len(out[1]["token_ids"]) == 290
    # Equal 4-byte pieces are equal tokens; a token-id prompt is its own ids.
    assert out[0]["token_ids"][0] == int.from_bytes(b"abcd", "little") % VOCAB_SIZE
    (ids_prompt,) = httpx.post(srv.url + TEXT_RENDER, json={"prompt": [5, 6, 7]}).json()
    assert ids_prompt["token_ids"] == [5, 6, 7]


def test_tokenize_answers_vllm_tokenize_response(start_sim: StartSim) -> None:
    srv = start_sim(max_context_tokens=4096)
    out = httpx.post(srv.url + "/tokenize", json={"model": "kimi-k3", "prompt": "abcdefgh"}).json()
    assert out == {"count": 2, "max_model_len": 4096, "tokens": out["tokens"], "token_strs": None}
    chat = httpx.post(srv.url + "/tokenize", json={"messages": _messages("hi")}).json()
    rendered = httpx.post(srv.url + CHAT_RENDER, json={"messages": _messages("hi")}).json()
    assert chat["tokens"] == rendered["token_ids"] and chat["count"] == len(rendered["token_ids"])


def test_detokenize_answers_vllm_detokenize_response(start_sim: StartSim) -> None:
    """vLLM's `/detokenize`: `{"prompt": text}`, one word per id here; ids must be ints >= 0 (its 400)."""
    srv = start_sim()
    out = httpx.post(srv.url + "/detokenize", json={"model": "kimi-k3", "tokens": [5, 6, 7]})
    assert out.status_code == 200 and out.json() == {"prompt": output_text(3, 5)}
    assert httpx.post(srv.url + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    bad = httpx.post(srv.url + "/detokenize", json={"tokens": [1, -2]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "Bad Request"
    assert "greater_than_equal" in bad.json()["error"]["message"]
    unknown = httpx.post(srv.url + "/detokenize", json={"model": "gpt-x", "tokens": [1]})
    assert unknown.status_code == 404
    legacy_sglang = start_sim(engine="sglang", api_version="legacy")
    assert httpx.post(legacy_sglang.url + "/detokenize", json={"tokens": [1]}).status_code == 404


def test_render_errors_have_vllm_shapes(start_sim: StartSim) -> None:
    srv = start_sim(max_context_tokens=64)
    bad_json = httpx.post(srv.url + CHAT_RENDER, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "BadRequestError"
    unknown = httpx.post(srv.url + CHAT_RENDER, json={"model": "gpt-x", "messages": _messages("hi")})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": "The model `gpt-x` does not exist. Valid aliases: kimi-k3.",
                                       "type": "NotFoundError", "param": "model", "code": 404}
    no_messages = httpx.post(srv.url + CHAT_RENDER, json={"messages": []})
    assert no_messages.status_code == 400 and "messages" in no_messages.json()["error"]["message"]
    too_long = httpx.post(srv.url + TEXT_RENDER, json={"prompt": "x" * 400})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "input_tokens"
    assert "maximum context length is 64 tokens" in too_long.json()["error"]["message"]
    bad_prompt = httpx.post(srv.url + "/tokenize", json={"prompt": [1, 2]})
    assert bad_prompt.status_code == 400
    for ids in ([5, -1], [[VOCAB_SIZE]]):  # ids are echoed: only vocabulary indices
        oov = httpx.post(srv.url + TEXT_RENDER, json={"prompt": ids})
        assert oov.status_code == 400, ids
        assert oov.json()["error"]["message"].endswith("is out of vocabulary")
    huge = httpx.post(srv.url + TEXT_RENDER, json={"prompt": [[2**70]]})  # beyond 64 bits: not an id
    assert huge.status_code == 400 and huge.json()["error"]["type"] == "BadRequestError"


def test_only_current_vllm_family_serves_render(start_sim: StartSim) -> None:
    body = {"messages": _messages("hi")}
    assert httpx.post(start_sim(engine="ascend").url + CHAT_RENDER, json=body).status_code == 200
    sglang = start_sim(engine="sglang")
    assert httpx.post(sglang.url + CHAT_RENDER, json=body).status_code == 404
    assert httpx.post(start_sim(engine="sglang", api_version="legacy").url + "/tokenize", json=body).status_code == 404
    legacy = start_sim(api_version="legacy")
    assert httpx.post(legacy.url + CHAT_RENDER, json=body).status_code == 404
    assert httpx.post(legacy.url + "/tokenize", json=body).status_code == 200
    assert httpx.get(start_sim().url + CHAT_RENDER).status_code == 405


def test_sglang_tokenize_and_detokenize_answer_sglang_shapes(start_sim: StartSim) -> None:
    """SGLang's own routes (python/sglang/srt/entrypoints/openai/serving_tokenize.py), also under /v1:
    `{"tokens", "count", "max_model_len"}` (lists for a list of prompts), `{"text"}`; no `messages`
    (its `TokenizeRequest` requires `prompt`: the validation error's 400); `model` is not checked."""
    srv = start_sim(engine="sglang", max_context_tokens=4096)
    vllm = start_sim(max_context_tokens=4096)
    one = httpx.post(srv.url + "/tokenize", json={"model": "any-name", "prompt": "abcdefgh"}).json()
    assert set(one) == {"tokens", "count", "max_model_len"} and one["count"] == 2 and one["max_model_len"] == 4096
    assert one["tokens"] == httpx.post(vllm.url + "/tokenize", json={"prompt": "abcdefgh"}).json()["tokens"]
    many = httpx.post(srv.url + "/v1/tokenize", json={"prompt": ["abcd", "abcdefgh"]}).json()
    assert many["count"] == [1, 2] and many["tokens"][1] == one["tokens"]
    refused = httpx.post(srv.url + "/tokenize", json={"messages": _messages("hi")})
    assert refused.status_code == 400 and refused.json()["object"] == "error"
    text = httpx.post(srv.url + "/detokenize", json={"tokens": [5, 6, 7]}).json()
    assert text == {"text": output_text(3, 5)}
    both = httpx.post(srv.url + "/v1/detokenize", json={"tokens": [[5], []]}).json()
    assert both == {"text": [output_text(1, 5), ""]}
    assert httpx.post(srv.url + "/detokenize", json={"tokens": "x"}).status_code == 400
