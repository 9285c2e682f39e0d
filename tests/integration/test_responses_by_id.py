"""`GET/DELETE/POST …/cancel /v1/responses/{id}` (issue 12): recorded like proxied requests (the access
log line, `kimi_gateway_requests_total{api=responses_get|…}`), counted against a key's request limit,
and `GET ?stream=true` relayed byte-exact as SSE when the engine replays a stream (vLLM 0.32 replays
a background stream only, so the replay tests create theirs with `background=True`). The real openai
SDK against the simulator."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import httpx
import openai
import orjson
import pytest

from gateway.auth.keys import hash_key
from gateway.auth.limits import MemoryRateLimiter
from gateway.sim.config import SimFaults
from gateway.sim.responses_api import Replay
from tests.support import RunningGateway, RunningSim, access_lines, pool

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
KEY = "sk-carol-" + uuid.uuid4().hex + uuid.uuid4().hex


def sdk(gw: RunningGateway, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)


def ended_replays(sim: RunningSim, count: int) -> list[Replay]:
    """The sim's `GET ?stream=true` replays once `count` of them have ended (completed or aborted)."""
    deadline = time.monotonic() + 5
    while True:
        replays = list(sim.app.responses.replays)
        if sum(r.aborted or r.completed for r in replays) >= count:
            return replays
        assert time.monotonic() < deadline, f"{len(replays)} replays, fewer than {count} ended"
        time.sleep(0.02)


