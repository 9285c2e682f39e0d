"""The config's secrets, kept out of what the gateway relays from an engine's error answer and logs.

An engine, or a proxy in front of it, that echoes the request's headers in its error answer
("invalid header Authorization: Bearer ...") would show the client the pool's `api_key`, the
credential the gateway sends to that engine. A `Redactor` holds every secret of the config the
gateway runs with (each pool's `api_key`, the Redis password and sentinel password of `redis_url`
or the `redis:` block) and replaces each occurrence with `[redacted]`: in the body of an engine's
non-2xx answer and in an in-stream error event, before they are relayed, logged or used as an
error's detail (gateway/streaming.py). A reload adds the new config's secrets (`learn`); the old
ones stay, as open streams may still carry them.

Each secret is matched as its bytes, as written inside a JSON string (escaped) and percent-encoded
(as in a URL), whichever differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import parse_qs, quote, unquote, urlsplit

import orjson

from gateway.config import GatewayConfig

MARK = b"[redacted]"


def config_secrets(config: GatewayConfig) -> list[str]:
    """The secrets `config` holds: every pool's `api_key`, the Redis URL's password (user info or a
    `password` query parameter) and a sentinel URL's `sentinel_password` (the `redis:` block is
    rendered into `redis_url` by the config itself)."""
    found = [pool.api_key.get_secret_value() for pool in config.pools if pool.api_key is not None]
    if config.redis_url:
        parts = urlsplit(config.redis_url)
        userinfo = parts.netloc.rpartition("@")[0]
        if ":" in userinfo:
            found.append(unquote(userinfo.partition(":")[2]))
        query = parse_qs(parts.query)
        found += query.get("password", []) + query.get("sentinel_password", [])
    return [secret for secret in found if secret]


class Redactor:
    """Replaces every known secret with `[redacted]` (module docstring). False while it holds none."""

    __slots__ = ("_forms",)

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._forms: tuple[bytes, ...] = ()
        self.add(secrets)

    @classmethod
    def of(cls, config: GatewayConfig) -> Redactor:
        """A redactor of `config`'s secrets (`config_secrets`)."""
        return cls(config_secrets(config))

    def learn(self, config: GatewayConfig) -> None:
        """Add `config`'s secrets (a reload); those known already stay."""
        self.add(config_secrets(config))

    def add(self, secrets: Iterable[str]) -> None:
        forms = set(self._forms)
        for secret in secrets:
            raw = secret.encode("utf-8")
            forms |= {raw, orjson.dumps(secret)[1:-1], quote(secret, safe="").encode("ascii")}
        self._forms = tuple(sorted(forms, key=len, reverse=True))  # a longer secret before one inside it

    def __bool__(self) -> bool:
        return bool(self._forms)

    def __call__(self, data: bytes) -> bytes:
        """`data` with every secret replaced by `[redacted]` (the same object when none is in it)."""
        for form in self._forms:
            if form in data:
                data = data.replace(form, MARK)
        return data
