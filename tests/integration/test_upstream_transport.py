"""Issue 10 §1-§3: the gateway's transport to the engines. Dead pooled connections, hung and
black-holed workers, non-streaming budgets, and streams held until their first content."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway.sim.config import SimFaults
from tests.support import RunningGateway, RunningSim, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def sdk(gw: RunningGateway, **options: object) -> openai.OpenAI:
    """The real OpenAI SDK against the gateway; no SDK retries unless asked (they would hide errors)."""
    options.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=gw.v1, api_key="unused", **options)  # type: ignore[arg-type]


def ask(client: openai.OpenAI, stream: bool) -> tuple[str, str]:
    """One chat through the SDK: (the answer's text, the worker that served it)."""
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=stream)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    assert raw.headers["x-kimi-gateway-attempts"] == "1", raw.headers
    return text, raw.headers["x-kimi-gateway-worker"]


def ask_with_attempts(client: openai.OpenAI, stream: bool = False) -> tuple[str, str, str]:
    """One chat through the SDK: (the answer's text, the worker that served it, attempts)."""
    raw = client.chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=stream)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    return text, raw.headers["x-kimi-gateway-worker"], raw.headers["x-kimi-gateway-attempts"]


def wait_until(moment: float) -> None:
    """Let time pass up to `moment` (time.monotonic()): the idle gap is what these tests are about."""
    time.sleep(max(0.0, moment - time.monotonic()))


def worker_states(gw: RunningGateway) -> dict[str, dict[str, object]]:
    return {w["id"]: w for p in httpx.get(gw.url + "/admin/workers").json()["pools"] for w in p["workers"]}


# --- §1: a pooled connection the engine already closed ---------------------------------------------


def test_requests_after_the_engines_idle_close_are_resent_on_a_new_connection(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Engines that drop connections idle for 1.5 s; the pool keeps them 30 s (the old default):
    # every request 2 s later goes out on a connection the engine has closed.
    sims = [start_sim("vllm", keep_alive_s=1.5, idle_close_unannounced=True) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin",
                             upstream_keep_alive=30)], health={"interval": 60}, load={"enabled": False})
    client = sdk(gw)
    served = []
    for round_ in range(3):
        started = time.monotonic()
        for stream in (False, True):  # round robin: each worker gets one of each mode per round
            text, worker = ask(client, stream)
            assert len(text.split()) == 3
            served.append(worker)
        if round_ < 2:
            wait_until(started + 2.0)
    assert sorted(set(served)) == ["p/0", "p/1"]
    assert all(s.engine.idle_resets >= 1 for s in sims)  # the dead connections were met, and survived
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="ok"') == 6
    assert gw.metric("kimi_gateway_upstream_attempts_total{") == 6
    assert gw.metric("kimi_gateway_retries_total{") == 0
    for state in worker_states(gw).values():  # not held against the workers
        assert state["consecutive_failures"] == 0 and state["healthy"] and state["last_error"] is None, state


def test_the_pool_drops_idle_connections_before_the_engine_does(start_sim: StartSim,
                                                                start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", keep_alive_s=1.0, idle_close_unannounced=True)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072, upstream_keep_alive=0.6)],
                       health={"interval": 1.3, "timeout": 1.0}, load={"interval": 1.3})
    for i in range(3):
        started = time.monotonic()
        response = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "stream": i % 2 == 1}, timeout=10)
        assert response.status_code == 200 and response.headers["x-kimi-gateway-attempts"] == "1"
        if i < 2:
            wait_until(started + 1.3)  # idle past the engine's keep-alive
    # Requests, probes and scrapes never went out on a connection the engine had dropped: the
    # pool (and the probes' client) let go of them first.
    assert sim.engine.idle_resets == 0
    assert worker_states(gw)["p/0"]["failed_probes"] == 0


# --- §2: non-streaming requests and hung workers ------------------------------------------------------


