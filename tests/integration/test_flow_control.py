"""Flow control (issue 39, gateway/flow/): requests held at the gateway while a pool's engines are
saturated, released by band and fairly across flows, bounded in time, and gone when their client is.

Simulated engines with `max_num_seqs: 1` (one request runs, the rest wait in the engine and count as
`waiting` in its /metrics) and `max_waiting: 1` on the pool: one request waits in each engine, the
next ones at the gateway. Keys live in a real Redis (their limits' store)."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
import yaml

from gateway.auth.keys import hash_key
from gateway.sim.config import SimFaults
from tests.integration.pd_support import PROMPT, pd_group
from tests.support import REPO_ROOT, RunningGateway, RunningSim, access_lines, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
REDIS_URL = shared_redis_url()
KEYS = {"alice": "sk-alice-" + "a" * 32, "bob": "sk-bob-" + "b" * 34, "carol": "sk-carol-" + "c" * 32}


def chat(tag: str, tokens: int = 1, stream: bool = False) -> dict[str, Any]:
    return {"model": "kimi-k3", "messages": [{"role": "user", "content": tag}], "max_tokens": tokens,
            "stream": stream}


def in_background(fn: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response | Exception]]:
    out: list[httpx.Response | Exception] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # a client that gave up
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def tags(sim: RunningSim) -> list[str]:
    """The prompts the engine received, in arrival order."""
    return [r.body["messages"][0]["content"] for r in sorted(sim.engine.records, key=lambda r: r.received_at)]


def flow_pool(sim: RunningSim, **flow: Any) -> dict[str, Any]:
    return pool("p", "vllm", [sim.url], 131072, flow_control={"enabled": True, "max_waiting": 1, **flow})


SETTINGS: dict[str, Any] = {"load": {"interval": 0.05, "timeout": 2.0}}


@pytest.fixture
def key_prefix() -> Iterator[str]:
    prefix = f"test-flow-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def auth(prefix: str, **per_key: dict[str, Any]) -> dict[str, Any]:
    return {"enabled": True, "key_prefix": prefix, "keys": [
        {"name": name, "sha256": hash_key(key), "requests_per_minute": 10_000, **per_key.get(name, {})}
        for name, key in KEYS.items()]}


def bearer(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def test_requests_wait_at_the_gateway_while_the_engine_is_saturated(start_sim: StartSim, start_gateway: StartGateway,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """And the wait is observed: the access log's `queued_s`, the wait histogram by pool and band."""
    caplog.set_level(logging.INFO, logger="gateway.access")
    sim = start_sim("vllm", tpot_s=0.02, max_num_seqs=1)
    gw = start_gateway([flow_pool(sim)], **SETTINGS)

    def post(tag: str, tokens: int) -> httpx.Response:
        return httpx.post(gw.v1 + "/chat/completions", json=chat(tag, tokens), timeout=60)

    running = in_background(lambda: post("running", 60))   # ~1.2 s on the engine
    wait_until(lambda: tags(sim) == ["running"])
    wait_until(scraped(gw, "p/0", "running", 1))            # a scrape since: it counts as running there
    waiting = in_background(lambda: post("engine-waits", 1))  # the engine's one waiting request
    wait_until(lambda: len(tags(sim)) == 2)
    wait_until(lambda: gw.metric('kimi_gateway_engine_load{signal="waiting"}') == 1)
    held = in_background(lambda: post("held", 1))
    wait_until(lambda: gw.metric('kimi_gateway_flow_queued{pool="p"}') == 1)
    assert tags(sim) == ["running", "engine-waits"]        # held at the gateway, not sent
    for thread, _ in (running, waiting, held):
        thread.join()
    assert all(isinstance(out[0], httpx.Response) and out[0].status_code == 200
               for _, out in (running, waiting, held))
    assert tags(sim) == ["running", "engine-waits", "held"]
    assert gw.metric('kimi_gateway_flow_requests_total{pool="p",outcome="dispatched"}') == 1
    assert gw.metric('kimi_gateway_flow_queued{pool="p"}') == 0
    assert gw.metric('kimi_gateway_flow_wait_seconds_count{pool="p",band="0"}') == 1
    lines = {line["request_id"]: line for line in access_lines(caplog, gw, 3)}
    by_id = {out[0].headers["x-request-id"]: name for name, (_, out) in
             (("running", running), ("waiting", waiting), ("held", held)) if isinstance(out[0], httpx.Response)}
    queued = {by_id[rid]: line.get("queued_s") for rid, line in lines.items()}
    assert queued["running"] is None and queued["waiting"] is None and queued["held"] > 0.1


