"""`kimi-gateway drain` (issue 24 §4): an engine pod's preStop hook drains its worker on every gateway
replica (shared through Redis), new requests go elsewhere on both, the streams in flight finish,
and the command returns once they are done. Two real gateways on loopback sharing the real Redis,
real sims as the engines, the command as a real process with the admin key in its environment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from gateway.auth.keys import hash_key
from gateway.cli import main
from tests.support import REPO_ROOT, OwnRedis, RunningGateway, RunningSim, free_port, pool, shared_redis_url

StartSim = Callable[..., RunningSim]
StartGateway = Callable[..., RunningGateway]
KEY = "drain-test-key-0123456789abcdef"
AUTH = {"authorization": f"Bearer {KEY}"}
SHORT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
STREAM = {"model": "kimi-k3", "messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 50,
          "stream": True}


def drain(*args: str, key: str | None = KEY) -> subprocess.Popen[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **({"OPS_ADMIN_KEY": key} if key else {})}
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "drain", "--admin-key-env", "OPS_ADMIN_KEY",
                             *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


class Stream(threading.Thread):
    """One streamed chat request read to its end in a thread: `worker` once the headers came,
    `lines` (the SSE data lines) and `ended` (monotonic time of the last byte) once done."""

    def __init__(self, gw: RunningGateway, max_tokens: int = 50) -> None:
        super().__init__(daemon=True)
        self.gw, self.worker, self.lines, self.ended = gw, "", [], 0.0
        self.body = {**STREAM, "max_tokens": max_tokens}
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.gw.v1 + "/chat/completions", json=self.body, headers=AUTH, timeout=30) as answer:
            self.worker = answer.headers["x-kimi-gateway-worker"]
            self.started.set()
            self.lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
        self.ended = time.monotonic()


def open_stream(gw: RunningGateway, max_tokens: int = 50) -> Stream:
    stream = Stream(gw, max_tokens)
    stream.start()
    assert stream.started.wait(10), "the stream got no headers"
    return stream


def in_flight(gw: RunningGateway, worker: str) -> tuple[bool, int]:
    snapshot = httpx.get(f"{gw.url}/admin/workers/{worker}", headers=AUTH, timeout=5).json()
    return snapshot["draining"], snapshot["in_flight"]


def test_drain_by_url_moves_new_requests_on_both_replicas_and_waits_for_the_streams(
        start_sim: StartSim, start_gateway: StartGateway, request: pytest.FixtureRequest) -> None:
    key_prefix = f"kgw-test-drain-cmd-{uuid.uuid4().hex[:8]}"
    store = redis.Redis.from_url(shared_redis_url())
    request.addfinalizer(lambda: (store.delete(f"{key_prefix}:drained-urls"), store.close()))
    # 50 tokens: ~8 s a stream, long enough on a loaded machine for the drain command (a Python
    # process that imports the gateway) to start and both replicas to see the drain before the streams
    # end (at ~5 s a stream they ended first once, in a clean-clone CI run on a slow 2-core machine)
    sims = [start_sim("vllm", tpot_s=0.16), start_sim("vllm", tpot_s=0.16)]
    settings: dict[str, Any] = {
        "redis_url": shared_redis_url(), "affinity": {"key_prefix": key_prefix},
        "auth": {"enabled": True, "keys": [{"name": "ops", "sha256": hash_key(KEY), "scopes": ["user", "admin"]}]}}
    first, second = (start_gateway([pool("p", "vllm", [s.url for s in sims], 131072, policy="round_robin")],
                                   **settings) for _ in range(2))
    streams = [open_stream(first)]
    target = streams[0].worker  # round robin: the second replica's next stream or the one after lands there too
    while len([s for s in streams if s.worker == target]) < 2:
        assert len(streams) < 5
        streams.append(open_stream(second))
    on_target = [s for s in streams if s.worker == target]
    url = sims[int(target.split("/")[1])].url
    other = "p/1" if target == "p/0" else "p/0"

    command = drain("--gateway", first.url, "--gateway", second.url, "--pool", "p", "--worker", url + "/",
                    "--wait", "20", "--interval", "0.1")
    deadline = time.monotonic() + 10
    while not (in_flight(first, target)[0] and in_flight(second, target)[0]):
        assert time.monotonic() < deadline and command.poll() is None, command.stderr.read() if command.stderr else ""
        time.sleep(0.05)
    assert any(in_flight(gw, target)[1] for gw in (first, second)), "the streams ended before the test could look"
    for gw in (first, second):  # new requests go to the other worker on both replicas
        for _ in range(3):
            answer = httpx.post(gw.v1 + "/chat/completions", json=SHORT, headers=AUTH, timeout=10)
            assert answer.status_code == 200 and answer.headers["x-kimi-gateway-worker"] == other
    assert command.poll() is None  # still waiting for the streams in flight
    _, err = command.communicate(timeout=30)
    target_sim = sims[int(target.split("/")[1])]
    # every stream on the drained worker was generated to its end before the command returned
    assert {(r.completion_tokens_sent, r.completed, r.aborted) for r in target_sim.engine.records} == {
        (50, True, False)}
    assert command.returncode == 0, err
    for stream in on_target:
        stream.join(10)
        assert stream.lines[-1] == "data: [DONE]" and len(stream.lines) > 10  # finished, not cut
    assert f"drained {target} ({url}) on every replica (shared through Redis)" in err
    assert f"{target}: 0 requests in flight on 2 gateway(s)" in err
    assert in_flight(first, target) == in_flight(second, target) == (True, 0)

    # The engine is back: --undrain puts it into service on both replicas again.
    undrain = drain("--gateway", second.url, "--pool", "p", "--worker", url, "--undrain")
    _, err = undrain.communicate(timeout=30)
    assert undrain.returncode == 0 and f"undrained {target} ({url}) on every replica" in err, err
    deadline = time.monotonic() + 10
    while in_flight(first, target)[0]:  # the ~1 s Redis sync
        assert time.monotonic() < deadline, "the undrain did not reach the first replica"
        time.sleep(0.05)


def test_one_service_url_waits_for_the_streams_of_every_replica(
        start_sim: StartSim, start_gateway: StartGateway, request: pytest.FixtureRequest) -> None:
    """Behind a Service each call reaches one replica, which counts only its own streams: the
    command waits on `fleet_in_flight`, every replica's count reported through Redis."""
    key_prefix = f"kgw-test-drain-fleet-{uuid.uuid4().hex[:8]}"
    store = redis.Redis.from_url(shared_redis_url())
    request.addfinalizer(lambda: (store.delete(f"{key_prefix}:drained-urls", f"{key_prefix}:inflight:p {sim.url}"),
                                  store.close()))
    sim = start_sim("vllm", tpot_s=0.04)
    settings: dict[str, Any] = {
        "redis_url": shared_redis_url(), "affinity": {"key_prefix": key_prefix},
        "auth": {"enabled": True, "keys": [{"name": "ops", "sha256": hash_key(KEY), "scopes": ["user", "admin"]}]}}
    first, second = (start_gateway([pool("p", "vllm", [sim.url], 131072)], **settings) for _ in range(2))
    short, long = open_stream(first, max_tokens=5), open_stream(second, max_tokens=100)  # ~0.2 s and ~4 s
    command = drain("--gateway", first.url, "--pool", "p", "--worker", sim.url, "--wait", "20", "--interval", "0.1")
    _, err = command.communicate(timeout=30)
    # The engine may stop now: it generated every token of the other replica's stream (the relay of
    # the last bytes to the client needs it no more).
    assert [(r.completion_tokens_sent, r.completed, r.aborted) for r in sim.engine.records] == [
        (5, True, False), (100, True, False)]
    assert command.returncode == 0, err
    long.join(10)
    short.join(10)
    assert long.lines[-1] == "data: [DONE]"
    assert "0 requests in flight on 1 gateway(s) and every replica reporting through Redis" in err
    fleet = httpx.get(f"{first.url}/admin/workers/p/0", headers=AUTH, timeout=5).json()["fleet_in_flight"]
    assert fleet == {"in_flight": 0, "reporters": 2}


