"""The OpenAI Responses API end to end: the real openai SDK → gateway → simulated vLLM/SGLang engines
(`gateway/sim/responses_api.py`), stored-response affinity in memory and through Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import redis

from gateway.routing.tokens import TokenEstimator
from tests.support import OwnRedis, RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]


def eventually(gw: RunningGateway, metric: str, value: float, timeout: float = 5.0) -> None:
    """Poll a metric until it reads `value`: a request is accounted when its handler ends, which may be
    just after the client read the last byte."""
    deadline = time.monotonic() + timeout
    while (seen := gw.metric(metric)) != value:
        assert time.monotonic() < deadline, f"{metric} = {seen}, expected {value}"
        time.sleep(0.02)


def client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)


@pytest.fixture
def two_workers(start_sim: StartSim) -> list[RunningSim]:
    return [start_sim("vllm", max_context_tokens=131072, responses_delete=True) for _ in range(2)]


def sims_pool(sims: list[RunningSim], **extra: object) -> dict[str, object]:
    return pool("p", "vllm", [s.url for s in sims], 131072, policy="least_load", **extra)


def received(sims: list[RunningSim], path: str = "/v1/responses") -> list[int]:
    return [sum(r.path == path for r in s.engine.records) for s in sims]


def test_create_non_streaming_retrieve_and_delete(two_workers: list[RunningSim],
                                                  start_gateway: StartGateway) -> None:
    gw = start_gateway([sims_pool(two_workers)], load={"enabled": False})
    c = client(gw)
    raw = c.responses.with_raw_response.create(model="kimi-k3", input="Say hello.", max_output_tokens=5,
                                               instructions="Be brief.")
    response = raw.parse()
    # stopped by max_output_tokens: `incomplete`, as vLLM 0.32 reports it, and accounted as any answer
    assert response.object == "response" and response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert len(response.output_text.split()) == 5
    assert response.usage is not None and response.usage.output_tokens == 5 and response.usage.input_tokens > 0
    eventually(gw, 'kimi_gateway_tokens_total{kind="completion"}', 5)
    eventually(gw, 'kimi_gateway_tokens_total{kind="prompt"}', response.usage.input_tokens)
    owner = int(raw.headers["x-kimi-gateway-worker"].split("/")[1])
    assert raw.headers["x-kimi-gateway-attempts"] == "1"
    # Retrieve and delete go to the worker that stores it, whichever the policy would pick.
    for _ in range(3):
        assert c.responses.retrieve(response.id).output_text == response.output_text
    assert response.id in two_workers[owner].app.responses.stored
    c.responses.delete(response.id)
    assert response.id not in two_workers[owner].app.responses.stored
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.retrieve(response.id)
    assert missing.value.status_code == 404
    assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]
    assert gw.metric('kimi_gateway_response_affinity_total{result="hit"}') == 4
    assert gw.metric('kimi_gateway_response_affinity_total{result="unknown"}') == 1


def test_streaming_typed_events_in_order_and_usage_counted(two_workers: list[RunningSim],
                                                           start_gateway: StartGateway) -> None:
    gw = start_gateway([sims_pool(two_workers)], load={"enabled": False})
    events = list(client(gw).responses.create(model="kimi-k3", input="Count.", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 4 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 4
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    # The relay saw the stream complete (no error event added) and counted its tokens.
    eventually(gw, 'kimi_gateway_tokens_total{kind="completion",pool="p"}', 4)
    # A stored streamed response is found by id too.
    assert client(gw).responses.retrieve(final.id).id == final.id


def test_relay_is_byte_exact(two_workers: list[RunningSim], start_gateway: StartGateway) -> None:
    gw = start_gateway([pool("p", "vllm", [two_workers[0].url], 131072)], load={"enabled": False})
    body = {"model": "kimi-k3", "input": "Hi", "max_output_tokens": 3, "stream": True}
    via = httpx.post(gw.v1 + "/responses", json=body).content
    events = via.split(b"\n\n")
    assert events[0].startswith(b"event: response.created\ndata: {")
    assert b"[DONE]" not in via and b'"error"' not in via.replace(b'"error":null', b"")
    assert via.endswith(b"\n\n") and events[-2].startswith(b"event: response.completed\n")


def test_chained_conversation_lands_on_the_worker_storing_its_history(start_sim: StartSim,
                                                                      start_gateway: StartGateway) -> None:
    two_workers = [start_sim("vllm", max_context_tokens=131072, kv_capacity_tokens=1_000_000) for _ in range(2)]
    gw = start_gateway([sims_pool(two_workers)], load={"enabled": False})
    c = client(gw)
    first = c.responses.with_raw_response.create(model="kimi-k3", input="My name is Ada. " * 40,
                                                 max_output_tokens=3)
    owner = int(first.headers["x-kimi-gateway-worker"].split("/")[1])
    previous = first.parse().id
    for turn in range(3):
        raw = c.responses.with_raw_response.create(model="kimi-k3", input=f"Turn {turn}: what is my name?",
                                                   previous_response_id=previous, max_output_tokens=3,
                                                   stream=turn == 1)
        assert raw.headers["x-kimi-gateway-worker"] == f"p/{owner}"
        assert raw.headers["x-kimi-gateway-route-reason"] == "response_affinity"
        if turn == 1:  # streamed: the id is in the last event
            previous = next(e for e in raw.parse() if e.type == "response.completed").response.id  # type: ignore[union-attr]
        else:
            previous = raw.parse().id
    records = [r for r in two_workers[owner].engine.records if r.path == "/v1/responses"]
    assert len(records) == 4 and received(two_workers)[1 - owner] == 0
    # Each turn's prompt holds the stored history: it grows, and the prefix cache found the earlier turns.
    assert [r.prompt_tokens for r in records] == sorted(r.prompt_tokens for r in records)
    assert all(r.cached_tokens > 0 for r in records[1:])
    cached = sum(r.cached_tokens for r in records)
    eventually(gw, 'kimi_gateway_tokens_total{kind="cached",pool="p"}', cached)


def test_store_false_records_nothing_and_llamacpp_pools_are_stateless(two_workers: list[RunningSim],
                                                                      start_gateway: StartGateway) -> None:
    gw = start_gateway([sims_pool(two_workers)], load={"enabled": False})
    c = client(gw)
    response = c.responses.create(model="kimi-k3", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.create(model="kimi-k3", input="Again", previous_response_id=response.id, max_output_tokens=2)
    assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert sum(received(two_workers)) == 1  # the follow-up reached no engine


def test_worker_gone_and_unavailable_errors_are_clear_and_counted(start_sim: StartSim,
                                                                  start_gateway: StartGateway) -> None:
    sims = [start_sim("vllm", max_context_tokens=131072) for _ in range(2)]
    gw = start_gateway([sims_pool(sims)], load={"enabled": False},
                       health={"interval": 0.1, "timeout": 1.0, "verify_models": False})
    c = client(gw)
    raw = c.responses.with_raw_response.create(model="kimi-k3", input="Hi", max_output_tokens=2)
    owner_id = raw.headers["x-kimi-gateway-worker"]
    owner = sims[int(owner_id.split("/")[1])]
    response_id = raw.parse().id
    state = gw.server.app.state.gateway
    # The owner fails its health probes: 503 with Retry-After, a kind of answer the SDK retries.
    httpx.post(owner.url + "/sim/faults", json={"hang_health": True})
    poll(lambda: not next(w for w in state.registry if w.id == owner_id).healthy)
    with pytest.raises(openai.InternalServerError) as unavailable:
        c.responses.create(model="kimi-k3", input="More", previous_response_id=response_id, max_output_tokens=2)
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["code"] == "response_worker_unavailable"  # type: ignore[index]
    assert int(unavailable.value.response.headers["retry-after"]) >= 1
    # A reload removes it from the pool: 404, its memory is gone for good.
    others = [s.url for s in sims if s is not owner]
    gw.server.call(_configure(state, [pool("p", "vllm", others, 131072, policy="least_load")]))
    with pytest.raises(openai.NotFoundError) as gone:
        c.responses.create(model="kimi-k3", input="More", previous_response_id=response_id, max_output_tokens=2)
    assert gone.value.body["code"] == "response_worker_gone"  # type: ignore[index]
    assert "previous_response_id" in gone.value.message
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(response_id)
    assert gw.metric('kimi_gateway_response_affinity_total{result="worker_unavailable"}') == 1
    assert gw.metric('kimi_gateway_response_affinity_total{result="worker_gone"}') == 2
    assert sum(received(sims)) == 1  # no follow-up reached an engine


def poll(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


async def _configure(state: object, pools: list[dict[str, object]]) -> None:
    """What a config reload does to the workers (`WorkerRegistry.configure`), with these pools."""
    from gateway.backends.pool_params import PoolConfig

    state.registry.configure([PoolConfig.model_validate(p) for p in pools])  # type: ignore[attr-defined]


def test_chained_conversation_across_two_replicas_sharing_redis(two_workers: list[RunningSim],
                                                                start_gateway: StartGateway) -> None:
    prefix = f"test-resp-{uuid.uuid4().hex[:10]}"
    settings = {"redis_url": shared_redis_url(), "responses": {"key_prefix": prefix, "store_ttl": 60},
                "affinity": {"key_prefix": prefix + "-aff"}, "load": {"enabled": False}}
    replicas = [start_gateway([sims_pool(two_workers)], **settings) for _ in range(2)]
    try:
        first = client(replicas[0]).responses.with_raw_response.create(model="kimi-k3", input="Remember 42.",
                                                                       max_output_tokens=2)
        owner = first.headers["x-kimi-gateway-worker"]
        previous = first.parse().id
        for turn in range(4):
            gw = replicas[(turn + 1) % 2]
            for replica in replicas:
                replica.server.call(replica.server.app.state.gateway.responses.flush())
            raw = client(gw).responses.with_raw_response.create(
                model="kimi-k3", input=f"Turn {turn}", previous_response_id=previous, max_output_tokens=2)
            assert raw.headers["x-kimi-gateway-worker"] == owner, turn
            previous = raw.parse().id
        for replica in replicas:
            replica.server.call(replica.server.app.state.gateway.responses.flush())
        r = redis.Redis.from_url(shared_redis_url())
        ttl = r.pttl(f"{prefix}:{previous}")
        stored = r.get(f"{prefix}:{previous}")
    finally:
        r = redis.Redis.from_url(shared_redis_url())
        keys = list(r.scan_iter(f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()
    assert stored is not None and stored.decode().startswith("p\n")
    assert 0 < ttl <= 60_000
    owner_index = int(owner.split("/")[1])
    assert received(two_workers)[owner_index] == 5 and received(two_workers)[1 - owner_index] == 0


def test_llamacpp_pools_serve_it_statelessly(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """llama.cpp serves the Responses API but stores nothing: its pool is a candidate, no id is recorded."""
    llama_like = start_sim("vllm", max_context_tokens=8192)
    gw = start_gateway([pool("cpu", "llamacpp", [llama_like.url], 8192)], load={"enabled": False})
    response = client(gw).responses.create(model="kimi-k3", input="Hi")
    assert response.status == "completed"
    with pytest.raises(openai.NotFoundError):
        client(gw).responses.retrieve(response.id)


def test_disconnect_mid_stream_aborts_the_engine_request(start_sim: StartSim, start_gateway: StartGateway) -> None:
    two_workers = [start_sim("vllm", max_context_tokens=131072, tpot_s=0.05) for _ in range(2)]
    gw = start_gateway([sims_pool(two_workers)], load={"enabled": False})
    body = {"model": "kimi-k3", "input": "Write a lot.", "max_output_tokens": 500, "stream": True}
    with httpx.stream("POST", gw.v1 + "/responses", json=body, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                break
    sims = [s for s in two_workers if s.engine.records]
    assert len(sims) == 1
    record = sims[0].engine.wait_for(lambda: next((r for r in sims[0].engine.records if r.aborted), None))
    assert record.completion_tokens_sent < 500


def prompt_of_estimate(target_tokens: int, estimator: TokenEstimator) -> str:
    """A string `input` whose Responses estimate (one user message + the template) is `target_tokens`."""
    overhead = estimator.config.tokens_per_message + estimator.config.tokens_per_request
    text_tokens = target_tokens - overhead
    n = int(text_tokens / (estimator.config.text_rates.latin * estimator.config.safety_margin))
    while estimator.text_tokens("x" * n) < text_tokens:
        n += 1
    while estimator.text_tokens("x" * n) > text_tokens:
        n -= 1
    assert estimator.text_tokens("x" * n) + overhead == target_tokens
    return "x" * n


@pytest.fixture
def two_pools(start_sim: StartSim, start_gateway: StartGateway) -> Iterator[tuple[RunningGateway,
                                                                                   dict[str, RunningSim]]]:
    sims = {"small": start_sim("vllm", max_context_tokens=32768),
            "big": start_sim("sglang", max_context_tokens=131072)}
    gw = start_gateway([pool("small", "vllm", [sims["small"].url], 32768, default_output_tokens=2048),
                        pool("big", "sglang", [sims["big"].url], 131072, default_output_tokens=2048)],
                       load={"enabled": False})
    yield gw, sims


def test_routing_at_the_exact_pool_boundary(two_pools: tuple[RunningGateway, dict[str, RunningSim]]) -> None:
    gw, sims = two_pools
    estimator = TokenEstimator(gw.config.estimation)
    prompt_tokens = 32768 - 10000
    text = prompt_of_estimate(prompt_tokens, estimator)
    c = client(gw)

    def routed(max_output_tokens: int | None, as_items: bool) -> str:
        extra = {} if max_output_tokens is None else {"max_output_tokens": max_output_tokens}
        given: object = [{"role": "user", "content": [{"type": "input_text", "text": text}]}] if as_items else text
        before = {name: len(sim.engine.records) for name, sim in sims.items()}
        raw = c.responses.with_raw_response.create(model="kimi-k3", input=given, **extra)  # type: ignore[arg-type]
        assert raw.headers["x-kimi-gateway-estimated-prompt-tokens"].startswith(f"{prompt_tokens};")
        assert raw.headers["x-kimi-gateway-attempts"] == "1"
        chosen = raw.headers["x-kimi-gateway-pool"]
        assert {n: len(s.engine.records) - before[n] for n, s in sims.items()} == {n: int(n == chosen) for n in sims}
        return chosen

    for as_items in (False, True):
        assert routed(10000, as_items) == "small"  # prompt + output == the context: fits
        assert routed(10001, as_items) == "big"  # one token over: the next pool, and the small engine saw nothing
        assert routed(None, as_items) == "small"  # the pool's own reservation fits


def test_a_follow_up_whose_history_overflows_its_owner_gets_the_engines_answer(start_sim: StartSim,
                                                                              start_gateway: StartGateway) -> None:
    """The gateway cannot count a stored history: the follow-up goes to its owner anyway, and the
    engine's "too long" comes back as an OpenAI error, with no attempt on the larger pool (it has no history)."""
    small, big = start_sim("vllm", max_context_tokens=2048), start_sim("vllm", max_context_tokens=8192)
    gw = start_gateway([pool("small", "vllm", [small.url], 2048, default_output_tokens=64),
                        pool("big", "vllm", [big.url], 8192, default_output_tokens=64)], load={"enabled": False})
    c = client(gw)
    first = c.responses.with_raw_response.create(model="kimi-k3", input="abcd " * 900, max_output_tokens=8)
    assert first.headers["x-kimi-gateway-pool"] == "small"
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model="kimi-k3", input="efgh " * 900, previous_response_id=first.parse().id,
                           max_output_tokens=8)
    assert refused.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert refused.value.body["param"] == "input"  # type: ignore[index]
    # vLLM 0.32's renderer refuses a prompt over max_model_len in its own words (vllm/renderers/params.py)
    assert "maximum context length is 2048 tokens" in refused.value.message
    assert refused.value.response.headers["x-kimi-gateway-attempts"] == "1"
    assert refused.value.response.headers["x-kimi-gateway-route-reason"] == "response_affinity"
    assert received([small, big]) == [2, 0]


