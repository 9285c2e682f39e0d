"""Stored responses belong to the API key that created them (issue 12): another key gets exactly the
unknown id's 404 for GET, DELETE, cancel and `previous_response_id`; an admin key may use any.
The real openai SDK with two keys, the in-process store and the Redis store."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import openai
import pytest
import redis

from gateway.affinity.response_store import ResponseOwner
from gateway.auth.keys import hash_key
from tests.support import RunningGateway, RunningSim, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
REDIS_URL = shared_redis_url()
ALICE = "sk-alice-" + uuid.uuid4().hex + uuid.uuid4().hex
BOB = "sk-bob-" + uuid.uuid4().hex + uuid.uuid4().hex
OPS = "sk-ops-" + uuid.uuid4().hex + uuid.uuid4().hex


def auth() -> dict[str, object]:
    return {"enabled": True, "keys": [
        {"name": "alice", "sha256": hash_key(ALICE)},
        {"name": "bob", "sha256": hash_key(BOB)},
        {"name": "ops", "sha256": hash_key(OPS), "scopes": ["user", "admin"]},
    ]}


def sdk(gw: RunningGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)


@pytest.fixture(params=["memory", "redis"])
def gateway(request: pytest.FixtureRequest, start_sim: StartSim,
            start_gateway: StartGateway) -> Iterator[RunningGateway]:
    sim = start_sim("vllm", max_context_tokens=131072, responses_delete=True)  # a server that deletes
    settings: dict[str, object] = {"auth": auth(), "load": {"enabled": False}}
    prefix = f"test-own-{uuid.uuid4().hex[:10]}"
    if request.param == "redis":
        settings |= {"redis_url": REDIS_URL, "responses": {"key_prefix": prefix},
                     "affinity": {"key_prefix": prefix + "-aff"}, "auth": {**auth(), "key_prefix": prefix + "-rl"}}
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], **settings)
    yield gw
    if request.param == "redis":
        r = redis.Redis.from_url(REDIS_URL)
        keys = list(r.scan_iter(f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()


def flush(gw: RunningGateway) -> None:
    gw.server.call(gw.server.app.state.gateway.responses.flush())


def not_found_body(call: Callable[[], object]) -> dict[str, object]:
    with pytest.raises(openai.NotFoundError) as missing:
        call()
    body = missing.value.body
    assert isinstance(body, dict)
    return body


def test_another_key_sees_a_stored_response_as_unknown(gateway: RunningGateway) -> None:
    alice, bob, ops = sdk(gateway, ALICE), sdk(gateway, BOB), sdk(gateway, OPS)
    created = alice.responses.create(model="kimi-k3", input="My secret is 42.", max_output_tokens=3)
    flush(gateway)
    unknown = f"resp_{uuid.uuid4().hex}"
    for rid in (created.id, unknown):  # the same answer for someone else's id and a made-up one
        never = not_found_body(lambda rid=rid: bob.responses.retrieve(rid))
        assert never == {**not_found_body(lambda rid=rid: bob.responses.retrieve(rid)),
                         "message": f"Response with id '{rid}' not found."}
        assert never["code"] == "response_not_found" and never["type"] == "invalid_request_error"
        assert not_found_body(lambda rid=rid: bob.responses.delete(rid))["code"] == "response_not_found"
        assert not_found_body(lambda rid=rid: bob.responses.cancel(rid))["code"] == "response_not_found"
        chained = not_found_body(lambda rid=rid: bob.responses.create(
            model="kimi-k3", input="What is the secret?", previous_response_id=rid, max_output_tokens=2))
        assert chained["code"] == "response_not_found" and chained["param"] == "previous_response_id"
        assert chained["message"] == f"Previous response with id '{rid}' not found."
    # The owner still has it, and continues it; an admin key may read it too.
    assert alice.responses.retrieve(created.id).output_text == created.output_text
    follow = alice.responses.create(model="kimi-k3", input="And?", previous_response_id=created.id,
                                    max_output_tokens=2)
    flush(gateway)
    assert ops.responses.retrieve(follow.id).id == follow.id
    # The follow-up is alice's too.
    assert not_found_body(lambda: bob.responses.retrieve(follow.id))["code"] == "response_not_found"
    alice.responses.delete(created.id)
    assert not_found_body(lambda: alice.responses.retrieve(created.id))["code"] == "response_not_found"


def test_a_client_chosen_request_id_cannot_take_over_a_stored_response(gateway: RunningGateway) -> None:
    """Issue 25 §2: vLLM names the response after the body's `request_id` (the simulator does too,
    gateway/sim/request_ids.py) and stores it under that key. Bob sending Alice's response id as his
    `request_id` must not overwrite her response, nor make the gateway record her id as his."""
    alice, bob = sdk(gateway, ALICE), sdk(gateway, BOB)
    created = alice.responses.create(model="kimi-k3", input="My secret is 42.", max_output_tokens=3)
    flush(gateway)
    for stream in (False, True):
        if stream:
            with bob.responses.stream(model="kimi-k3", input="Mine now.", max_output_tokens=2,
                                      extra_body={"request_id": created.id}) as events:
                taken = events.get_final_response()
        else:
            taken = bob.responses.create(model="kimi-k3", input="Mine now.", max_output_tokens=2,
                                         extra_body={"request_id": created.id})
        flush(gateway)
        assert taken.id != created.id  # the engine named it itself
        assert bob.responses.retrieve(taken.id).id == taken.id
        # Alice's response is still hers, with her own answer; Bob still cannot see it.
        assert alice.responses.retrieve(created.id).output_text == created.output_text
        assert not_found_body(lambda: bob.responses.retrieve(created.id))["code"] == "response_not_found"
    follow = alice.responses.create(model="kimi-k3", input="And?", previous_response_id=created.id,
                                    max_output_tokens=2)
    assert follow.previous_response_id == created.id


def test_a_recorded_response_id_never_changes_owner(gateway: RunningGateway) -> None:
    """The store keeps an id's first owner when an engine answers the same id again."""
    store = gateway.server.app.state.gateway.responses
    rid = f"resp_{uuid.uuid4().hex}"
    url = gateway.server.app.state.gateway.config.pools[0].workers[0]

    async def record(owner: str) -> ResponseOwner | None:
        store.record(rid, ResponseOwner("p", url, owner))
        await store.flush()
        return await store.lookup(rid)

    assert gateway.server.call(record("alice")) == ResponseOwner("p", url, "alice")
    assert gateway.server.call(record("bob")) == ResponseOwner("p", url, "alice")
    assert not_found_body(lambda: sdk(gateway, BOB).responses.retrieve(rid))["code"] == "response_not_found"

    async def forget() -> None:
        store.forget(rid)

    gateway.server.call(forget())  # a deleted response's id may be recorded anew
    assert gateway.server.call(record("bob")) == ResponseOwner("p", url, "bob")
