"""API keys: hashing, the key ring (SHA-256 → Principal), and the bearer token of a request.

The config holds only the hex SHA-256 of each key (`kimi-gateway hash-key KEY` prints it); the
gateway never stores, logs or forwards a client's key.

Lookup is a dict keyed by the SHA-256 of the presented key, not a constant-time comparison of
secrets, and that is safe: a timing side channel in the dict lookup (Python's string hash and
equality check) can only leak information about the *hash* of the presented key compared with
the stored hashes. To turn that into a key an attacker would have to pick keys whose SHA-256 has a
chosen prefix (a preimage search) and, even knowing a stored hash completely, invert SHA-256 of a
random secret. Both are infeasible for high-entropy keys, which is why plain SHA-256 (fast, one per
request) is the right hash here and a slow password hash (bcrypt, argon2) would only add latency:
keys must be random (≥ 128 bits, e.g. `python -c "import secrets; print('sk-' + secrets.token_urlsafe(32))"`),
never passwords a person chose. GitHub and Stripe store their API tokens the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gateway.auth.access import allowed_models, canonical
from gateway.auth.params import ApiKeyConfig

Scope = Literal["user", "admin", "drain"]
"""`user` may call `/v1/*`; `admin` may call admin routes (see `middleware.require_scope`); `drain`
only the routes `kimi-gateway drain` calls (list and read workers, drain and undrain one): the key an
engine pod holds to take itself out of the gateway and back, which cannot reload the config, read
the status page nor call `/v1/*`. A key with `admin` has `drain` too."""

MIN_KEY_CHARS = 32  # `hash-key` warns below this: a short key is guessable from its hash


def hash_key(key: str) -> str:
    """The lowercase hex SHA-256 of the key's UTF-8 bytes (64 characters)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_id(sha256_hex: str) -> str:
    """A key's id for metric labels: the first 12 hex digits of its SHA-256 (as in `auth.keys[].sha256`
    and `kimi-gateway hash-key`), which names neither the key nor its holder."""
    return sha256_hex[:12]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key's configured name (never the key), its scopes and its limits.

    `requests_per_minute` and `tokens_per_minute` are None when that limit is off;
    `count_tokens_per_minute` limits `POST /v1/messages/count_tokens` requests on their own
    (`ApiKeyConfig.count_tokens_limit`; None: off). `models`: the model (canonical) and LoRA
    adapter names the key may use (None: all; `gateway/auth/access.py`); `model_limits`: per such
    name, the key's limits on that model as a Principal of their own (its `name` is
    `{key}/model/{model}`, the limiter's key), applied on top of the key's own.
    """

    name: str
    scopes: frozenset[str]
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    count_tokens_per_minute: int | None = None
    models: frozenset[str] | None = None
    model_limits: Mapping[str, Principal] = field(default_factory=dict, hash=False, compare=False)

    def has(self, scope: Scope) -> bool:
        """Whether the key holds `scope` (`admin` includes `drain`)."""
        return scope in self.scopes or (scope == "drain" and "admin" in self.scopes)

    def may_use(self, model: str) -> bool:
        """Whether the key may use `model`, a request's resolved name (`RoutingRequest.model`:
        a canonical model name or a LoRA adapter's)."""
        return self.models is None or model in self.models

    def limits_tokens(self, model: str | None) -> bool:
        """True when a token limit applies to a request of this key for `model` (the key's own or
        that model's): the engine is then sent the output limit the gateway reserved."""
        if self.tokens_per_minute is not None:
            return True
        limits = self.model_limits.get(model) if model is not None else None
        return limits is not None and limits.tokens_per_minute is not None

    @property
    def limited(self) -> bool:
        """True when at least one rate limit applies to this key."""
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value; None when absent, empty or
    another scheme. The scheme is case-insensitive (RFC 9110 §11.1)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


def model_key(key: str, model: str) -> str:
    """The limiter's name for key `key`'s limits on `model` (its Redis key is `{key_prefix}:` + this):
    key names hold no `/`, so it never meets another key's name nor `{key}/count_tokens`."""
    return f"{key}/model/{model}"


def principal_of(key: ApiKeyConfig, names: Mapping[str, str] | None = None) -> Principal:
    """The Principal of configured key `key`, its `models` and `model_limits` entries resolved with
    `names` (`access.model_names`: an alias stands for its model; None: taken as written)."""
    names = names or {}
    scopes = frozenset(key.scopes)
    per_model: dict[str, Principal] = {}
    for entry, limits in key.model_limits.items():
        model = canonical(entry, names)
        if model in per_model:
            raise ValueError(f"auth.keys {key.name}: model_limits names {model!r} twice (as {entry!r})")
        if limits.limited:
            per_model[model] = Principal(model_key(key.name, model), scopes, limits.requests_per_minute,
                                         limits.tokens_per_minute, limits.count_tokens_per_minute)
    return Principal(key.name, scopes, key.requests_per_minute, key.tokens_per_minute, key.count_tokens_limit,
                     allowed_models(key.models, names), per_model)


class KeyRing:
    """The configured keys, looked up by the SHA-256 of the presented key (see the module docstring).
    `names`: the gateway's model names and aliases (`access.model_names`), which the keys' `models`
    and `model_limits` entries are resolved with."""

    def __init__(self, keys: Iterable[ApiKeyConfig], names: Mapping[str, str] | None = None) -> None:
        self._by_hash: dict[str, Principal] = {key.sha256: principal_of(key, names) for key in keys}

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: str) -> Principal | None:
        """The principal of `key`, or None when no configured key has its hash."""
        return self._by_hash.get(hash_key(key))