def test_an_engine_that_fails_during_the_preamble_fails_over_unseen(start_sim: StartSim,
                                                                    start_gateway: StartGateway) -> None:
    """`response.created` and `response.in_progress` are held like chat's role chunk: a worker that
    drops the connection after them fails over to another before the client sees a byte."""
    sims = [start_sim("vllm", max_context_tokens=131072) for _ in range(2)]
    httpx.post(sims[0].url + "/sim/faults", json={"drop_after_chunks": 2})
    gw = start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")],
                       load={"enabled": False}, health={"passive_failures": 100})
    outcomes = []
    for _ in range(2):
        with client(gw).responses.with_streaming_response.create(model="kimi-k3", input="Hi", max_output_tokens=3,
                                                                 stream=True) as raw:
            kinds = [e.type for e in raw.parse()]
            outcomes.append((raw.headers["x-kimi-gateway-attempts"], raw.headers["x-kimi-gateway-worker"]))
        assert kinds[0] == "response.created" and kinds.count("response.created") == 1
        assert kinds[-1] == "response.completed"
    dropped = [r.fault for r in sims[0].engine.records]
    assert dropped == ["drop_after_chunks"] * len(dropped) and len(dropped) >= 1
    # Every request the faulty worker took failed over to the other one; none reached the client broken.
    assert sorted(outcomes) == sorted([("2", "p/1")] * len(dropped) + [("1", "p/1")] * (2 - len(dropped)))


