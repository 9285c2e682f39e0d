"""Anthropic's Messages API end to end: the real `anthropic` SDK → gateway → simulated engines.

Routed like chat (same estimate, same pool boundaries, same prefix blocks), relayed byte for byte
with Anthropic's `event:` lines, failover before the first byte, abort on hang-up, Anthropic-shaped
errors and `x-api-key` auth.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from gateway.routing.tokens import TokenEstimator
from gateway.sim.config import SimFaults
from tests.integration.auth.conftest import ALICE_KEY, auth_section, start_a_window_now
from tests.integration.test_request_path import prompt_of_estimate
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
HELLO = [{"role": "user", "content": "Say hello."}]


def sdk(gw: RunningGateway, key: str = "unused", **kwargs: object) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def one_pool(start_sim: StartSim, start_gateway: StartGateway) -> tuple[RunningGateway, RunningSim]:
    sim = start_sim("vllm", max_context_tokens=131072, served_model_names=["moonshotai/Kimi-K3"])
    gw = start_gateway([pool("vllm-128k", "vllm", [sim.url], 131072, served_model_name="moonshotai/Kimi-K3")])
    return gw, sim


def test_messages_create_non_streaming(one_pool: tuple[RunningGateway, RunningSim]) -> None:
    gw, sim = one_pool
    raw = sdk(gw).messages.with_raw_response.create(model="kimi-k3", max_tokens=5, messages=HELLO,
                                                    system="You are terse.")
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and len(message.content[0].text.split()) == 5
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0
    assert raw.headers["x-kimi-gateway-pool"] == "vllm-128k" and raw.headers["x-kimi-gateway-attempts"] == "1"
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    sent = sim.engine.records[-1]
    assert sent.path == "/v1/messages"
    assert sent.body["model"] == "moonshotai/Kimi-K3" and sent.body["system"] == "You are terse."


def test_a_coding_agents_request_passes_unchanged(one_pool: tuple[RunningGateway, RunningSim]) -> None:
    """What a coding agent sends: `?beta=true`, beta headers, cache_control marks, tools, thinking,
    metadata; every field reaches the engine as sent (but `model`, the pool's served name)."""
    gw, sim = one_pool
    body = {
        "model": "kimi-k3", "max_tokens": 32, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Bash", "description": "Run a command", "cache_control": {"type": "ephemeral"},
                   "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
        "thinking": {"type": "enabled", "budget_tokens": 16}, "metadata": {"user_id": "session-1"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "List files.",
                                                   "cache_control": {"type": "ephemeral"}}]}],
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", gw.v1 + "/messages?beta=true", json=body, headers=headers) as response:
        assert response.status_code == 200
        assert b"event: message_stop" in response.read()
    sent = sim.engine.records[-1].body
    assert sent == {**body, "model": "moonshotai/Kimi-K3"}


def test_messages_create_streaming_relays_anthropics_events_in_order(
        one_pool: tuple[RunningGateway, RunningSim]) -> None:
    gw, _ = one_pool
    body = {"model": "kimi-k3", "max_tokens": 6, "messages": HELLO, "stream": True}
    with httpx.stream("POST", gw.v1 + "/messages", json=body) as response:
        lines = list(response.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event:")]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * 6,
                     "content_block_stop", "message_delta", "message_stop"]
    assert [line for line in lines if line][-2:] == ["event: message_stop", 'data: {"type":"message_stop"}']
    events = list(sdk(gw).messages.create(model="kimi-k3", max_tokens=6, messages=HELLO, stream=True))
    assert [e.type for e in events] == names  # message_stop is the last event, as vLLM 0.32 ends it
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert len(text.split()) == 6
    assert events[-2].usage.output_tokens == 6  # type: ignore[union-attr]


def test_messages_stream_helper_and_tokens_are_counted(one_pool: tuple[RunningGateway, RunningSim]) -> None:
    gw, sim = one_pool
    before = gw.metric('kimi_gateway_tokens_total{kind="completion",pool="vllm-128k"}')
    with sdk(gw).messages.stream(model="kimi-k3", max_tokens=4, messages=HELLO) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) == 4 and final.content[0].text == "".join(pieces)  # type: ignore[union-attr]
    # The gateway accounts the stream by Anthropic's usage (message_start + message_delta).
    gw.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="vllm-128k"}', lambda n: n - before == 4)
    prompt = gw.metric('kimi_gateway_tokens_total{kind="prompt",pool="vllm-128k"}')
    assert prompt == sim.engine.records[-1].prompt_tokens


