"""Mid-stream migration (issue 23): a chat or text completion stream whose simulated vLLM or SGLang
worker fails after content reached the client goes on on another worker, and the client reads
the same answer an uninterrupted run gives (the simulator's answer is a function of the token's
position in the assistant's turn: `gateway/sim/tokens.py`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]

CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 24,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
TEXT = {"model": "kimi-k3", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
PATHS = {"chat": "/chat/completions", "completions": "/completions"}
FAULTS = {"reset": SimFaults(reset_after_chunks=8), "eof": SimFaults(drop_after_chunks=8),
          "in_band_error": SimFaults(error_after_chunks=8), "stall": SimFaults(stall_after_chunks=8)}
TIMEOUTS = {"read": 0.5, "first_byte_base": 0.5, "first_byte_per_1k_tokens": 0}  # the gap budget a stall runs past


def events_of(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[httpx.Response, list[bytes]]:
    with httpx.stream("POST", url, json=body, headers=headers, timeout=15) as response:
        raw = b"".join(response.iter_raw())
    return response, events_of(raw)


def chunks(events: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]


def text_of(api: str, events: list[bytes]) -> str:
    out = []
    for chunk in chunks(events):
        for choice in chunk.get("choices") or ():
            out.append((choice.get("delta") or {}).get("content") or "" if api == "chat" else choice.get("text") or "")
    return "".join(out)


def usage_of(events: list[bytes]) -> dict[str, Any]:
    usages = [c["usage"] for c in chunks(events) if c.get("usage")]
    assert len(usages) == 1, usages
    return usages[0]


def access_lines(caplog: pytest.LogCaptureFixture, gw: RunningGateway) -> list[dict[str, Any]]:
    """`gw`'s access log lines once there is one (the line is written as the request ends)."""
    deadline = time.monotonic() + 5
    while not (lines := [json.loads(r.getMessage()) for r in caplog.records
                         if r.name == "gateway.access" and r.threadName == gw.server.thread_name]):
        assert time.monotonic() < deadline, "no access log line"
        time.sleep(0.02)
    return lines


def setup(start_sim: StartSim, start_gateway: StartGateway, faults: SimFaults, engine: str = "vllm",
          **settings: Any) -> tuple[RunningSim, RunningSim, RunningGateway]:
    bad = start_sim(engine, faults=faults)
    good = start_sim(engine)
    gw = start_gateway([pool("p", engine, [bad.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0}, timeouts=TIMEOUTS, **settings)
    return bad, good, gw


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_stream_whose_worker_fails_mid_generation_reads_as_one_uninterrupted_answer(
        start_sim: StartSim, start_gateway: StartGateway, api: str, fault: str, engine: str) -> None:
    _, good, gw = setup(start_sim, start_gateway, FAULTS[fault], engine)
    body = CHAT if api == "chat" else TEXT
    _, reference = stream(good.url + "/v1" + PATHS[api], body)  # the uninterrupted run, on the engine itself
    response, events = stream(gw.v1 + PATHS[api], body)
    assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "p/0"
    assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events), events
    assert text_of(api, events) == text_of(api, reference)  # nothing repeated or lost at the seam
    assert len(text_of(api, events).split(" ")) == 24
    ids = {(c["id"], c["created"], c["model"]) for c in chunks(events)}
    assert len(ids) == 1, ids  # one stream: the first stream's id, created, model throughout
    if api == "chat":
        assert sum("role" in (c["choices"][0]["delta"] if c.get("choices") else {}) for c in chunks(events)) == 1
    kept = 7 if api == "chat" else 8  # 8 events relayed; a chat stream's first is its role chunk
    seams = [e for e in events if e.startswith(b": x-kimi-gateway-migrated")]
    assert seams == [f": x-kimi-gateway-migrated from=p/0 to=p/1 kept_tokens={kept}".encode()], events
    assert usage_of(events) == {**usage_of(reference), "total_tokens": usage_of(reference)["total_tokens"]}
    # The continuation asked the right thing of the other worker.
    continued = good.engine.records[-1].body
    if api == "chat":
        assert continued["continue_final_message"] is True and continued["add_generation_prompt"] is False
        assert continued["messages"][-1]["role"] == "assistant"
        assert continued["messages"][:-1] == CHAT["messages"]
    else:
        assert continued["prompt"].startswith(TEXT["prompt"]) and len(continued["prompt"]) > len(TEXT["prompt"])
    assert continued["max_tokens"] == 24 - kept and continued["temperature"] == 0
    gw.wait_for_metric('kimi_gateway_migrations_total{outcome="migrated",pool="p"}', lambda v: v == 1)
    # Billed once: the original prompt and every generated token; the re-prefill apart.
    reference_usage = usage_of(reference)
    assert gw.wait_for_metric('kimi_gateway_tokens_total{kind="prompt",pool="p"}', lambda v: v > 0) \
        == reference_usage["prompt_tokens"]
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="p"}') == 24
    assert gw.metric('kimi_gateway_migration_prefill_tokens_total{pool="p"}') == reference_usage["prompt_tokens"] + kept
    gw.wait_until_idle()


