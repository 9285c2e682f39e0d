"""Prometheus collectors of one gateway, on their own CollectorRegistry (bounded labels only).

Labels are pool, worker (`pool/index`), reason, outcome, status class (`2xx`...), api, method and
model: values the gateway's config or code defines, never strings a client sent. `model` (on the
request, TTFT, TPOT and token metrics) is the request's resolved model, a configured model's
canonical name or a LoRA adapter a pool declares or its engines list (`Ledger.parsed`), `none`
before the body named one the gateway serves: a client's unknown name adds no series.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client import Histogram as _Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

# LLM latencies run from milliseconds (a cached short prompt) to minutes (a 1M-token prefill).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
                   120.0, 300.0, 600.0)
# Time per output token: tens of ms is typical decode; seconds means a starved engine.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (128, 512, 2048, 8192, 32768, 131072, 262144, 524288, 1048576, 2097152)

NO_POOL = "none"
NO_MODEL = "none"
"""The `model` label of a request refused before its body named a model the gateway serves."""


class _MemoLabels:
    """`labels(*values)` memoised per metric: prometheus_client's own validates, converts and takes
    a lock on every call, and the request path makes ~15 such calls (2.6 % of a loaded gateway's
    CPU in a profile). Children are removed only through `forget`, which drops them from the memo too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._memo: dict[tuple[str, ...], Any] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **by_name: Any) -> Any:
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        child = self._memo.get(values)
        if child is None:
            child = self._memo[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def forget(self, position: int, value: str) -> None:
        """Remove every child whose label at `position` is `value` (a worker that is gone)."""
        for values in [v for v in self._memo if len(v) > position and v[position] == value]:
            del self._memo[values]
            self.remove(*values)  # type: ignore[attr-defined]


class Counter(_MemoLabels, _Counter):
    """prometheus_client's Counter with memoised `labels()`."""


class Gauge(_MemoLabels, _Gauge):
    """prometheus_client's Gauge with memoised `labels()`."""


class Histogram(_MemoLabels, _Histogram):
    """prometheus_client's Histogram with memoised `labels()`."""


def status_class(status: int) -> str:
    return f"{status // 100}xx"


class GatewayMetrics:
    """Every collector the gateway exports; `render()` gives the exposition text and content type.

    With several serving processes (`processes: N`, gateway/process/supervisor.py) every process writes its
    samples to files in `multiprocess_dir` (prometheus_client's multiprocess mode, switched on by
    the `PROMETHEUS_MULTIPROC_DIR` variable the supervisor sets before the processes start) and
    `render()` sums them, so any process answers `/metrics` for all. Each gauge says how its
    per-process values combine (`multiprocess_mode`; ignored with one process).
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kimi_gateway_requests", "Finished client requests.",
                                ["api", "pool", "status_class", "model"], registry=r)
        self.request_seconds = Histogram("kimi_gateway_request_duration_seconds",
                                         "End-to-end request time, arrival to last byte.", ["pool", "model"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("kimi_gateway_ttft_seconds",
                                      "Time from arrival to the first upstream body byte (streaming).",
                                      ["pool", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot_seconds = Histogram("kimi_gateway_tpot_seconds",
                                      "Time per output token after the first (streaming): (end - first byte) / "
                                      "(completion tokens - 1).", ["pool", "model"], buckets=TPOT_BUCKETS,
                                      registry=r)
        self.route_decisions = Counter("kimi_gateway_route_decisions", "Worker choices by policy reason.",
                                       ["pool", "reason"], registry=r)
        # Prefill/decode pools (issue 13); decode TTFT and TPOT are the pool's ttft/tpot above.
        self.pd_route_decisions = Counter("kimi_gateway_pd_route_decisions",
                                          "PD pools: worker choices per phase (prefill, decode) by policy reason.",
                                          ["pool", "phase", "reason"], registry=r)
        self.pd_prefill_seconds = Histogram("kimi_gateway_pd_prefill_seconds",
                                            "PD pools: time from sending the prefill leg to its whole answer.",
                                            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.pd_handoff_seconds = Histogram("kimi_gateway_pd_kv_handoff_seconds",
                                            "PD pools: time from the prefill leg's answer to the decode leg's "
                                            "first byte (the KV transfer and the first decode step).",
                                            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.pd_leg_failures = Counter("kimi_gateway_pd_leg_failures",
                                       "PD pools: failed legs by phase (prefill, decode) and upstream outcome.",
                                       ["pool", "phase", "outcome"], registry=r)
        self.upstream_attempts = Counter("kimi_gateway_upstream_attempts",
                                         "Upstream attempts by outcome (ok, connect_error, timeout, "
                                         "status_5xx, status_429, too_long, client_error, protocol_error).",
                                         ["pool", "worker", "outcome"], registry=r)
        self.retries = Counter("kimi_gateway_retries",
                               "Attempts after the first, by what failed before (cause: an upstream outcome).",
                               ["pool", "cause"], registry=r)
        self.migrations = Counter("kimi_gateway_migrations",
                                  "Streams whose worker failed mid-generation, by what the gateway did: "
                                  "migrated (continued on another worker), no_worker, failed (the continuation "
                                  "failed before its first content), refused (not at a safe point).",
                                  ["pool", "outcome"], registry=r)
        self.migration_prefill_tokens = Counter("kimi_gateway_migration_prefill_tokens",
                                                "Prompt tokens prefilled again by continuations (the original "
                                                "prompt plus the text so far; not billed to the key).", ["pool"],
                                                registry=r)
        self.spillovers = Counter("kimi_gateway_spillovers",
                                  "Requests moved to a later pool (cause: unavailable, saturated or too_long).",
                                  ["from_pool", "to_pool", "cause"], registry=r)
        self.estimated_prompt_tokens = Histogram("kimi_gateway_estimated_prompt_tokens",
                                                 "Estimated prompt tokens per routed request.",
                                                 ["pool", "method"], buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter("kimi_gateway_tokens", "Tokens reported by the engines' usage.",
                              ["pool", "kind", "model"], registry=r)
        self.in_flight = Gauge("kimi_gateway_in_flight", "Open upstream requests of this replica.",
                               ["pool", "worker"], multiprocess_mode="livesum", registry=r)
        self.worker_healthy = Gauge("kimi_gateway_worker_healthy", "1 when the worker passes its probes.",
                                    ["pool", "worker"], multiprocess_mode="livemin", registry=r)
        self.worker_draining = Gauge("kimi_gateway_worker_draining",
                                     "1 while an operator has drained the worker (admin API): no new requests.",
                                     ["pool", "worker"], multiprocess_mode="livemax", registry=r)
        self.worker_ejected = Gauge("kimi_gateway_worker_ejected", "1 while the worker is ejected as an outlier.",
                                    ["pool", "worker"], multiprocess_mode="livemax", registry=r)
        self.worker_misconfigured = Gauge(
            "kimi_gateway_worker_misconfigured", "1 while the worker's /v1/models lacks the pool's served model "
            "name or reports another max_model_len than its max_context_tokens: no traffic.",
            ["pool", "worker"], multiprocess_mode="livemax", registry=r)
        self.worker_role = Gauge("kimi_gateway_worker_role",
                                 "1 per worker of a prefill/decode pool, labelled with its role (prefill, decode): "
                                 "join on `worker` to split any worker series by role.",
                                 ["pool", "worker", "role"], multiprocess_mode="livemax", registry=r)
        self.ejections = Counter("kimi_gateway_worker_ejections",
                                 "Outlier ejections after consecutive failed requests.", ["pool", "worker"],
                                 registry=r)
        self.client_disconnects = Counter("kimi_gateway_client_disconnects",
                                          "Clients that hung up before the response ended (stage).",
                                          ["pool", "stage"], registry=r)
        self.client_send_stalls = Counter("kimi_gateway_client_send_stalls",
                                          "Responses ended because the client took no byte of them for "
                                          "timeouts.send_stall seconds (the engine request is aborted).", ["pool"],
                                          registry=r)

        self.affinity_lookups = Counter("kimi_gateway_affinity_lookups",
                                        "Affinity lookups by result (hit, miss, error, skipped).",
                                        ["pool", "result"], registry=r)
        self.affinity_match_ratio = Histogram("kimi_gateway_affinity_match_ratio",
                                              "Share of the prompt the chosen worker holds per affinity.",
                                              ["pool"], buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
                                              registry=r)
        self.affinity_writes_dropped = Counter("kimi_gateway_affinity_writes_dropped",
                                               "Affinity records dropped (queue full or Redis down).", registry=r)
        self.response_affinity = Counter("kimi_gateway_response_affinity",
                                         "Responses API follow-ups by stored-response lookup (result: hit, unknown, "
                                         "worker_gone, worker_unavailable, store_error).", ["result"], registry=r)
        self.redis_errors = Counter("kimi_gateway_redis_errors", "Redis calls that failed or timed out.", ["op"],
                                    registry=r)
        self.redis_up: Gauge | None = None  # created by `track_redis()`: absent without Redis
        self.redis_seconds = Histogram("kimi_gateway_redis_seconds", "Redis call latency.", ["op"],
                                       buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
                                       registry=r)
        self.engine_load = Gauge("kimi_gateway_engine_load",
                                 "Scraped engine load: running, waiting, kv_usage (0..1).",
                                 ["pool", "worker", "signal"], multiprocess_mode="livemostrecent", registry=r)

        # Flow control (gateway/flow/): `band` is a priority band, an integer of -10..10.
        self.flow_queued = Gauge("kimi_gateway_flow_queued",
                                 "Requests flow control holds at the gateway now, per pool and priority band.",
                                 ["pool", "band"], multiprocess_mode="livesum", registry=r)
        self.flow_requests = Counter("kimi_gateway_flow_requests",
                                     "Requests flow control held (outcome: held when it began; then dispatched, "
                                     "expired after queue_timeout, gone: the client left; refused: a queue bound "
                                     "was full).", ["pool", "band", "outcome"], registry=r)
        self.flow_wait_seconds = Histogram("kimi_gateway_flow_wait_seconds",
                                           "Time a request flow control held spent at the gateway (every outcome).",
                                           ["pool", "band"], buckets=LATENCY_BUCKETS, registry=r)
        # Auth (gateway/auth/): `key` is a key's configured name, never the key.
        self.auth_failures = Counter("kimi_gateway_auth_failures",
                                     "Requests refused by auth (reason: missing, invalid, forbidden, model: a "
                                     "model the key may not use).", ["reason"], registry=r)
        self.rate_limited = Counter("kimi_gateway_rate_limited",
                                    "Requests refused by a per-key limit (limit: requests, tokens), its limits on "
                                    "one model included.", ["key", "limit"], registry=r)
        self.model_rate_limited = Counter("kimi_gateway_model_rate_limited",
                                          "Requests refused by a key's limits on one model or LoRA adapter "
                                          "(auth.keys[].model_limits; limit: requests, tokens).",
                                          ["key", "model", "limit"], registry=r)
        self.rate_limit_unavailable = Counter("kimi_gateway_rate_limit_unavailable",
                                              "Rate-limit checks Redis could not answer (action: allowed = "
                                              "fail open, refused = fail closed).", ["action"], registry=r)
        # LoRA adapters loaded and unloaded on demand (gateway/backends/lora_loader.py).
        self.lora_loads = Counter("kimi_gateway_lora_loads",
                                  "LoRA adapters the gateway asked a worker to load on demand (outcome: ok, "
                                  "already_loaded, refused, full, error).", ["pool", "outcome"], registry=r)
        self.lora_unloads = Counter("kimi_gateway_lora_unloads",
                                    "On-demand LoRA adapters the gateway unloaded to make room (outcome: ok, gone, "
                                    "refused, error).", ["pool", "outcome"], registry=r)
        self.image_fetches = Counter("kimi_gateway_image_fetches",
                                     "Client image URLs fetched to measure their size (result: ok, refused, error, "
                                     "timeout, too_large, skipped).", ["result"], registry=r)

    # Named writes for code outside the request path (the request path's are the ledger's,
    # gateway/dispatch/ledger.py): one method per event, so `.labels(` lives here and in the ledger.

    def worker_added(self, pool: str, worker: str, role: str | None, healthy: bool) -> None:
        """A worker joined `pool`: its state series exist from the start (alerts see a 0, not nothing)."""
        self.worker_draining.labels(pool, worker).set(0)
        self.worker_ejected.labels(pool, worker).set(0)
        self.worker_misconfigured.labels(pool, worker).set(0)
        if role is not None:
            self.worker_role.labels(pool, worker, role).set(1)
        self.worker_healthy.labels(pool, worker).set(1 if healthy else 0)

    def worker_health(self, pool: str, worker: str, healthy: bool) -> None:
        """`kimi_gateway_worker_healthy` after a probe's verdict."""
        self.worker_healthy.labels(pool, worker).set(1 if healthy else 0)

    def worker_misconfig(self, pool: str, worker: str, misconfigured: bool) -> None:
        """`kimi_gateway_worker_misconfigured` after a `/v1/models` check."""
        self.worker_misconfigured.labels(pool, worker).set(1 if misconfigured else 0)

    def worker_drain(self, pool: str, worker: str, draining: bool) -> None:
        """`kimi_gateway_worker_draining` after an operator's drain or undrain."""
        self.worker_draining.labels(pool, worker).set(1 if draining else 0)

    def worker_ejection(self, pool: str, worker: str, ejected: bool) -> None:
        """An ejection began (`ejected`: counted in `kimi_gateway_worker_ejections`, the gauge at 1)
        or ended (the gauge at 0)."""
        if ejected:
            self.ejections.labels(pool, worker).inc()
        self.worker_ejected.labels(pool, worker).set(1 if ejected else 0)

    def engine_load_scraped(self, pool: str, worker: str, signal: str, value: float) -> None:
        """One scraped engine load signal (`running`, `waiting`, `kv_usage`)."""
        self.engine_load.labels(pool, worker, signal).set(value)

    def worker_in_flight(self, pool: str, worker: str, delta: int) -> None:
        """This replica's open upstream requests on a worker, up or down by `delta` (a leg's slot)."""
        self.in_flight.labels(pool, worker).inc(delta)

    def flow_held(self, pool: str, band: str) -> None:
        """Flow control began holding a request of `band` for `pool`."""
        self.flow_queued.labels(pool, band).inc()
        self.flow_requests.labels(pool, band, "held").inc()

    def flow_left(self, pool: str, band: str, outcome: str, waited: float) -> None:
        """A held request left after `waited` seconds: `dispatched`, `expired` or `gone`."""
        self.flow_queued.labels(pool, band).dec()
        self.flow_requests.labels(pool, band, outcome).inc()
        self.flow_wait_seconds.labels(pool, band).observe(waited)

    def flow_refused(self, pool: str, band: str) -> None:
        """A request flow control would have held was refused: a queue bound was full."""
        self.flow_requests.labels(pool, band, "refused").inc()

    def redis_error(self, op: str) -> None:
        """A Redis call of `op` (`lookup`, `write`, `rate_limit`, ...) failed or timed out."""
        self.redis_errors.labels(op).inc()

    def redis_call(self, op: str, seconds: float) -> None:
        """How long a Redis call of `op` took."""
        self.redis_seconds.labels(op).observe(seconds)

    def affinity_lookup(self, pool: str, result: str) -> None:
        """One affinity lookup's result: `hit`, `miss`, `error`, `skipped`."""
        self.affinity_lookups.labels(pool, result).inc()

    def response_lookup(self, result: str) -> None:
        """One stored-response lookup's result (`hit`, `unknown`, `worker_gone`, `worker_unavailable`,
        `store_error`)."""
        self.response_affinity.labels(result).inc()

    def auth_failure(self, reason: str) -> None:
        """A request refused by auth: `missing`, `invalid`, `forbidden`, `model`."""
        self.auth_failures.labels(reason).inc()

    def rate_limit_refused(self, key: str, limit: str) -> None:
        """A request refused by key `key`'s `limit` (`requests`, `tokens`)."""
        self.rate_limited.labels(key, limit).inc()

    def model_rate_limit_refused(self, key: str, model: str, limit: str) -> None:
        """A request refused by key `key`'s `limit` on `model` (a name of its `model_limits`: configured, bounded)."""
        self.model_rate_limited.labels(key, model, limit).inc()

    def rate_limit_unanswered(self, action: str) -> None:
        """A rate-limit check Redis could not answer: `allowed` (fail open) or `refused`."""
        self.rate_limit_unavailable.labels(action).inc()

    def image_fetched(self, result: str, count: int = 1) -> None:
        """`count` client image URLs ended with `result` (`ok`, `refused`, `error`, `timeout`, ...)."""
        self.image_fetches.labels(result).inc(count)

    def lora_load(self, pool: str, outcome: str) -> None:
        """One on-demand LoRA load on a worker of `pool`: `ok`, `already_loaded` (the engine had it),
        `refused` (the engine's 4xx), `full` (SGLang's --max-loaded-loras refusal), `error` (no answer, 5xx)."""
        self.lora_loads.labels(pool, outcome).inc()

    def lora_unload(self, pool: str, outcome: str) -> None:
        """One eviction's unload on a worker of `pool`: `ok`, `gone` (the engine no longer had it),
        `refused` (the engine's 4xx), `error` (no answer, 5xx)."""
        self.lora_unloads.labels(pool, outcome).inc()

    def forget_worker(self, worker_id: str) -> None:
        """Remove every series labelled with `worker_id` (a worker discovery or a reload removed,
        once its requests finished), so dashboards stop showing an engine that is gone. Not with
        several serving processes: prometheus_client's multiprocess files cannot drop a series, so
        there they stay (at their last values) until the processes restart."""
        if self.multiprocess_dir is not None:
            return
        for metric in (self.upstream_attempts, self.in_flight, self.worker_healthy, self.worker_draining,
                       self.worker_ejected, self.worker_misconfigured, self.ejections, self.engine_load,
                       self.worker_role):
            metric.forget(1, worker_id)

    def track_redis(self) -> Gauge:
        """`kimi_gateway_redis_up`, created by the one Redis affinity store: a gateway without Redis
        exports no such series (a 0 would fire "Redis down" alerts where there is no Redis)."""
        if self.redis_up is None:
            self.redis_up = Gauge("kimi_gateway_redis_up",
                                  "1 while the affinity store reaches Redis, 0 while its circuit breaker is open "
                                  "(absent without Redis).", multiprocess_mode="livemin", registry=self.registry)
        return self.redis_up

    def render(self) -> tuple[bytes, str]:
        """The exposition text of this process (or of every live process in multiprocess mode)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged), CONTENT_TYPE_LATEST