def test_count_tokens_is_the_engines_count(one_pool: tuple[RunningGateway, RunningSim]) -> None:
    gw, sim = one_pool
    messages = [{"role": "user", "content": "How many tokens is this? " * 20}]
    counted = sdk(gw).messages.count_tokens(model="kimi-k3", messages=messages, system="Be exact.")  # type: ignore[arg-type]
    record = sim.engine.records[-1]
    assert record.path == "/v1/messages/count_tokens"
    assert counted.input_tokens == record.prompt_tokens > 100
    assert not any(r.path == "/v1/messages" for r in sim.engine.records)


def test_anthropic_stream_relayed_byte_for_byte(start_sim: StartSim, start_gateway: StartGateway) -> None:
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
             b'"role":"assistant","content":[],"model":"kimi-k3","stop_reason":null,"stop_sequence":null,'
             b'"usage":{"input_tokens":3,"output_tokens":0}}}\n\n')
    delta = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":"caf\xc3\xa9 \xe6\x9d\xb1"}}\n\n')
    kanji = delta.index(b"\xe6\x9d\xb1")
    chunks = [
        start[:30], start[30:],  # the held start, split mid-line
        b'event: ping\ndata: {"type":"ping"}\n\n',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n',
        delta[:kanji + 1], delta[kanji + 1:] + delta[:12], delta[12:],
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
        b'"stop_sequence":null},"usage":{"output_tokens":2}}\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ]
    sim = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(chunks)))
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = {"model": "kimi-k3", "max_tokens": 8, "messages": HELLO, "stream": True}
    with httpx.stream("POST", gw.v1 + "/messages", json=body) as response:
        received = b"".join(response.iter_raw())
        assert response.headers["content-type"].startswith("text/event-stream")
    assert received == b"".join(chunks)  # no error event appended: message_stop ended it
    gw.wait_for_metric('kimi_gateway_tokens_total{kind="completion",pool="p"}', lambda n: n == 2)
    assert gw.metric('kimi_gateway_tokens_total{kind="prompt",pool="p"}') == 3


def test_x_api_key_and_bearer_auth_on_a_keyed_gateway(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=auth_section(), load={"enabled": False})
    assert sdk(gw, ALICE_KEY).messages.create(model="kimi-k3", max_tokens=2, messages=HELLO).content
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token=ALICE_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="kimi-k3", messages=HELLO).input_tokens > 0  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        sdk(gw, ALICE_KEY + "x").messages.create(model="kimi-k3", max_tokens=2, messages=HELLO)
    assert wrong.value.status_code == 401
    assert wrong.value.body["type"] == "error"  # type: ignore[index]
    assert wrong.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert "x-api-key" not in json.dumps([r.headers for r in sim.engine.records]).lower()
    missing = httpx.post(gw.v1 + "/messages", json={"model": "kimi-k3", "max_tokens": 2, "messages": HELLO})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in missing.json()["error"]["message"], "the hint names Anthropic's header"
    empty = httpx.post(gw.v1 + "/messages", headers={"x-api-key": ""},
                       json={"model": "kimi-k3", "max_tokens": 2, "messages": HELLO})
    assert empty.status_code == 401 and "x-api-key" in empty.json()["error"]["message"]
    # The OpenAI endpoints keep OpenAI's shape, and take the key as x-api-key too.
    chat = httpx.post(gw.v1 + "/chat/completions", headers={"x-api-key": ALICE_KEY},
                      json={"model": "kimi-k3", "max_tokens": 2, "messages": HELLO})
    assert chat.status_code == 200
    assert len(sim.engine.records) == 3


def test_token_limit_is_settled_by_anthropics_usage(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=auth_section({"tokens_per_minute": 1000}),
                       load={"enabled": False}, affinity={"enabled": False})
    start_a_window_now(gw)
    client = sdk(gw, ALICE_KEY)
    for _ in range(2):
        client.messages.create(model="kimi-k3", max_tokens=400, messages=HELLO)
    assert client.messages.count_tokens(model="kimi-k3", messages=HELLO).input_tokens > 0  # type: ignore[arg-type]
    used = sum(r.prompt_tokens + r.completion_tokens_sent for r in sim.engine.records if r.path == "/v1/messages")
    with pytest.raises(anthropic.RateLimitError) as info:
        client.messages.create(model="kimi-k3", max_tokens=400, messages=HELLO)
    assert info.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert f"Used {used}," in info.value.message, "settled by the engine's usage; count_tokens charged nothing"
    assert int(info.value.response.headers["retry-after"]) >= 1