def test_a_redis_that_does_not_answer_is_a_retryable_503(two_workers: list[RunningSim], start_gateway: StartGateway,
                                                          unused_port: int) -> None:
    gw = start_gateway([sims_pool(two_workers)], redis_url=f"redis://127.0.0.1:{unused_port}/0",
                       load={"enabled": False}, affinity={"enabled": False})
    c = client(gw)
    created = c.responses.create(model="kimi-k3", input="Hi", max_output_tokens=2)  # its record cannot be written
    gw.server.call(gw.server.app.state.gateway.responses.flush())  # the write has failed now
    with pytest.raises(openai.InternalServerError) as failed:
        c.responses.create(model="kimi-k3", input="More", previous_response_id=created.id, max_output_tokens=2)
    assert failed.value.status_code == 503
    assert failed.value.body["code"] == "response_store_unavailable"  # type: ignore[index]
    assert failed.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert gw.metric('kimi_gateway_response_affinity_total{result="store_error"}') == 1
    # The failed write tripped the circuit breaker: the lookup answered at once, without trying Redis.
    assert gw.metric('kimi_gateway_redis_errors_total{op="response_write"}') == 1
    assert gw.metric('kimi_gateway_redis_errors_total{op="response_lookup"}') == 0
    assert sum(received(two_workers)) == 1