def test_a_probe_that_finds_a_worker_black_holed_moves_its_waiting_requests(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    hole = start_sim("vllm", faults=SimFaults(black_hole=True))
    good = start_sim("vllm")
    # Default budgets (minutes): only the probe (every 0.5 s, 1 s timeout) can end the wait early.
    gw = start_gateway([pool("p", "vllm", [hole.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 0.5, "timeout": 1.0}, load={"enabled": False})
    client = sdk(gw)
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool_:
        answers = list(pool_.map(lambda _: ask_with_attempts(client), range(4)))
    assert time.monotonic() - started < 6
    assert all(worker == "p/1" for _, worker, _ in answers), answers
    assert sorted(attempts for _, _, attempts in answers) == ["1", "1", "2", "2"]  # two were moved
    assert all(len(text.split()) == 3 for text, _, _ in answers)
    hole.engine.wait_for(lambda: len(hole.engine.records) == 2 and all(r.aborted for r in hole.engine.records),
                         timeout=5)
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="moved",pool="p",worker="p/0"}') == 2
    assert worker_states(gw)["p/0"]["healthy"] is False


def test_a_streaming_request_moves_too_and_only_before_headers(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    hole = start_sim("vllm", faults=SimFaults(black_hole=True))
    slow = start_sim("vllm", ttft_s=3.0)  # headers at once, then a long prefill
    gw = start_gateway([pool("p", "vllm", [slow.url, hole.url], 131072, policy="round_robin")],
                       health={"interval": 0.3, "timeout": 0.5}, load={"enabled": False})
    client = sdk(gw)
    with ThreadPoolExecutor(2) as pool_:
        first = pool_.submit(ask_with_attempts, client, True)  # round robin: p/0, answered, prefilling
        slow.engine.wait_for(lambda: slow.engine.records or None, timeout=5)
        second = pool_.submit(ask_with_attempts, client, True)  # p/1, the hole, until its probe fails
        deadline = time.monotonic() + 5
        while gw.metric('kimi_gateway_upstream_attempts_total{outcome="moved"') < 1:
            assert time.monotonic() < deadline, "the waiting attempt was not moved"
            time.sleep(0.05)
        # Both now prefill on p/0, which starts failing its probes too: answered attempts stay.
        httpx.post(slow.url + "/sim/faults", json={"hang_health": True})
        while worker_states(gw)["p/0"]["healthy"]:
            assert time.monotonic() < deadline, "the slow worker's probe should fail"
            time.sleep(0.05)
        assert not first.done() and not second.done()
        results = [first.result(timeout=15), second.result(timeout=15)]
    assert [(worker, attempts) for _, worker, attempts in results] == [("p/0", "1"), ("p/0", "2")]
    assert all(len(text.split()) == 3 for text, _, _ in results)
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="moved"') == 1


def test_header_timeouts_of_non_streaming_requests_eject_the_worker(start_sim: StartSim,
                                                                   start_gateway: StartGateway) -> None:
    hung = start_sim("vllm", faults=SimFaults(hang_before_headers=True))  # its probes pass
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [hung.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 60, "passive_failures": 2, "ejection_base": 60},
                       # 2 s: the good worker answers well within it even on a loaded machine (a timeout on
                       # a worker that served others meanwhile is the request's own, answered 504 unretried)
                       timeouts={"first_byte_base": 1.0, "first_byte_per_1k_tokens": 0, "generation": 1.0,
                                 "generation_per_token": 0})
    served = []
    for _ in range(6):
        response = httpx.post(gw.v1 + "/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200, response.text
        served.append((response.headers["x-kimi-gateway-worker"], response.headers["x-kimi-gateway-attempts"]))
    assert all(worker == "p/1" for worker, _ in served)
    assert [a for _, a in served].count("2") == 2  # two header timeouts, then the worker is out
    assert served[-2:] == [("p/1", "1")] * 2
    state = worker_states(gw)["p/0"]
    assert state["ejected"] is True and state["healthy"] is True, state


def test_a_long_non_streaming_answer_gets_a_budget_for_its_output(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    # 300 tokens at 100 tokens/s: 3 s, twice the fixed 1.5 s; the default 0.1 s a token covers it.
    sim = start_sim("vllm", tpot_s=0.01)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       timeouts={"first_byte_base": 0.5, "first_byte_per_1k_tokens": 0, "generation": 1})
    client = sdk(gw, max_retries=2)
    answer = client.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=300)
    assert answer.usage is not None and answer.usage.completion_tokens == 300
    assert len(sim.engine.records) == 1


def test_a_504_after_the_answer_budget_tells_the_sdk_not_to_retry(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.01)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], health={"interval": 60},
                       timeouts={"first_byte_base": 0.3, "first_byte_per_1k_tokens": 0, "generation": 0.3,
                                 "generation_per_token": 0.001})  # 0.9 s for 300 tokens that take 3 s
    client = sdk(gw, max_retries=2)  # the SDK's default: it would retry a 504 twice
    try:
        client.chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "hi"}], max_tokens=300)
        raise AssertionError("the answer should not fit its budget")
    except openai.APIStatusError as exc:
        assert exc.status_code == 504 and exc.response.headers["x-should-retry"] == "false"
        assert exc.response.json()["error"]["code"] == "upstream_timeout"
    assert len(sim.engine.records) == 1  # one engine run, not three
    sim.engine.wait_for(lambda: sim.engine.records[0].aborted or None, timeout=5)


