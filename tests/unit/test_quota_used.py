"""`quota_used`: what a finished request counts against its key's token limit (issue 10 §8)."""

from __future__ import annotations

import pytest

from gateway.auth.guard import AuthGuard, Reservation
from gateway.auth.keys import KeyRing, Principal
from gateway.auth.limits import MemoryRateLimiter
from gateway.auth.params import AuthConfig
from gateway.dispatch.ledger import quota_used
from gateway.errors import RateLimited
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import RequestRecord
from gateway.routing.features import RoutingRequest

REQUEST = RoutingRequest(api="completions", model="kimi-k3", prompt_tokens=40, output_tokens=500, stream=True,
                         modalities=frozenset({"text"}), estimate_method="bytes", outputs=2,
                         batch_prompt_tokens=70)
RESERVED = 70 + 2 * 500


def record(**fields: object) -> RequestRecord:
    rec = RequestRecord(request_id="r", api="completions")
    for name, value in fields.items():
        setattr(rec, name, value)
    return rec


@pytest.mark.parametrize(("fields", "failed", "expected"), [
    ({"usage": {"prompt_tokens": 70, "completion_tokens": 33}, "reached_engine": True}, False, 103),
    ({"usage": {"prompt_tokens": 70, "completion_tokens": 9}, "reached_engine": True}, True, 79),  # usage wins
    ({"reached_engine": True, "status": 200}, False, RESERVED),  # answered without usage: keep the charge
    ({"reached_engine": True, "outcome": "upstream_error", "status": 200}, True, 70),  # the batch's prompts
    ({"reached_engine": True, "outcome": "timeout"}, True, 70),
    ({"reached_engine": False, "status": 503}, True, None),  # no engine worked on it: all back
    ({"reached_engine": False, "status": 400}, True, None),  # an engine's refusal (too long, bad field)
    ({"disconnect_stage": "mid_stream", "reached_engine": True}, True, RESERVED),  # hung up: kept
    ({"disconnect_stage": "before_response"}, True, RESERVED),
    ({"usage": {"prompt_tokens": "70"}, "reached_engine": True, "outcome": "upstream_error"}, True, 70),
    # A prompt the engine counted as 0 (or reported nowhere the gateway read) is the estimate: none is empty.
    ({"usage": {"prompt_tokens": 0, "completion_tokens": 33}, "reached_engine": True}, False, 70 + 33),
])
def test_quota_used(fields: dict[str, object], failed: bool, expected: int | None) -> None:
    assert quota_used(record(**fields), REQUEST, RESERVED, failed) == expected


@pytest.mark.anyio
async def test_settle_once_and_release_in_full() -> None:
    limiter = MemoryRateLimiter(clock=lambda: 30.0)
    guard = AuthGuard(AuthConfig(), KeyRing([]), limiter, GatewayMetrics())
    alice = Principal("alice", frozenset({"user"}), 2, 100)
    first = await guard.check_quota(alice, 90)
    assert isinstance(first, Reservation) and first.tokens == 90
    await guard.settle(first, 20)
    await guard.settle(first, 0)  # a second settle of the same reservation does nothing
    second = await guard.check_quota(alice, 80)  # 20 + 80: fits only after the first settle
    assert second is not None
    await guard.settle(second, None)  # released in full, the request too
    third = await guard.check_quota(alice, 80)
    assert third is not None and third.window == first.window
    assert await guard.check_quota(Principal("ops", frozenset({"user"}), None, None), 10**9) is None


@pytest.mark.anyio
@pytest.mark.parametrize("tpm", [100, None])
async def test_the_arrival_count_is_released_with_the_request_it_belongs_to(tpm: int | None) -> None:
    """The request counted on arrival (`count_request`) comes back when no engine worked on the
    request, and stays when one did or when the request was the client's mistake."""
    limiter = MemoryRateLimiter(clock=lambda: 30.0)
    guard = AuthGuard(AuthConfig(), KeyRing([]), limiter, GatewayMetrics())
    alice = Principal("alice", frozenset({"user"}), 2, tpm)
    for _ in range(5):  # an outage: five failed requests, none of them counted in the end
        counted = await guard.count_request(alice)
        assert counted is not None and counted.requests == 1 and counted.tokens == 0
        charge = await guard.check_quota(alice, 60, requests=0, counted=counted)
        assert charge is not None and charge.counted is (None if tpm is None else counted)
        await guard.settle(charge, None)
    served = await guard.check_quota(alice, 60, requests=0, counted=await guard.count_request(alice))
    assert served is not None
    await guard.settle(served, 30)  # an engine answered: the request stays counted, the tokens settle
    await guard.count_request(alice)  # a 400 from the gateway: counted, never settled
    with pytest.raises(RateLimited):
        await guard.count_request(alice)  # 2 requests a minute, both used