def run_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kimi-gateway drain ARGS` run by `main` in this process: (exit status, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(["drain", "--admin-key-env", "OPS_ADMIN_KEY", *args])
    return int(exited.value.code or 0), capsys.readouterr().err


def test_drain_errors_exit_1_with_the_reason(start_sim: StartSim, start_gateway: StartGateway, unused_port: int,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    sim = start_sim("vllm", tpot_s=0.02)
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)],
                       auth={"enabled": True, "keys": [{"name": "ops", "sha256": hash_key(KEY),
                                                        "scopes": ["user", "admin"]}]})
    monkeypatch.delenv("OPS_ADMIN_KEY", raising=False)
    assert run_in_process(capsys, "--gateway", gw.url, "--pool", "p", "--worker", "0") == (1, (
        f"kimi-gateway drain: error: GET {gw.url}/admin/workers: HTTP 401: the gateway wants a key with the drain (or "
        "admin) scope in the variable --admin-key-env names\n"))
    monkeypatch.setenv("OPS_ADMIN_KEY", KEY)
    for args, reason in [
            (("--pool", "q", "--worker", "0"), "the gateway has no pool 'q' (pools: p)"),
            (("--pool", "p", "--worker", "http://127.0.0.1:1"),
             f"pool p has no worker http://127.0.0.1:1 (its workers: 0: {sim.url})")]:
        code, err = run_in_process(capsys, "--gateway", gw.url, *args)
        assert code == 1 and reason in err, err
    code, err = run_in_process(capsys, "--gateway", f"http://127.0.0.1:{unused_port}", "--pool", "p", "--worker", "0")
    assert code == 1 and "ConnectError" in err, err
    assert in_flight(gw, "p/0") == (False, 0)  # nothing was drained by a failed call
    # An address where nothing listens (a replica starting or crash-looping) is skipped, said once.
    code, err = run_in_process(capsys, "--gateway", gw.url, "--gateway", f"http://127.0.0.1:{unused_port}",
                               "--pool", "p", "--worker", "0", "--wait", "5", "--interval", "0.05")
    assert code == 0 and "0 requests in flight on 1 gateway(s) (1 address(es) not answering, skipped)" in err, err
    assert err.count(f"127.0.0.1:{unused_port}") == 1, err
    assert in_flight(gw, "p/0") == (True, 0)
    assert run_in_process(capsys, "--gateway", gw.url, "--pool", "p", "--worker", "0", "--undrain")[0] == 0
    # A stream longer than --wait: exit 1 naming what is still in flight (no Redis: this replica only).
    stream = open_stream(gw)
    code, err = run_in_process(capsys, "--gateway", gw.url, "--pool", "p", "--worker", "0", "--wait", "0.2",
                               "--interval", "0.05")
    assert code == 1, err
    assert "on the replica that answered only" in err and f"still in flight after 0.2 s: {gw.url} 1" in err
    stream.join(10)
    assert stream.lines[-1] == "data: [DONE]"


def test_without_a_shared_redis_the_drain_and_undrain_reach_every_replica_given(
        start_sim: StartSim, start_gateway: StartGateway, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Replicas that share no Redis (none configured, or Redis down): the drain is sent to each
    `--gateway` URL, not only the first, and so is the undrain; an address where nothing listens
    (first here, as a dead replica's address may sort first) is skipped by both."""
    sim = start_sim("vllm", tpot_s=0.02)
    keys = {"enabled": True, "keys": [{"name": "engine", "sha256": hash_key(KEY), "scopes": ["drain"]}]}
    replicas = [start_gateway([pool("p", "vllm", [sim.url], 131072)], auth=keys) for _ in range(2)]
    monkeypatch.setenv("OPS_ADMIN_KEY", KEY)
    gateways = ["--gateway", f"http://127.0.0.1:{free_port()}"] + [
        arg for gw in replicas for arg in ("--gateway", gw.url)]
    status, err = run_in_process(capsys, *gateways, "--pool", "p", "--worker", sim.url, "--wait", "10")
    assert status == 0, err
    assert [in_flight(gw, "p/0") for gw in replicas] == [(True, 0), (True, 0)], err
    status, err = run_in_process(capsys, *gateways, "--pool", "p", "--worker", sim.url, "--undrain")
    assert status == 0, err
    assert [in_flight(gw, "p/0") for gw in replicas] == [(False, 0), (False, 0)], err


def test_a_dead_replica_address_stops_neither_the_shared_drain_nor_the_undrain(
        start_sim: StartSim, start_gateway: StartGateway, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    """A headless Service lists a starting or crash-looping replica too: an address where nothing
    listens, which may sort first. The drain goes through the next one (shared through Redis), the
    wait counts the replicas that answer, the dead address is reported once (not at every poll),
    and the undrain reaches the others too."""
    key_prefix = f"kgw-test-drain-dead-{uuid.uuid4().hex[:8]}"
    store = redis.Redis.from_url(shared_redis_url())
    request.addfinalizer(lambda: (store.delete(f"{key_prefix}:drained", f"{key_prefix}:inflight:p/0"),
                                  store.close()))
    sim = start_sim("vllm", tpot_s=0.05)
    settings: dict[str, Any] = {
        "redis_url": shared_redis_url(), "affinity": {"key_prefix": key_prefix},
        "auth": {"enabled": True, "keys": [{"name": "ops", "sha256": hash_key(KEY), "scopes": ["user", "admin"]}]}}
    replicas = [start_gateway([pool("p", "vllm", [sim.url], 131072)], **settings) for _ in range(2)]
    dead = f"http://127.0.0.1:{free_port()}"
    gateways = ["--gateway", dead] + [arg for gw in replicas for arg in ("--gateway", gw.url)]
    monkeypatch.setenv("OPS_ADMIN_KEY", KEY)
    stream = open_stream(replicas[1], max_tokens=30)  # ~1.5 s: the command polls many times meanwhile
    status, err = run_in_process(capsys, *gateways, "--pool", "p", "--worker", sim.url, "--wait", "20",
                                 "--interval", "0.05")
    assert status == 0, err
    stream.join(10)
    assert stream.lines[-1] == "data: [DONE]"
    assert [(r.completion_tokens_sent, r.completed) for r in sim.engine.records] == [(30, True)]
    assert "on every replica (shared through Redis)" in err
    assert "0 requests in flight on 2 gateway(s) and every replica reporting through Redis" in err, err
    assert err.count(dead) == 1, err  # reported once, not at each of the polls
    assert [in_flight(gw, "p/0") for gw in replicas] == [(True, 0), (True, 0)]

    status, err = run_in_process(capsys, *gateways, "--pool", "p", "--worker", sim.url, "--undrain")
    assert status == 0, err
    assert err.count("on every replica (shared through Redis)") == 2 and err.count(dead) == 1, err
    assert [in_flight(gw, "p/0") for gw in replicas] == [(False, 0), (False, 0)]


def test_an_undrain_while_redis_is_down_is_not_done(start_sim: StartSim, start_gateway: StartGateway,
                                                    own_redis: OwnRedis, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Redis holds the drain: an undrain that only the replica reached took (Redis configured but
    down) is undone by that replica's next sync once Redis answers. So `--undrain` exits 1 then (the
    sidecar runs it again), and 0 once Redis took it."""
    sim = start_sim("vllm", tpot_s=0.02)
    key_prefix = f"kgw-test-drain-down-{uuid.uuid4().hex[:8]}"
    gw = start_gateway([pool("p", "vllm", [sim.url], 131072)], redis_url=own_redis.url,
                       affinity={"key_prefix": key_prefix},
                       auth={"enabled": True, "keys": [{"name": "ops", "sha256": hash_key(KEY), "scopes": ["admin"]}]})
    monkeypatch.setenv("OPS_ADMIN_KEY", KEY)
    status, err = run_in_process(capsys, "--gateway", gw.url, "--pool", "p", "--worker", "0", "--wait", "10")
    assert status == 0 and "on every replica (shared through Redis)" in err, err
    own_redis.kill()
    status, err = run_in_process(capsys, "--gateway", gw.url, "--pool", "p", "--worker", "0", "--undrain")
    assert status == 1 and "Redis is configured there but did not answer" in err, err
    assert "run it again" in err
    assert in_flight(gw, "p/0") == (False, 0)  # for now: this replica alone
    own_redis.start()  # back with what it held (this one restarts empty: put the drain back as it was)
    redis.Redis.from_url(own_redis.url).sadd(f"{key_prefix}:drained-urls", f"p {sim.url}")  # drains.shared_key
    deadline = time.monotonic() + 10
    while not in_flight(gw, "p/0")[0]:  # the next sync takes the drain back from Redis
        assert time.monotonic() < deadline, "the replica did not take the drain back from Redis"
        time.sleep(0.05)
    status, err = run_in_process(capsys, "--gateway", gw.url, "--pool", "p", "--worker", "0", "--undrain")
    assert status == 0 and "on every replica (shared through Redis)" in err, err
    assert in_flight(gw, "p/0") == (False, 0)
    time.sleep(1.5)  # a sync later (SYNC_EVERY_S): still in service
    assert in_flight(gw, "p/0") == (False, 0)
