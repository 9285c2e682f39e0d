"""Reloading the config without downtime: SIGHUP or `POST /admin/reload`.

The config file the gateway was started with is read again (`load_config`: plan files, `${VAR}`s
and `KIMI_GATEWAY_*` overrides as at start-up). An invalid file is refused with the reason and the
running config stays. A valid one applies what can change in a running process, `RELOADABLE`:

- `pools`: pools added, removed, reordered or changed (context, policy, limits, api_key...); their
  workers matched by URL (WorkerRegistry.configure): a new worker is unhealthy until probed, a
  removed one takes no new requests and its open streams finish on it;
- `discovery`: nameservers, interval, timeout;
- `readiness`: which pools must serve for `/ready` to answer 200.

Everything else (listener, auth, Redis, timeouts...) needs a restart: such changes are named in
the answer (`restart_required`) and the log, and not applied. Open streams are never touched: they
hold their worker, its lease and the pool's gate, none of which a reload replaces.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pydantic import ValidationError

from gateway.backends.control import pool_headers
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.config_base import explain_validation_error
from gateway.state import AppState

log = logging.getLogger("gateway.serving.reload")

RELOADABLE = ("pools", "discovery", "readiness")


class ReloadRefused(Exception):
    """The new config was not applied; the message says why (the old one stays)."""


@dataclass(slots=True)
class ReloadResult:
    """What a reload changed: `changes` (one line each: pools and workers added, removed, changed)
    and `restart_required` (top-level config sections that differ but apply only at start-up)."""

    changes: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"reloaded": True, "changes": self.changes, "restart_required": self.restart_required}


def apply_config(state: AppState, new: GatewayConfig) -> ReloadResult:
    """Apply `new`'s pools and discovery to the running `state` (on the event loop, no awaits: the
    request path sees the old set or the new one, never half of each). Raises ReloadRefused when a
    pool's policy cannot be built, or when the new pools do not fit the running models (`models`
    applies only at start-up: a model would name a pool that is gone, or a pool serve no model),
    nothing changed then."""
    old = state.config
    running = old.model_copy(update={name: getattr(new, name) for name in RELOADABLE})
    try:
        running.check_pools()
    except ValueError as exc:
        raise ReloadRefused(f"the new pools do not fit the running models (models apply only at start-up: "
                            f"restart to change them): {exc}") from None
    try:
        state.policies.update(new.pools)
    except (ValueError, ValidationError) as exc:
        raise ReloadRefused(explain_validation_error(exc)) from None
    changes = state.registry.configure(new.pools)
    # judged by the running models: the names routing sends, and those no adapter may take
    state.health.set_pools(new.pools, running.pool_served_names(), running.pool_reserved_names())
    state.lora.headers = pool_headers(new.pools)
    state.load.set_pools(new.pools)
    state.discovery.set_pools(new.discovery, new.pools)
    state.upstream.redactor.learn(new)  # a new api_key: kept out of engines' error answers too
    restart = [name for name in type(new).model_fields
               if name not in RELOADABLE and getattr(new, name) != getattr(old, name)]
    state.config = running
    state.parse_pool.reconfigure(state.config)  # its lower bound and first pool read the pools
    if restart:
        log.warning("reload: %s changed but apply only at start-up (restart to apply)", ", ".join(restart))
    return ReloadResult(changes, restart)


async def reload_config(state: AppState) -> ReloadResult:
    """Read the config file again and apply it (`apply_config`). Raises ReloadRefused with the
    reason for a file that cannot be read or is invalid, or when the gateway has no config file."""
    if state.config_path is None:
        raise ReloadRefused("this gateway was not started from a config file")
    async with state.reload_lock:
        try:
            new = await asyncio.to_thread(load_config, state.config_path)
        except ConfigError as exc:
            raise ReloadRefused(str(exc)) from None
        except ValidationError as exc:
            raise ReloadRefused(f"{state.config_path}: {explain_validation_error(exc)}") from None
        return apply_config(state, new)


async def reload_logged(state: AppState) -> None:
    """`reload_config` for a signal: the outcome goes to the log only."""
    try:
        result = await reload_config(state)
    except ReloadRefused as exc:
        log.error("reload refused, the running config stays: %s", exc)
        return
    except Exception:
        log.exception("reload failed")
        return
    log.info("reload applied: %s", "; ".join(result.changes) or "no pool or worker changed")
