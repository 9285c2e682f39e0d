"""Config section of the serving shell (pydantic only): graceful shutdown (gateway/serving/lifecycle.py)."""

from __future__ import annotations

from pydantic import Field

from gateway.config_base import Section


class ShutdownConfig(Section):
    """Graceful shutdown on SIGTERM/SIGINT: drain readiness first, then let in-flight requests finish.

    Order: `/ready` answers 503 (`"draining": true`) for `drain_delay` seconds while the listener
    stays open and new requests are still served (the load balancer has not noticed yet); then the
    listener closes and in-flight requests may run for `grace_period` seconds more; whatever is
    still running then is cancelled, which closes its upstream request so the engine aborts it.
    """

    drain_delay: float = Field(
        default=5.0, ge=0, description="seconds /ready answers 503 before the listener closes (LB notice time)"
    )
    grace_period: float = Field(
        default=30.0, ge=0, description="seconds in-flight requests may still run after the listener closed"
    )