def test_off_by_default_every_request_goes_to_the_engine(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.02, max_num_seqs=1)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], **SETTINGS)
    runs = [in_background(lambda i=i: httpx.post(gw.v1 + "/chat/completions", json=chat(f"r{i}", 20), timeout=60))
            for i in range(4)]
    wait_until(lambda: len(tags(sim)) == 4)                # all four queue in the engine
    for thread, _ in runs:
        thread.join()
    assert gw.metric("kimi_gateway_flow_requests_total") == 0
    assert json.loads(json.dumps(gw.config.pools[0].flow_control.model_dump()))["enabled"] is False


def saturate(sim: RunningSim, tokens: int = 60) -> list[tuple[threading.Thread, list[httpx.Response | Exception]]]:
    """Occupy `sim` directly (not through the gateway): one running request of `tokens` and one
    waiting behind it (`max_num_seqs: 1`)."""
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "direct"}], "max_tokens": tokens}
    first = in_background(lambda: httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=60))
    wait_until(lambda: len(sim.engine.records) >= 1)
    second = in_background(lambda: httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=60))
    wait_until(lambda: len(sim.engine.records) >= 2)
    return [first, second]


def scraped(gw: RunningGateway, worker: str, signal: str, value: float) -> Callable[[], bool]:
    """Whether the gateway's last load scrape of `worker` read `value` for `signal`. A non-streamed
    request sent since the last scrape counts as waiting on its worker until a scrape sees it
    (its first byte is its end): tests wait for that scrape before they count held requests."""
    return lambda: gw.metric(f'kimi_gateway_engine_load{{worker="{worker}",signal="{signal}"}}') == value


def scraped_waiting(gw: RunningGateway, worker: str, value: float) -> Callable[[], bool]:
    return scraped(gw, worker, "waiting", value)


def join_all(*runs: tuple[threading.Thread, list[httpx.Response | Exception]]) -> list[httpx.Response]:
    for thread, _ in runs:
        thread.join()
    answers = [out[0] for _, out in runs]
    assert all(isinstance(a, httpx.Response) for a in answers), answers
    return answers  # type: ignore[return-value]