# --- §3: nothing reaches the client before the first content --------------------------------------------


def chunk(delta: dict[str, object] | None = None, finish: str | None = None, **extra: object) -> bytes:
    """One chat.completion.chunk event as vLLM writes it."""
    choice = {"index": 0, "delta": delta if delta is not None else {}, "logprobs": None, "finish_reason": finish}
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "kimi-k3",
               "choices": [choice], **extra}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})
DONE = b"data: [DONE]\n\n"


def raw_faults(chunks: list[bytes]) -> SimFaults:
    return SimFaults(raw_stream_chunks=SimFaults.encode_chunks(chunks))


def stream_raw(gw: RunningGateway, **body: object) -> httpx.Response:
    """A streamed chat read to its end (status, headers, the raw bytes in `.content`)."""
    with httpx.stream("POST", gw.v1 + "/chat/completions", json={**CHAT, "stream": True, **body},
                      timeout=15) as response:
        response.read()
    return response


def test_every_worker_dying_after_its_role_chunk_is_a_502_json_error(start_sim: StartSim,
                                                                     start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm", faults=SimFaults(drop_after_chunks=1)) for _ in range(2)]
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072)], health={"interval": 60})
    response = stream_raw(gw)
    assert response.status_code == 502, response.content
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "upstream_error"
    assert [len(s.engine.records) for s in sims] == [1, 1]
    with pytest.raises(openai.InternalServerError) as raised:  # the SDK sees an HTTP error, not a broken stream
        list(sdk(gw).chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "x"}],
                                             stream=True))
    assert raised.value.status_code == 502


def test_a_worker_dying_after_its_role_chunk_fails_over_unseen(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    faulty = start_sim("vllm", faults=SimFaults(drop_after_chunks=1))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [faulty.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 60, "passive_failures": 10})
    attempts = []
    for _ in range(4):
        response = stream_raw(gw)
        assert response.status_code == 200 and response.headers["x-kimi-gateway-worker"] == "p/1"
        body = response.content
        assert body.count(b'"role":"assistant"') == 1 and body.count(DONE) == 1 and body.endswith(DONE)
        assert b'"error"' not in body
        attempts.append(response.headers["x-kimi-gateway-attempts"])
    assert attempts.count("2") == len(faulty.engine.records) >= 2  # each one that met the faulty worker
    text, worker, _ = ask_with_attempts(sdk(gw), stream=True)
    assert len(text.split()) == 3 and worker == "p/1"


def test_contentless_events_then_an_end_fail_over(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # A comment, the role, an empty delta, an empty tool-call list, then a clean end without [DONE].
    quiet = start_sim("vllm", faults=raw_faults([b": ping\n\n", ROLE, chunk({}), chunk({"tool_calls": []})]))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [quiet.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 60})
    response = stream_raw(gw)
    assert response.status_code == 200
    assert (response.headers["x-kimi-gateway-worker"], response.headers["x-kimi-gateway-attempts"]) == ("p/1", "2")
    assert b": ping" not in response.content and response.content.count(b'"role":"assistant"') == 1
    assert gw.metric('kimi_gateway_upstream_attempts_total{outcome="protocol_error",pool="p",worker="p/0"}') == 1


