"""Config sections of the top-level modules (pydantic only): readiness (gateway/app.py), tracing
(gateway/observability/tracing.py) and Redis behind Sentinel (gateway/redis_client.py). They move
with their modules when those become packages (graceful shutdown's is gateway/serving/params.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr

from gateway.config_base import Section


class ReadinessConfig(Section):
    """What `GET /ready` answers 200 for: which pools must have a usable worker (a healthy, correctly
    configured, undrained, non-ejected one; of each role in a PD pool) for this replica to be in rotation.

    `pools: any` (the default): at least one pool serves, so one pool's restart (minutes for a large
    rack) leaves the replica in the load balancer's rotation and the other pools' traffic flows;
    requests only the down pool could serve spill over (`spillover`) or get 503 with `Retry-After`.
    `all`: every pool must serve (the strictest: one pool down takes every replica out).
    A list of pool names: each of those must serve. `none`: no pool must, the replica is ready while it
    runs (for a single-pool deployment whose engines load for many minutes: the replicas stay behind
    the load balancer and answer 503 with `Retry-After` themselves). A draining replica (shutdown
    began) is never ready.
    """

    pools: Literal["any", "all", "none"] | list[Annotated[str, Field(min_length=1)]] = Field(
        default="any",
        description="any | all | none | [pool names]: the pools that must serve for /ready to answer 200")

    def is_ready(self, names: list[str], unready: list[str]) -> bool:
        """Whether pools `names` (the running config's, in order), of which `unready` have no usable
        worker, make this replica ready (shutdown aside)."""
        down = set(unready)
        if self.pools == "none":
            return True
        if self.pools == "any":
            return any(name not in down for name in names)
        if self.pools == "all":
            return not down
        return not down.intersection(self.pools)


class TracingConfig(Section):
    """Optional OpenTelemetry traces (gateway/observability/tracing.py); off while `otlp_endpoint` is unset.

    Needs the `tracing` extra (`pip install 'kimi-gateway[tracing]'`)."""

    otlp_endpoint: str | None = Field(
        default=None, pattern=r"^https?://",
        description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces",
    )
    service_name: str = Field(default="kimi-gateway", description="the traces' `service.name`")
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0, description="share of requests traced")
    export_delay: float = Field(default=2.0, gt=0, description="seconds between batch exports")


class RedisSentinelConfig(Section):
    """Redis behind Sentinel: the gateway asks these sentinels where the primary of `service_name` is
    and follows it across failovers (gateway/redis_client.py). Rendered to a `redis+sentinel://` URL."""

    sentinels: list[Annotated[str, Field(pattern=r"^(\[[0-9A-Fa-f:.]+\]|[^\s:,/\[\]@]+)(:\d{1,5})?$")]] = Field(
        min_length=1, description="sentinel addresses, `host[:port]` (port 26379 when left out)")
    service_name: str = Field(min_length=1, description="the primary's name the sentinels monitor (`mymaster`)")
    db: int = Field(default=0, ge=0, description="database number on the primary")
    username: str | None = Field(default=None, description="the primary's ACL user")
    password: SecretStr | None = Field(default=None, description="the primary's password")
    sentinel_password: SecretStr | None = Field(default=None, description="the sentinels' password, if any")

    def url(self) -> str:
        """This block as a `redis+sentinel://` URL."""
        from gateway.redis_client import SentinelTarget, sentinel_address  # late: config stays free of redis-py

        def secret(value: SecretStr | None) -> str | None:
            return value.get_secret_value() if value is not None else None

        return SentinelTarget(tuple(sentinel_address(s) for s in self.sentinels), self.service_name, self.db,
                              self.username, secret(self.password), secret(self.sentinel_password)).url()