def test_a_worker_with_room_takes_the_request_at_once(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Work-conserving: one saturated worker does not hold a request another worker has room for,
    and the request goes to that worker whatever the policy would have picked."""
    busy, idle = start_sim("vllm", tpot_s=0.05, max_num_seqs=1), start_sim("vllm", max_num_seqs=1)
    gw = start_gateway([pool("p", "vllm", [busy.url, idle.url], 131072, policy="round_robin",
                             flow_control={"enabled": True, "max_waiting": 1})], **SETTINGS)
    direct = saturate(busy)
    wait_until(scraped_waiting(gw, "p/0", 1))
    answers = [httpx.post(gw.v1 + "/chat/completions", json=chat(f"r{i}"), timeout=60) for i in range(2)]
    assert [a.headers["x-kimi-gateway-worker"] for a in answers] == ["p/1", "p/1"]  # round robin would alternate
    assert gw.metric("kimi_gateway_flow_requests_total") == 0                         # never held
    join_all(*direct)


def test_fair_across_keys_within_a_band(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str) -> None:
    """Alice floods; Bob's one request leaves the queue after at most one of hers, not after all
    of them (first come first served at the engine would put it last)."""
    sim = start_sim("vllm", tpot_s=0.02, max_num_seqs=1)
    gw = start_gateway([flow_pool(sim)], redis_url=REDIS_URL, auth=auth(key_prefix), **SETTINGS)

    def post(who: str, tag: str, tokens: int = 1) -> httpx.Response:
        return httpx.post(gw.v1 + "/chat/completions", json=chat(tag, tokens), headers=bearer(who), timeout=60)

    runs = [in_background(lambda: post("alice", "a0", 200))]  # ~4 s: all are queued by then
    wait_until(lambda: tags(sim) == ["a0"])
    wait_until(scraped(gw, "p/0", "running", 1))
    runs.append(in_background(lambda: post("alice", "a1")))
    wait_until(scraped_waiting(gw, "p/0", 1))
    for i in range(2, 6):  # one by one: first come first served within her flow
        runs.append(in_background(lambda i=i: post("alice", f"a{i}")))
        wait_until(lambda i=i: gw.metric("kimi_gateway_flow_queued") == i - 1)
    runs.append(in_background(lambda: post("bob", "b1")))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 5)
    assert all(a.status_code == 200 for a in join_all(*runs))
    assert tags(sim) == ["a0", "a1", "a2", "b1", "a3", "a4", "a5"]


def test_higher_bands_leave_first_and_the_header_is_capped(start_sim: StartSim, start_gateway: StartGateway,
                                                           key_prefix: str) -> None:
    """Carol's key is band 1, Bob may ask for band 2 with the header, Alice's header asks for 5 but
    her key's maximum is its band, 0."""
    sim = start_sim("vllm", tpot_s=0.02, max_num_seqs=1)
    keys = auth(key_prefix, carol={"priority": 1}, bob={"max_priority": 2})
    gw = start_gateway([flow_pool(sim)], redis_url=REDIS_URL, auth=keys, **SETTINGS)

    def post(who: str, tag: str, tokens: int = 1, band: str | None = None) -> httpx.Response:
        headers = bearer(who) | ({"x-kimi-priority": band} if band is not None else {})
        return httpx.post(gw.v1 + "/chat/completions", json=chat(tag, tokens), headers=headers, timeout=60)

    runs = [in_background(lambda: post("alice", "a0", 200))]  # ~4 s: all are queued by then
    wait_until(lambda: tags(sim) == ["a0"])
    wait_until(scraped(gw, "p/0", "running", 1))
    runs.append(in_background(lambda: post("alice", "a1")))
    wait_until(scraped_waiting(gw, "p/0", 1))
    order = [("alice", "a2", None), ("alice", "a-asks-5", "5"), ("carol", "c1", None), ("bob", "b-asks-2", "2"),
             ("bob", "b-plain", None)]
    for count, (who, tag, band) in enumerate(order, start=1):
        runs.append(in_background(lambda who=who, tag=tag, band=band: post(who, tag, band=band)))
        wait_until(lambda count=count: gw.metric("kimi_gateway_flow_queued") == count)
    assert all(a.status_code == 200 for a in join_all(*runs))
    assert tags(sim) == ["a0", "a1", "b-asks-2", "c1", "a2", "b-plain", "a-asks-5"]
    assert gw.metric('kimi_gateway_flow_requests_total{band="2",outcome="dispatched"}') == 1
    assert gw.metric('kimi_gateway_flow_requests_total{band="1",outcome="dispatched"}') == 1
    assert gw.metric('kimi_gateway_flow_requests_total{band="0",outcome="dispatched"}') == 3


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_request_held_past_the_queue_timeout_gets_503_in_its_api_shape(
        start_sim: StartSim, start_gateway: StartGateway, api: str) -> None:
    sim = start_sim("vllm", tpot_s=0.05, max_num_seqs=1)
    gw = start_gateway([flow_pool(sim)], flow_control={"queue_timeout": 0.5}, **SETTINGS)
    direct = saturate(sim)
    wait_until(scraped_waiting(gw, "p/0", 1))
    started = time.monotonic()
    if api == "chat":
        answer = httpx.post(gw.v1 + "/chat/completions", json=chat("held"), timeout=60)
    else:
        body = {"model": "kimi-k3", "max_tokens": 1, "messages": [{"role": "user", "content": "held"}]}
        answer = httpx.post(gw.v1 + "/messages", json=body, timeout=60)
    assert time.monotonic() - started >= 0.45
    assert answer.status_code in (503, 529) and answer.headers["retry-after"] == "1"
    error = answer.json()
    if api == "chat":
        assert error["error"]["code"] == "server_overloaded" and error["error"]["type"] == "server_error"
    else:
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert gw.metric('kimi_gateway_flow_requests_total{outcome="expired"}') == 1
    assert gw.metric("kimi_gateway_flow_queued") == 0
    join_all(*direct)
    assert "held" not in tags(sim)


def test_a_client_that_hangs_up_leaves_the_queue_at_once(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", tpot_s=0.05, max_num_seqs=1)
    gw = start_gateway([flow_pool(sim)], **SETTINGS)
    direct = saturate(sim)
    wait_until(scraped_waiting(gw, "p/0", 1))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.v1 + "/chat/completions", json=chat("gone"), timeout=httpx.Timeout(60, read=0.5))
    wait_until(lambda: gw.metric('kimi_gateway_flow_requests_total{outcome="gone"}') == 1)
    assert gw.metric("kimi_gateway_flow_queued") == 0
    after = httpx.post(gw.v1 + "/chat/completions", json=chat("after"), timeout=60)  # waits its turn, then goes
    assert after.status_code == 200
    join_all(*direct)
    assert "gone" not in tags(sim) and "after" in tags(sim)


def test_a_key_beyond_its_queue_bound_gets_429_others_still_wait(start_sim: StartSim, start_gateway: StartGateway,
                                                                 key_prefix: str) -> None:
    sim = start_sim("vllm", tpot_s=0.05, max_num_seqs=1)
    gw = start_gateway([flow_pool(sim)], redis_url=REDIS_URL, auth=auth(key_prefix),
                       flow_control={"max_queued_per_flow": 1}, **SETTINGS)
    direct = saturate(sim, tokens=40)
    wait_until(scraped_waiting(gw, "p/0", 1))

    def post(who: str, tag: str) -> httpx.Response:
        return httpx.post(gw.v1 + "/chat/completions", json=chat(tag), headers=bearer(who), timeout=60)

    held = in_background(lambda: post("alice", "a1"))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 1)
    refused = post("alice", "a2")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    other = in_background(lambda: post("bob", "b1"))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 2)
    assert all(a.status_code == 200 for a in join_all(held, other, *direct))
    assert gw.metric('kimi_gateway_flow_requests_total{outcome="refused"}') == 1