def test_id_calls_are_logged_and_counted(start_sim: StartSim, start_gateway: StartGateway,
                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm", max_context_tokens=131072, responses_delete=True)  # a server that deletes
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    c = sdk(gw)
    created = c.responses.create(model="kimi-k3", input="Hi", max_output_tokens=2)
    raw = c.responses.with_raw_response.retrieve(created.id, extra_headers={"x-request-id": "get-1"})
    assert raw.headers["x-request-id"] == "get-1"
    with pytest.raises(openai.BadRequestError):  # the simulator, like vLLM, cannot cancel a finished response
        c.responses.cancel(created.id)
    c.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(created.id)
    lines = access_lines(caplog, gw, 5)
    by_api = [(line["api"], line["status"], line["outcome"], line["pool"], line["worker"]) for line in lines[1:]]
    assert by_api == [("responses_get", 200, "ok", "p", "p/0"), ("responses_cancel", 400, "error", "p", "p/0"),
                      ("responses_delete", 200, "ok", "p", "p/0"), ("responses_get", 404, "error", "none", None)]
    assert lines[1]["request_id"] == "get-1" and lines[1]["stream"] is False
    assert gw.metric('kimi_gateway_requests_total{api="responses_get",pool="p",status_class="2xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{api="responses_get",pool="none",status_class="4xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{api="responses_cancel",pool="p",status_class="4xx"}') == 1
    assert gw.metric('kimi_gateway_requests_total{api="responses_delete",pool="p",status_class="2xx"}') == 1


def test_id_calls_count_against_the_request_limit(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", max_context_tokens=131072)
    auth = {"enabled": True, "keys": [{"name": "carol", "sha256": hash_key(KEY), "requests_per_minute": 3}]}
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=auth, load={"enabled": False})
    guard = gw.server.app.state.gateway.auth
    origin = time.monotonic()  # a limiter window that starts now: the test runs clear of its edge
    guard.limiter = MemoryRateLimiter(clock=lambda: time.monotonic() - origin)
    c = sdk(gw, KEY)
    created = c.responses.create(model="kimi-k3", input="Hi", max_output_tokens=2)  # request 1
    c.responses.retrieve(created.id)  # 2
    with pytest.raises(openai.NotFoundError):  # 3: an unknown id costs its request too
        c.responses.retrieve("resp_" + uuid.uuid4().hex)
    with pytest.raises(openai.RateLimitError) as limited:
        c.responses.delete(created.id)
    assert limited.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert int(limited.value.response.headers["retry-after"]) >= 1
    assert created.id in sim.app.responses.stored  # the refused delete never reached the engine
    assert gw.metric('kimi_gateway_requests_total{api="responses_delete",pool="none",status_class="4xx"}') == 1


def test_get_stream_true_relays_the_engines_replay_byte_exact(start_sim: StartSim,
                                                               start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", max_context_tokens=131072)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    c = sdk(gw)
    events = list(c.responses.create(model="kimi-k3", input="Count.", max_output_tokens=3,
                                             stream=True, background=True))
    rid = events[0].response.id  # type: ignore[union-attr]
    replayed = list(c.responses.retrieve(rid, stream=True))
    assert [(e.type, e.sequence_number) for e in replayed] == [(e.type, e.sequence_number) for e in events]
    later = list(c.responses.retrieve(rid, stream=True, starting_after=5))
    assert [e.sequence_number for e in later] == list(range(6, len(events)))
    with httpx.stream("GET", f"{gw.v1}/responses/{rid}", params={"stream": "true", "starting_after": "2"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-kimi-gateway-worker"] == "p/0"
        body = b"".join(r.iter_raw())
    assert body == b"".join(sim.app.responses.stored[rid].events[3:])  # the engine's bytes, unchanged
    assert gw.metric('kimi_gateway_requests_total{api="responses_get",pool="p",status_class="2xx"}') == 3
    # Without `stream`, the same response as JSON. Any other response has no replay: vLLM 0.32 breaks
    # the connection after its 200 (the simulator does the same), which the client gets as the
    # gateway's 502 in OpenAI's shape, not as an empty stream.
    assert c.responses.retrieve(rid).id == rid
    plain = c.responses.create(model="kimi-k3", input="Hi", max_output_tokens=2)
    streamed = list(c.responses.create(model="kimi-k3", input="Hi", max_output_tokens=2, stream=True))
    for unreplayable in (plain.id, streamed[0].response.id):  # type: ignore[union-attr]
        refused = httpx.get(f"{gw.v1}/responses/{unreplayable}", params={"stream": "true"})
        assert refused.status_code == 502 and refused.headers["content-type"] == "application/json"
        assert refused.json()["error"]["type"] == "server_error"


def test_a_client_hanging_up_mid_replay_is_a_disconnect_and_closes_the_engines_replay(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    """The client drops a `GET ?stream=true` replay after its first bytes: a client disconnect (4xx,
    `mid_stream`), never a shutdown, and the gateway closes the engine's replay at once."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm", tpot_s=0.1)  # the replay sends one event per 0.1 s: ~2.8 s for 28 events
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    events = list(sdk(gw).responses.create(model="kimi-k3", input="Count.", max_output_tokens=20,
                                             stream=True, background=True))
    rid = events[0].response.id  # type: ignore[union-attr]
    with httpx.stream("GET", f"{gw.v1}/responses/{rid}", params={"stream": "true"}) as replay:
        assert replay.status_code == 200
        assert next(replay.iter_raw())  # then the client closes the connection mid-stream
    [line] = [a for a in access_lines(caplog, gw, 2) if a["api"] == "responses_get"]
    assert (line["outcome"], line["status"], line["stream"]) == ("client_disconnect", 499, True)
    assert gw.metric('kimi_gateway_requests_total{api="responses_get",pool="p",status_class="4xx"}') == 1
    [engine_replay] = ended_replays(sim, 1)
    assert engine_replay.aborted and engine_replay.sent < len(events)


@pytest.mark.parametrize(("fault", "engine_error"), [
    ({"drop_after_chunks": 3}, False), ({"reset_after_chunks": 3}, False), ({"error_after_chunks": 3}, True)])
def test_a_replay_the_engine_breaks_ends_as_a_failure_the_client_sees(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture,
        fault: dict[str, int], engine_error: bool) -> None:
    """The engine cuts its `GET ?stream=true` replay after 3 events (the connection dropped, reset, or
    its own `error` event): the client reads those events, then one Responses `error` event (the
    engine's own, never a second) and no terminal event. Logged and counted as
    an `upstream_error`, not as a whole answer."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    events = list(sdk(gw).responses.create(model="kimi-k3", input="Count.", max_output_tokens=8,
                                             stream=True, background=True))
    rid = events[0].response.id  # type: ignore[union-attr]
    sim.engine.set_faults(SimFaults.model_validate(fault))
    with httpx.stream("GET", f"{gw.v1}/responses/{rid}", params={"stream": "true"}) as r:
        assert r.status_code == 200
        body = b"".join(r.iter_raw())
    sent = [e for e in body.split(b"\n\n") if e]
    assert b"".join(e + b"\n\n" for e in sent[:3]) == b"".join(sim.app.responses.stored[rid].events[:3])
    assert len(sent) == 4 and sent[3].startswith(b"event: error\ndata: ")
    error = orjson.loads(sent[3].split(b"\n", 1)[1][6:])
    assert error["type"] == "error" and error["message"]
    if not engine_error:
        assert "replay" in error["message"] and error["error"]["type"] == "server_error"
    assert b"response.completed" not in body
    if engine_error:  # OpenAI's `error` event as the engine sent it: the SDK yields it as the last event
        assert [e.type for e in sdk(gw).responses.retrieve(rid, stream=True)][-1] == "error"
    else:  # the gateway's also carries OpenAI's error object, which the SDK raises on
        with pytest.raises(openai.APIError):
            list(sdk(gw).responses.retrieve(rid, stream=True))
    [line, _] = [a for a in access_lines(caplog, gw, 3) if a["api"] == "responses_get"]
    assert (line["outcome"], line["status"], line["stream"]) == ("upstream_error", 200, True)
    assert gw.metric('kimi_gateway_requests_total{api="responses_get",pool="p",status_class="2xx"}') == 0


def test_a_replay_that_fails_before_its_first_byte_is_an_error_status(
        start_sim: StartSim, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture) -> None:
    """The engine drops its replay before any event: no empty 200, but a 502 in OpenAI's shape."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    events = list(sdk(gw).responses.create(model="kimi-k3", input="Count.", max_output_tokens=4,
                                             stream=True, background=True))
    rid = events[0].response.id  # type: ignore[union-attr]
    sim.engine.set_faults(SimFaults(drop_after_chunks=0))
    answer = httpx.get(f"{gw.v1}/responses/{rid}", params={"stream": "true"})
    assert answer.status_code == 502 and answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["type"] == "server_error" and "replay" in error["message"]
    assert answer.headers["x-kimi-gateway-worker"] == "p/0"
    [line] = [a for a in access_lines(caplog, gw, 2) if a["api"] == "responses_get"]
    assert (line["outcome"], line["status"]) == ("upstream_error", 502)
    assert gw.metric('kimi_gateway_requests_total{api="responses_get",pool="p",status_class="5xx"}') == 1


def test_delete_on_an_engine_without_it_is_a_clear_405(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """vLLM 0.32 has no `DELETE /v1/responses/{id}` (FastAPI's 405 `{"detail": "Method Not Allowed"}`):
    the client gets a 405 in OpenAI's shape saying the engine cannot delete stored responses, not the
    engine's JSON as its message; the response stays stored and retrievable."""
    sim = start_sim("vllm")
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    c = sdk(gw)
    created = c.responses.create(model="kimi-k3", input="Hi")
    with pytest.raises(openai.APIStatusError) as refused:
        c.responses.delete(created.id)
    assert refused.value.status_code == 405
    error = refused.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    message = error["message"]
    assert "does not support deleting stored responses" in message and "Method Not Allowed" in message
    assert "{" not in message  # not the engine's raw JSON
    assert c.responses.retrieve(created.id).id == created.id
    assert gw.metric('kimi_gateway_requests_total{api="responses_delete",pool="p",status_class="4xx"}') == 1