def test_a_stream_broken_after_its_first_token_ends_with_an_error_the_sdk_raises(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = start_sim("vllm", max_context_tokens=131072)
    httpx.post(sim.url + "/sim/faults", json={"drop_after_chunks": 6})  # created ... two deltas, then gone
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], load={"enabled": False})
    seen: list[str] = []
    with pytest.raises(openai.APIError) as broken:
        for event in client(gw).responses.create(model="kimi-k3", input="Hi", max_output_tokens=20, stream=True):
            seen.append(event.type)
    assert seen.count("response.output_text.delta") == 2 and "response.completed" not in seen
    assert "incomplete" in broken.value.message


def test_a_pool_whose_engines_do_not_serve_it_is_skipped(start_sim: StartSim, start_gateway: StartGateway) -> None:
    old, new = start_sim("vllm", max_context_tokens=32768), start_sim("vllm", max_context_tokens=131072)
    gw = start_gateway([pool("old", "vllm", [old.url], 32768, apis=["chat", "completions"]),
                        pool("new", "vllm", [new.url], 131072)], load={"enabled": False})
    raw = client(gw).responses.with_raw_response.create(model="kimi-k3", input="Hi", max_output_tokens=2)
    assert raw.headers["x-kimi-gateway-pool"] == "new"
    assert raw.headers["x-kimi-gateway-skipped-pools"] == "old"
    assert received([old, new]) == [0, 1]
    chat = client(gw).chat.completions.with_raw_response.create(
        model="kimi-k3", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.headers["x-kimi-gateway-pool"] == "old"


def test_a_redis_that_died_is_skipped_after_its_first_failure(two_workers: list[RunningSim],
                                                               start_gateway: StartGateway,
                                                               own_redis: OwnRedis) -> None:
    gw = start_gateway([sims_pool(two_workers)], redis_url=own_redis.url, load={"enabled": False},
                       affinity={"enabled": False}, responses={"retry_after": 30})
    c = client(gw)
    created = c.responses.create(model="kimi-k3", input="Hi", max_output_tokens=2)
    gw.server.call(gw.server.app.state.gateway.responses.flush())
    assert c.responses.retrieve(created.id).id == created.id
    own_redis.kill()
    for _ in range(3):
        with pytest.raises(openai.InternalServerError) as failed:
            c.responses.retrieve(created.id)
        assert failed.value.body["code"] == "response_store_unavailable"  # type: ignore[index]
    # Redis was tried once; the breaker answered the other two without a call (nor a wait).
    assert gw.metric('kimi_gateway_redis_errors_total{op="response_lookup"}') == 1
    assert gw.metric('kimi_gateway_response_affinity_total{result="store_error"}') == 3
    assert gw.metric('kimi_gateway_requests_total{api="responses_get",pool="none",status_class="5xx"}') == 3
