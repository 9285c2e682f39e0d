"""Client authentication (API keys, scopes), the models each key may use, and per-key (and per-key,
per-model) rate limits.

- `keys.py`: key hashing, the key ring (SHA-256 → Principal), the bearer token of a request.
- `access.py`: a key's allowed models and per-model limits resolved to the names requests resolve to.
- `limits.py`: the sliding-window rule, the `RateLimiter` interface and the in-process limiter.
- `redis_limits.py`: the same limiter in Redis (one Lua call per request), shared by all replicas.
- `guard.py`: `AuthGuard`, what the request path calls: authenticate, authorize, check the model and the quota.
- `middleware.py`: the `/v1/*` authentication middleware, CORS, and `require_scope` for admin routes.
"""