def test_the_client_can_opt_out_and_gets_the_error_event(start_sim: StartSim, start_gateway: StartGateway) -> None:
    _, good, gw = setup(start_sim, start_gateway, FAULTS["eof"])
    _, events = stream(gw.v1 + "/chat/completions", CHAT, {"x-kimi-gateway-migrate": "off"})
    assert b'"error"' in events[-1] and b"[DONE]" not in b"".join(events)
    assert good.engine.records == []
    assert gw.metric("kimi_gateway_migrations_total") == 0


def test_migration_off_in_the_config_gives_the_error_event(start_sim: StartSim, start_gateway: StartGateway) -> None:
    _, good, gw = setup(start_sim, start_gateway, FAULTS["eof"], migration={"max_per_request": 0})
    _, events = stream(gw.v1 + "/chat/completions", CHAT)
    assert b'"error"' in events[-1] and good.engine.records == []


def test_a_pool_with_migrate_off_gives_the_error_event_and_others_still_migrate(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    # `migrate: false` on a pool: a stream failing there ends as before migration (one SSE error
    # event, no continuation); the next pool, with the default, still migrates its streams.
    caplog.set_level(logging.INFO, logger="gateway.access")
    bad, good = start_sim("vllm", faults=FAULTS["eof"], max_context_tokens=2048), \
        start_sim("vllm", max_context_tokens=2048)
    big_bad, big_good = start_sim("vllm", faults=FAULTS["eof"]), start_sim("vllm")
    gw = start_gateway([pool("off", "vllm", [bad.url, good.url], 2048, policy="round_robin", migrate=False),
                        pool("on", "vllm", [big_bad.url, big_good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0}, timeouts=TIMEOUTS)
    _, events = stream(gw.v1 + "/chat/completions", CHAT)
    assert b'"error"' in events[-1] and b"[DONE]" not in b"".join(events)
    assert good.engine.records == [] and not any(e.startswith(b": x-kimi-gateway-migrated") for e in events)
    assert "migration" not in access_lines(caplog, gw)[-1]
    assert gw.metric("kimi_gateway_migrations_total") == 0
    long = {**CHAT, "messages": [{"role": "user", "content": "a long story " * 1000}]}  # fits only the second pool
    _, events = stream(gw.v1 + "/chat/completions", long)
    assert events[-1] == b"data: [DONE]" and big_good.engine.records[-1].body["continue_final_message"] is True
    assert gw.wait_for_metric('kimi_gateway_migrations_total{outcome="migrated",pool="on"}', lambda v: v == 1)


def test_one_migration_per_request_then_the_error_event(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm") for _ in range(3)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0})
    body = {**CHAT, "x_sim_faults": {"drop_after_chunks": 5}}  # every worker fails it
    _, events = stream(gw.v1 + "/chat/completions", body)
    assert b'"error"' in events[-1] and b"[DONE]" not in b"".join(events)
    assert sum(len(s.engine.records) for s in sims) == 2  # the first worker and one continuation
    text = text_of("chat", events)
    assert text.split(" ")[:8] == ["Kimi", "café", "naïve", "東京", "routes", "Zürich", "tokens", "🚀"]
    assert gw.metric('kimi_gateway_migrations_total{outcome="migrated",pool="p"}') == 1


STRADDLING_STOP = {"stop": ["tokens 🚀 façade"], "include_stop_str_in_output": True}  # the text kept ends in "tokens"


@pytest.mark.parametrize(("extra", "why"), [({"logprobs": True}, "logprobs were asked for"), ({"n": 2}, "n > 1"),
                                            (STRADDLING_STOP, "a stop sequence may straddle the seam")])
def test_a_stream_not_at_a_safe_point_is_not_migrated(start_sim: StartSim, start_gateway: StartGateway,
                                                       caplog: pytest.LogCaptureFixture, extra: dict[str, Any],
                                                       why: str) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    _, good, gw = setup(start_sim, start_gateway, FAULTS["eof"])
    _, events = stream(gw.v1 + "/chat/completions", {**CHAT, **extra})
    assert b'"error"' in events[-1] and good.engine.records == []
    assert gw.wait_for_metric('kimi_gateway_migrations_total{outcome="refused",pool="p"}', lambda v: v == 1)
    assert access_lines(caplog, gw)[-1]["migration"] == {"from": "p/0", "outcome": "refused", "why": why}


def test_a_stop_sequence_not_straddling_the_seam_keeps_migration(start_sim: StartSim,
                                                                 start_gateway: StartGateway) -> None:
    _, good, gw = setup(start_sim, start_gateway, FAULTS["eof"])
    body = {**CHAT, "stop": ["Ωmega façade"], "include_stop_str_in_output": True}
    _, events = stream(gw.v1 + "/chat/completions", body)
    assert events[-1] == b"data: [DONE]" and good.engine.records[-1].body["stop"] == ["Ωmega façade"]


def test_a_half_sent_tool_call_is_not_migrated(start_sim: StartSim, start_gateway: StartGateway) -> None:
    call = {"index": 0, "id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a'}}
    tool = b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "kimi-k3",
                                   "choices": [{"index": 0, "delta": {"tool_calls": [call]},
                                                "finish_reason": None}]}).encode() + b"\n\n"
    bad = start_sim("vllm", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks([tool])))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0})
    _, events = stream(gw.v1 + "/chat/completions", CHAT)
    assert b'"error"' in events[-1] and good.engine.records == []