def test_held_events_are_released_unchanged(start_sim: StartSim, start_gateway: StartGateway) -> None:
    events = [b": ping\n\n", ROLE, chunk({}), chunk({"reasoning_content": "Hm"}), chunk({"content": "Hi"}),
              chunk({"content": ""}, finish="stop"), DONE]
    sim = start_sim("vllm", faults=raw_faults(events))
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)])
    response = stream_raw(gw)
    assert response.status_code == 200 and response.content == b"".join(events)


def test_an_empty_answer_is_an_answer(start_sim: StartSim, start_gateway: StartGateway) -> None:
    # Role, then a finish with no text: nothing to hold for, no failover.
    events = [ROLE, chunk({"content": ""}, finish="length"), DONE]
    sim = start_sim("vllm", faults=raw_faults(events))
    other = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url, other.url], 131072, policy="round_robin")])
    response = stream_raw(gw)
    assert response.content == b"".join(events) and response.headers["x-kimi-gateway-attempts"] == "1"
    assert not other.engine.records


def test_an_error_event_before_content(start_sim: StartSim, start_gateway: StartGateway) -> None:
    broken = start_sim("vllm", faults=raw_faults([ROLE, b'data: {"error":{"message":"engine fault","code":500}}\n\n']))
    good = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [broken.url, good.url], 131072, policy="round_robin")],
                       health={"interval": 60})
    response = stream_raw(gw)
    assert (response.status_code, response.headers["x-kimi-gateway-attempts"]) == (200, "2")
    assert b"engine fault" not in response.content
    # An in-stream error with a 4xx code is the engine's answer to the request: the client gets it as one.
    refusing = start_sim("vllm", faults=raw_faults(
        [ROLE, b'data: {"error":{"message":"top_k must be positive","code":400}}\n\n']))
    gw2 = start_gateway([pool("p", "vllm", [refusing.url], 131072)])
    response = stream_raw(gw2)
    assert response.status_code == 400 and response.json()["error"]["message"] == "top_k must be positive"


STALLS = {"read": 0.5, "first_byte_base": 30, "first_byte_per_1k_tokens": 0}  # a gap limit far below the prefill budget


@pytest.mark.parametrize("held", [False, True], ids=["content-before-commit", "committed-while-prefilling"])
def test_a_stream_stalled_after_its_first_content_ends_at_the_gap_limit_not_the_prefill_budget(
        start_sim: StartSim, start_gateway: StartGateway, held: bool) -> None:
    # After the first content the longest silence is `timeouts.read`, whatever the first-byte budget
    # (60 s by default, more per 1K prompt tokens) the request was sent with. Held: the first content
    # comes after `hold_headers`, so the stream was committed (keep-alives) before it.
    stalled = start_sim("vllm", faults=SimFaults(stall_after_chunks=3), ttft_s=0.6 if held else 0.0)
    gw = start_gateway([pool("p", "vllm", [stalled.url], 131072)], health={"interval": 30, "timeout": 1.0},
                       timeouts={**STALLS, "hold_headers": 0.2, "keepalive_interval": 0.1})
    started = time.monotonic()
    with httpx.stream("POST", gw.v1 + "/chat/completions", timeout=20,
                      json={**CHAT, "max_tokens": 50, "stream": True}) as response:
        raw = b"".join(response.iter_raw())
    took = time.monotonic() - started
    assert response.status_code == 200
    assert b'"content"' in raw  # content reached the client before the stall
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert b'"error"' in events[-1] and b"[DONE]" not in raw, events[-1]
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_error", events[-1]
    assert took < 10, f"the stall was cut after {took:.1f}s, not at the 0.5 s gap limit"  # 30 s before the fix
    gw.wait_until_idle()