def test_a_migrated_streams_continuation_is_not_held(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Both workers saturated, a new request held: the stream whose worker breaks goes on on the
    other worker at once (its continuation is part of an admitted request), ahead of the held one."""
    bad = start_sim("vllm", tpot_s=0.05, max_num_seqs=1, faults=SimFaults(drop_after_chunks=6))
    good = start_sim("vllm", tpot_s=0.05, max_num_seqs=1)
    gw = start_gateway([pool("p", "vllm", [bad.url, good.url], 131072, policy="round_robin",
                             flow_control={"enabled": True, "max_waiting": 1})],
                       health={"interval": 30, "timeout": 2.0}, **SETTINGS)
    direct = saturate(good)
    wait_until(scraped_waiting(gw, "p/1", 1))

    def stream() -> httpx.Response:
        with httpx.stream("POST", gw.v1 + "/chat/completions", json=chat("story", 30, stream=True),
                          timeout=60) as response:
            response.read()
        return response

    streamed = in_background(stream)                       # the only worker with room: `bad`
    wait_until(lambda: tags(bad) == ["story"])
    direct += saturate(bad)                                 # `bad` full behind it too
    wait_until(scraped_waiting(gw, "p/0", 1))
    held = in_background(lambda: httpx.post(gw.v1 + "/chat/completions", json=chat("held"), timeout=60))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 1)
    wait_until(lambda: any(r.body["messages"][-1]["role"] == "assistant" for r in good.engine.records))
    continuation = next(r for r in good.engine.records if r.body["messages"][-1]["role"] == "assistant")
    answers = join_all(streamed, held, *direct)
    assert answers[0].status_code == 200 and b"[DONE]" in answers[0].content
    held_at = next(r.received_at for s in (bad, good) for r in s.engine.records
                   if r.body["messages"][0]["content"] == "held")
    assert continuation.received_at < held_at
    assert gw.metric('kimi_gateway_flow_requests_total{outcome="held"}') == 1  # the held one only
    assert gw.metric('kimi_gateway_migrations_total{outcome="migrated"}') == 1


def test_a_prefill_decode_attempts_second_leg_is_not_held(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """vLLM NIXL: the decode leg opens after the prefill leg's answer, while a newer request is
    held (the pool has no room: the first request has not started on its decode worker); it goes at
    once, and the held request leaves the queue only once the first started."""
    group = pd_group(start_sim, "vllm-nixl")
    group.prefill[0].engine.config.ttft_s = 2.0  # a slow prefill: the newer request is held meanwhile
    gw = start_gateway([group.pool(flow_control={"enabled": True, "max_waiting": 1})], **SETTINGS)

    def post(tag: str) -> httpx.Response:
        body = {"model": "kimi-k3", "prompt": tag + PROMPT, "max_tokens": 2}
        return httpx.post(gw.v1 + "/completions", json=body, timeout=60)

    first = in_background(lambda: post("first"))
    wait_until(lambda: len(group.prefill[0].engine.records) == 1)
    second = in_background(lambda: post("second"))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 1)
    assert all(a.status_code == 200 for a in join_all(first, second))

    def received(sim: RunningSim, tag: str) -> float:
        return next(r.received_at for r in sim.engine.records if r.body["prompt"].startswith(tag))

    assert received(group.decode[0], "first") < received(group.prefill[0], "second")
    assert gw.metric('kimi_gateway_flow_requests_total{outcome="held"}') == 1


def docs_example() -> dict[str, Any]:
    """The worked example's configuration from docs/flow-control.md."""
    text = (REPO_ROOT / "docs" / "flow-control.md").read_text()
    block = text.split("## A worked example", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def test_the_worked_example_of_the_docs(start_sim: StartSim, start_gateway: StartGateway, key_prefix: str) -> None:
    """docs/flow-control.md's configuration, its workers replaced by two simulated engines: while
    `batch` saturates both, `chat` leaves the queue before `batch`'s held requests, and each reaches
    its engine with its band as vLLM's priority (lower first)."""
    sims = [start_sim("vllm", tpot_s=0.02, max_num_seqs=1) for _ in range(2)]
    example = docs_example()
    example["pools"][0]["workers"] = [s.url for s in sims]
    keys = {"batch": "sk-batch-" + "b" * 32, "chat": "sk-chat-" + "c" * 33}
    for key in example["auth"]["keys"]:
        key["sha256"] = hash_key(keys[key["name"]])
    example["auth"]["key_prefix"] = key_prefix
    gw = start_gateway(example.pop("pools"), redis_url=REDIS_URL, **example)

    def post(who: str, tag: str, tokens: int = 1) -> httpx.Response:
        return httpx.post(gw.v1 + "/chat/completions", json=chat(tag, tokens),
                          headers={"authorization": f"Bearer {keys[who]}"}, timeout=60)

    def received() -> list[str]:
        records = sorted((r for s in sims for r in s.engine.records), key=lambda r: r.received_at)
        return [r.body["messages"][0]["content"] for r in records]

    runs = []
    for i in range(12):  # batch fills both engines (one running, two waiting each) until one is held
        runs.append(in_background(lambda i=i: post("batch", f"b{i}", 200)))
        wait_until(lambda i=i: f"b{i}" in received() or gw.metric("kimi_gateway_flow_queued") == 1)
        if gw.metric("kimi_gateway_flow_queued") == 1:
            break
    runs.append(in_background(lambda: post("batch", "b-last")))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 2)
    runs.append(in_background(lambda: post("chat", "c1")))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 3)
    assert all(a.status_code == 200 for a in join_all(*runs))
    order = received()
    let_go = order[len(runs) - 3:]          # after the batch requests that went straight to an engine
    assert let_go[0] == "c1" and "b-last" in let_go[1:]
    priorities = {r.body["messages"][0]["content"]: r.body["priority"] for s in sims for r in s.engine.records}
    assert priorities["c1"] == -1 and priorities["b-last"] == 1


def test_held_requests_go_when_the_pool_has_no_worker_left(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A worker that fails its probes while requests wait: they are not held to queue_timeout for
    it, they get the answer of a pool without a healthy worker at once."""
    sim = start_sim("vllm", tpot_s=0.05, max_num_seqs=1)
    gw = start_gateway([flow_pool(sim)], health={"interval": 0.3, "timeout": 1.0}, **SETTINGS)
    direct = saturate(sim)
    wait_until(scraped_waiting(gw, "p/0", 1))
    held = in_background(lambda: httpx.post(gw.v1 + "/chat/completions", json=chat("held"), timeout=60))
    wait_until(lambda: gw.metric("kimi_gateway_flow_queued") == 1)
    started = time.monotonic()
    httpx.post(sim.url + "/sim/faults", json={"hang_health": True}, timeout=10)
    (answer,) = join_all(held)
    assert time.monotonic() - started < 20  # queue_timeout is 30 s
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_healthy_upstream"
    assert gw.metric('kimi_gateway_flow_requests_total{outcome="dispatched"}') == 1
    httpx.post(sim.url + "/sim/faults", json={}, timeout=10)
    join_all(*direct)