def test_the_simulator_continues_a_final_assistant_message(start_sim: StartSim) -> None:
    sim = start_sim("vllm")
    whole = httpx.post(sim.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=5).json()
    text = whole["choices"][0]["message"]["content"]
    head = " ".join(text.split(" ")[:5])
    body = {**CHAT, "stream": False, "max_tokens": 19, "continue_final_message": True, "add_generation_prompt": False,
            "messages": [*CHAT["messages"], {"role": "assistant", "content": head}]}
    rest = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=5).json()
    assert head + rest["choices"][0]["message"]["content"] == text
    assert rest["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + 5
    both = httpx.post(sim.url + "/v1/chat/completions", json={**body, "add_generation_prompt": True}, timeout=5)
    assert both.status_code == 400 and "Cannot set both" in both.text
    default = httpx.post(sim.url + "/v1/chat/completions", json={k: v for k, v in body.items()
                                                                 if k != "add_generation_prompt"}, timeout=5)
    assert default.status_code == 400 and "not compatible" in default.text


def test_the_sglang_simulator_continues_a_final_assistant_message_as_sglang_does(start_sim: StartSim) -> None:
    # SGLang's serving_chat.py `_handle_last_assistant_message`: with `continue_final_message` a
    # final assistant message with string content is the answer's start (no flag check, its
    # `add_generation_prompt` member does not exist); list content is left as a turn of its own.
    sim = start_sim("sglang")
    whole = httpx.post(sim.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=5).json()
    text = whole["choices"][0]["message"]["content"]
    head = " ".join(text.split(" ")[:5])
    body = {**CHAT, "stream": False, "max_tokens": 19, "continue_final_message": True,
            "messages": [*CHAT["messages"], {"role": "assistant", "content": head}]}
    for flags in ({}, {"add_generation_prompt": False}, {"add_generation_prompt": True}):
        rest = httpx.post(sim.url + "/v1/chat/completions", json={**body, **flags}, timeout=5).json()
        assert head + rest["choices"][0]["message"]["content"] == text, flags
    parts = {**body, "messages": [*CHAT["messages"], {"role": "assistant", "content": [{"type": "text",
                                                                                       "text": head}]}]}
    fresh = httpx.post(sim.url + "/v1/chat/completions", json=parts, timeout=5).json()
    assert fresh["choices"][0]["message"]["content"].startswith(text.split(" ")[0] + " ")  # a new turn


def test_a_stream_that_relayed_reasoning_is_not_migrated_on_sglang(start_sim: StartSim, start_gateway: StartGateway,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")

    def chunk(delta: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                                       "model": "kimi-k3", "choices": [{"index": 0, "delta": delta,
                                                                        "finish_reason": None}]}).encode() + b"\n\n"
    raw = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Let me think"}),
           chunk({"content": "Kimi"})]
    bad = start_sim("sglang", faults=SimFaults(raw_stream_chunks=SimFaults.encode_chunks(raw)))
    good = start_sim("sglang")
    gw = start_gateway([pool("p", "sglang", [bad.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0})
    _, events = stream(gw.v1 + "/chat/completions", CHAT)
    assert b'"error"' in events[-1] and good.engine.records == []
    assert access_lines(caplog, gw)[-1]["migration"]["why"] == "SGLang does not continue reasoning"


def test_the_access_log_says_it_and_the_key_is_billed_once_without_usage_asked(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    # No `include_usage`: the gateway's usage patch asks both engines for it and strips it; the
    # record's usage (what the key is charged) is still the whole answer's, counted once.
    caplog.set_level(logging.INFO, logger="gateway.access")
    _, good, gw = setup(start_sim, start_gateway, FAULTS["eof"])
    body = {k: v for k, v in CHAT.items() if k != "stream_options"}
    _, reference = stream(good.url + "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    _, events = stream(gw.v1 + "/chat/completions", body)
    assert not any(c.get("usage") for c in chunks(events))  # none asked, none sent
    assert text_of("chat", events) == text_of("chat", reference)
    entry = access_lines(caplog, gw)[-1]
    expected = usage_of(reference)
    assert entry["usage"]["prompt_tokens"] == expected["prompt_tokens"]
    assert entry["usage"]["completion_tokens"] == expected["completion_tokens"] == 24
    assert entry["migration"] == {"from": "p/0", "to": "p/1", "outcome": "migrated", "kept_tokens": 7, "count": 1,
                                  "prefill_tokens": expected["prompt_tokens"] + 7,
                                  "why": entry["migration"]["why"]}
    assert entry["outcome"] == "ok" and entry["attempts"] == 2 and entry["worker"] == "p/1"


def test_a_second_failure_continues_again_when_the_config_allows_two(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Every attempt drops after 10 events (per-request faults reach every worker): 9 tokens kept from
    # the first, 9 more from the first continuation, the last 6 from the second, which ends.
    sims = [start_sim("vllm") for _ in range(4)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0}, migration={"max_per_request": 3})
    _, reference = stream(sims[0].url + "/v1/chat/completions", CHAT)
    _, events = stream(gw.v1 + "/chat/completions", {**CHAT, "x_sim_faults": {"drop_after_chunks": 10}})
    assert events[-1] == b"data: [DONE]" and text_of("chat", events) == text_of("chat", reference)
    seams = [e for e in events if e.startswith(b": x-kimi-gateway-migrated")]
    assert [s.split(b" kept_tokens=")[1] for s in seams] == [b"9", b"18"], seams  # tokens kept in all
    assert seams[1].startswith(b": x-kimi-gateway-migrated from=" + seams[0].split(b" to=")[1].split(b" ")[0])
    last = [r.body for s in sims for r in s.engine.records if r.body.get("max_tokens") == 24 - 18]
    assert len(last) == 1
    assert [m["role"] for m in last[0]["messages"]] == ["user", "assistant"]  # one growing assistant turn
    assert last[0]["messages"][-1]["content"] == " ".join(text_of("chat", reference).split(" ")[:18])
    assert usage_of(events)["completion_tokens"] == 24
    assert usage_of(events)["prompt_tokens"] == usage_of(reference)["prompt_tokens"]
    assert len({c["id"] for c in chunks(events)}) == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_non_streamed_answer_cut_while_read_is_answered_whole_by_another_worker(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture, api: str,
        engine: str) -> None:
    # Nothing of a non-streamed answer reaches the client before its end, so a cut one is a plain
    # failover (the attempt failed), not a migration: the client gets one whole answer.
    caplog.set_level(logging.INFO, logger="gateway.access")
    _, good, gw = setup(start_sim, start_gateway, SimFaults(cut_answer=True), engine)
    body = {**(CHAT if api == "chat" else TEXT), "stream": False}
    body.pop("stream_options")
    reference = httpx.post(good.url + "/v1" + PATHS[api], json=body, timeout=5).json()
    response = httpx.post(gw.v1 + PATHS[api], json=body, timeout=15)
    assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "p/1"
    answer = response.json()
    pick = (lambda a: a["choices"][0]["message"]["content"]) if api == "chat" else \
        (lambda a: a["choices"][0]["text"])
    assert pick(answer) == pick(reference) and answer["usage"] == reference["usage"]
    entry = access_lines(caplog, gw)[-1]
    assert entry["outcome"] == "ok" and entry["attempts"] == 2 and "migration" not in entry
    assert gw.metric("kimi_gateway_migrations_total") == 0
    assert gw.metric('kimi_gateway_tokens_total{kind="completion",pool="p"}') == 24


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("how", ["drained", "ejected"])
def test_a_worker_drained_or_ejected_mid_stream_keeps_it_until_its_engine_dies_then_it_migrates(
        start_sim: StartSim, start_gateway: StartGateway, engine: str, how: str) -> None:
    # Draining or ejecting a worker stops new requests, not the streams it serves: the stream goes
    # on there; when its engine then goes away (a reset), it migrates to the healthy worker.
    bad = start_sim(engine, tpot_s=0.02, faults=SimFaults(reset_after_chunks=12))
    good = start_sim(engine)
    gw = start_gateway([pool("p", engine, [bad.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0, "passive_failures": 1})
    _, reference = stream(good.url + "/v1/chat/completions", CHAT)
    state = gw.server.app.state.gateway
    assert state is not None
    worker = next(w for w in state.registry if w.id == "p/0")

    async def eject() -> None:  # what outlier ejection does once a worker's failures reach the threshold
        state.registry.request_failed(worker, "failed elsewhere")

    with httpx.stream("POST", gw.v1 + "/chat/completions", json=CHAT, timeout=15) as response:
        assert response.headers["x-kimi-gateway-worker"] == "p/0"
        raw = response.iter_raw()
        first = next(raw)
        if how == "drained":
            assert httpx.post(gw.url + "/admin/workers/p/0/drain", timeout=5).json()["draining"] is True
        else:
            gw.server.call(eject())
            assert worker.ejected_until > 0
        body = first + b"".join(raw)
    events = events_of(body)
    assert events[-1] == b"data: [DONE]" and text_of("chat", events) == text_of("chat", reference)
    seams = [e for e in events if e.startswith(b": x-kimi-gateway-migrated")]
    assert seams == [b": x-kimi-gateway-migrated from=p/0 to=p/1 kept_tokens=11"], seams  # p/0 served until it died
    assert bad.engine.records[0].fault == "reset_after_chunks" and len(bad.engine.records) == 1
    assert good.engine.records[-1].body["continue_final_message"] is True


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_stream_of_several_tokens_a_chunk_is_continued_to_its_output_limit_exactly(
        start_sim: StartSim, start_gateway: StartGateway, api: str) -> None:
    # vLLM's --stream-interval 4 (or a loaded API server) puts 4 tokens in a chunk: the kept text is
    # counted by the engine's /tokenize, not one token a chunk, so the migrated answer stops at max_tokens.
    bad = start_sim("vllm", faults=SimFaults(reset_after_chunks=3), stream_interval=4)
    good = start_sim("vllm", stream_interval=4)
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 30, "timeout": 1.0}, timeouts=TIMEOUTS)
    body = {k: v for k, v in (CHAT if api == "chat" else TEXT).items() if k != "stream_options"}
    _, reference = stream(good.url + "/v1" + PATHS[api], body)
    response, events = stream(gw.v1 + PATHS[api], body)
    assert response.headers["x-kimi-gateway-worker"] == "p/0"
    kept = 8 if api == "chat" else 12  # whole chunks of 4 relayed (a chat stream's first is its role chunk)
    seams = [e for e in events if e.startswith(b": x-kimi-gateway-migrated")]
    assert seams == [f": x-kimi-gateway-migrated from=p/0 to=p/1 kept_tokens={kept}".encode()], events
    assert text_of(api, events) == text_of(api, reference) and len(text_of(api, events).split(" ")) == 24
    assert good.engine.records[-1].body["max_tokens"] == 24 - kept
    gw.wait_until_idle()