def _anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    assert body["request_id"] == response.headers["request-id"]
    assert set(body) == {"type", "error", "request_id"} and set(body["error"]) == {"type", "message"}
    message: str = body["error"]["message"]
    return message


def test_gateway_errors_are_anthropic_shaped(start_sim: StartSim, start_gateway: StartGateway,
                                             unused_port: int) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], max_body_bytes=100_000)
    url = gw.v1 + "/messages"
    assert "max_tokens" in _anthropic_error(httpx.post(url, json={"model": "kimi-k3", "messages": HELLO}),
                                            400, "invalid_request_error")
    bad_block = {"model": "kimi-k3", "max_tokens": 3, "messages": [{"role": "user", "content": [{"text": "x"}]}]}
    _anthropic_error(httpx.post(url, json=bad_block), 400, "invalid_request_error")
    _anthropic_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
                     400, "invalid_request_error")
    _anthropic_error(httpx.post(url, json={"model": "gpt-4", "max_tokens": 3, "messages": HELLO}),
                     404, "not_found_error")
    _anthropic_error(httpx.post(url, json={"model": "kimi-k3", "max_tokens": 3,
                                           "messages": [{"role": "user", "content": "x" * 200_000}]}),
                     413, "request_too_large")
    too_long = {"model": "kimi-k3", "max_tokens": 200_000, "messages": HELLO}
    assert "maximum context length" in _anthropic_error(httpx.post(url, json=too_long), 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk(gw).messages.create(model="kimi-k3", max_tokens=200_000, messages=HELLO, timeout=30)  # type: ignore[arg-type]
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert sim.engine.records == [], "the gateway refused them all itself"

    down = start_gateway([pool("p", "vllm", [f"http://127.0.0.1:{unused_port}"], 131072)])
    busy = httpx.post(down.v1 + "/messages", json={"model": "kimi-k3", "max_tokens": 3, "messages": HELLO})
    _anthropic_error(busy, 529, "overloaded_error")
    assert int(busy.headers["retry-after"]) >= 1
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        sdk(down).messages.create(model="kimi-k3", max_tokens=3, messages=HELLO)  # type: ignore[arg-type]
    assert overloaded.value.status_code == 529


def test_engine_errors_reach_the_client_anthropic_shaped(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", max_context_tokens=1000)
    # The gateway believes the pool is large, so the engine's own context check answers.
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    long_prompt = [{"role": "user", "content": "word " * 2000}]
    response = httpx.post(gw.v1 + "/messages", json={"model": "kimi-k3", "max_tokens": 10, "messages": long_prompt})
    assert "maximum context length" in _anthropic_error(response, 400, "invalid_request_error")
    assert sim.engine.records[-1].path == "/v1/messages"


def test_messages_routed_at_the_exact_pool_boundary(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """As the chat boundary test: a Messages request's estimate is its chat twin's, so the same
    prompt + max_tokens lands in the same pool, first time, and no other engine sees it."""
    sims = {"vllm-128k": start_sim("vllm", max_context_tokens=131072),
            "sglang-512k": start_sim("sglang", max_context_tokens=524288)}
    gw = start_gateway([pool("vllm-128k", "vllm", [sims["vllm-128k"].url], 131072),
                        pool("sglang-512k", "sglang", [sims["sglang-512k"].url], 524288)])
    estimator = TokenEstimator(gw.config.estimation)
    prompt_tokens = 131072 - 10000
    text = prompt_of_estimate(prompt_tokens, estimator)
    client = sdk(gw, timeout=60)

    def routed(max_tokens: int, stream: bool = False) -> str:
        before = {name: len(sim.engine.records) for name, sim in sims.items()}
        if stream:
            with client.messages.with_streaming_response.create(
                    model="kimi-k3", max_tokens=max_tokens, messages=[{"role": "user", "content": text}],
                    stream=True) as raw:
                headers = raw.headers
                assert [e.type for e in raw.parse()][-1] == "message_stop"
        else:
            raw = client.messages.with_raw_response.create(model="kimi-k3", max_tokens=max_tokens,
                                                           messages=[{"role": "user", "content": text}])
            headers = raw.headers
        assert headers["x-kimi-gateway-estimated-prompt-tokens"].startswith(f"{prompt_tokens};")
        assert headers["x-kimi-gateway-attempts"] == "1"
        chosen = headers["x-kimi-gateway-pool"]
        assert {n: len(s.engine.records) - before[n] for n, s in sims.items()} == {n: int(n == chosen) for n in sims}
        return chosen

    assert routed(10000) == "vllm-128k"            # prompt + max_tokens == the pool's context: fits
    assert routed(10001) == "sglang-512k"          # one token over: the next pool
    assert routed(10001, stream=True) == "sglang-512k"
    # The same conversation as chat is estimated the same.
    chat = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0).chat.completions.with_raw_response.create(
        model="kimi-k3", max_tokens=10000, messages=[{"role": "user", "content": text}])
    assert chat.headers["x-kimi-gateway-estimated-prompt-tokens"].startswith(f"{prompt_tokens};")


def test_pools_whose_engine_lacks_the_api_are_skipped(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A pool on an engine version without the Messages API (a legacy SGLang, `apis` without it)."""
    old, vllm = start_sim("sglang", api_version="legacy"), start_sim("vllm", max_context_tokens=524288)
    openai_only = ["chat", "completions"]
    gw = start_gateway([pool("sglang-old", "sglang", [old.url], 131072, apis=openai_only),
                        pool("vllm-512k", "vllm", [vllm.url], 524288)])
    raw = sdk(gw).messages.with_raw_response.create(model="kimi-k3", max_tokens=3, messages=HELLO)
    assert raw.headers["x-kimi-gateway-pool"] == "vllm-512k"
    assert raw.headers["x-kimi-gateway-skipped-pools"] == "sglang-old"
    assert raw.headers["x-kimi-gateway-attempts"] == "1"
    assert sdk(gw).messages.count_tokens(model="kimi-k3", messages=HELLO).input_tokens > 0  # type: ignore[arg-type]
    chat = httpx.post(gw.v1 + "/chat/completions", json={"model": "kimi-k3", "max_tokens": 3, "messages": HELLO})
    assert chat.headers["x-kimi-gateway-pool"] == "sglang-old" and "x-kimi-gateway-skipped-pools" not in chat.headers
    assert [r.path for r in old.engine.records] == ["/v1/chat/completions"]

    only_old = start_gateway([pool("sglang-old", "sglang", [old.url], 131072, apis=openai_only)])
    response = httpx.post(only_old.v1 + "/messages", json={"model": "kimi-k3", "max_tokens": 3, "messages": HELLO})
    message = _anthropic_error(response, 404, "not_found_error")
    assert "No pool of this gateway serves the messages API for the model `kimi-k3`" in message
    assert len(old.engine.records) == 1


def test_messages_chat_messages_conversation_hits_one_workers_prefix_cache(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """One conversation switching APIs turn by turn: its canonical form (system first, then the
    turns) is the same under both, so it keeps its worker and that worker's cached blocks."""
    sims = [start_sim("sglang", max_context_tokens=131072, kv_capacity_tokens=200_000) for _ in range(4)]
    gw = start_gateway([pool("p", "sglang", [s.url for s in sims], 131072, policy="prefix_affinity")],
                       load={"enabled": False})
    system = "You are Kimi, a careful assistant. Follow the house style guide to the letter. " * 40
    question = "Explain how a prefix cache saves prefill work, step by step. " * 40
    anthropic_client, chat_client = sdk(gw), openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)

    first = anthropic_client.messages.with_raw_response.create(
        model="kimi-k3", max_tokens=8, system=system, messages=[{"role": "user", "content": question}])
    worker = first.headers["x-kimi-gateway-worker"]
    answer = first.parse().content[0].text  # type: ignore[union-attr]
    gw.flush_affinity()

    history = [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "Now give an example. " * 30}]
    second = chat_client.chat.completions.with_raw_response.create(
        model="kimi-k3", max_tokens=8, messages=[{"role": "system", "content": system}, *history])  # type: ignore[list-item]
    assert (second.headers["x-kimi-gateway-worker"], second.headers["x-kimi-gateway-route-reason"]) == (
        worker, "affinity")
    reply = second.parse().choices[0].message.content or ""
    gw.flush_affinity()

    third = anthropic_client.messages.with_raw_response.create(
        model="kimi-k3", max_tokens=8, system=[{"type": "text", "text": system}],
        messages=[*history, {"role": "assistant", "content": [{"type": "text", "text": reply}]},  # type: ignore[list-item]
                  {"role": "user", "content": [{"type": "text", "text": "And a counter-example. " * 30}]}])
    assert (third.headers["x-kimi-gateway-worker"], third.headers["x-kimi-gateway-route-reason"]) == (
        worker, "affinity")
    index = int(worker.split("/")[1])
    served = sims[index].engine.records
    assert [r.path for r in served] == ["/v1/messages", "/v1/chat/completions", "/v1/messages"]
    # The engine found each earlier turn in its prefix cache: all but its last partial block and
    # the per-message template tokens (the simulator's blocks hold text only).
    assert served[1].cached_tokens >= served[0].prompt_tokens - 32
    assert served[2].cached_tokens >= served[1].prompt_tokens - 32
    assert all(not s.engine.records for i, s in enumerate(sims) if i != index)


def test_client_disconnect_mid_stream_aborts_the_engine_request(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.05)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    body = {"model": "kimi-k3", "max_tokens": 2000, "messages": HELLO, "stream": True}
    with httpx.stream("POST", gw.v1 + "/messages", json=body) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
    record = sim.engine.wait_for(lambda: next((r for r in sim.engine.records if r.aborted), None), timeout=5)
    assert record.path == "/v1/messages" and record.completion_tokens_sent < 2000


@pytest.mark.parametrize("status", [503, 500])
def test_failing_worker_before_first_byte_fails_over(start_sim: StartSim, start_gateway: StartGateway,
                                                     status: int) -> None:
    bad = start_sim("vllm", faults=SimFaults(fail_status=status))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")])
    client = sdk(gw)
    for stream in (False, True, False, True):
        raw = client.messages.with_raw_response.create(model="kimi-k3", max_tokens=2, messages=HELLO,
                                                       stream=stream)  # type: ignore[call-overload]
        assert raw.headers["x-kimi-gateway-worker"] == "p/1" and raw.status_code == 200
    assert len(good.engine.records) == 4
    assert bad.engine.records, "round robin must have tried the failing worker"


def test_error_event_before_content_fails_over(start_sim: StartSim, start_gateway: StartGateway) -> None:
    overloaded = [b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":'
                  b'{"input_tokens":1,"output_tokens":0}}}\n\n',
                  b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n']
    bad = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(overloaded)))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")])
    for _ in range(2):
        events = list(sdk(gw).messages.create(model="kimi-k3", max_tokens=2, messages=HELLO, stream=True))
        assert events[-1].type == "message_stop"
    assert len(good.engine.records) == 2 and bad.engine.records, "the error event made it fail over"


