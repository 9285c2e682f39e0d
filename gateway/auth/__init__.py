"""Client authentication (API keys, scopes) and per-key rate limits.

- `keys.py`: key hashing, the key ring (SHA-256 → Principal), the bearer token of a request.
- `limits.py`: the sliding-window rule, the `RateLimiter` interface and the in-process limiter.
- `redis_limits.py`: the same limiter in Redis (one Lua call per request), shared by all replicas.
- `guard.py`: `AuthGuard`, what the request path calls: authenticate, authorize, check the quota.
- `middleware.py`: the `/v1/*` authentication middleware, CORS, and `require_scope` for admin routes.
"""