def test_failure_after_the_first_byte_is_one_anthropic_error_event(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", faults=SimFaults(drop_after_chunks=5))
    other = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072), pool("q", "vllm", [other.url], 131072)])
    body = {"model": "kimi-k3", "max_tokens": 50, "messages": HELLO, "stream": True}
    with httpx.stream("POST", gw.v1 + "/messages", json=body) as response:
        received = b"".join(response.iter_raw())
    events = [e for e in received.split(b"\n\n") if e]
    assert len(events) == 6
    name, data = events[-1].split(b"\n")
    assert name == b"event: error"
    assert json.loads(data.removeprefix(b"data: "))["error"]["type"] == "api_error"
    assert b"message_stop" not in received
    assert not other.engine.records, "no retry once bytes reached the client"
    with pytest.raises(anthropic.APIStatusError):
        list(sdk(gw).messages.create(model="kimi-k3", max_tokens=50, messages=HELLO, stream=True))


def test_a_large_messages_body_is_parsed_in_a_parse_process(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], parse_offload_bytes=1024)
    text = "A long document to read. " * 400
    raw = sdk(gw, timeout=60).messages.with_raw_response.create(
        model="kimi-k3", max_tokens=2, system="Summarise.", messages=[{"role": "user", "content": text}])
    assert raw.parse().content and raw.headers["x-kimi-gateway-attempts"] == "1"
    small = sdk(gw).messages.with_raw_response.create(model="kimi-k3", max_tokens=2, system="Summarise.",
                                                      messages=[{"role": "user", "content": text[:500]}])
    estimate = int(raw.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0])
    assert estimate > int(small.headers["x-kimi-gateway-estimated-prompt-tokens"].split(";")[0]) + 1000
    assert sim.engine.records[0].body["system"] == "Summarise." and sim.engine.records[0].body["model"] == "kimi-k3"
