"""The two-leg attempt of a prefill/decode (PD) pool, by composition (issue 13, issue 21 item 4).

A prefill worker computes the prompt's KV cache, a decode worker receives it and generates the
answer the client gets. The wire protocols, with their sources, are `gateway/protocol/pd.py`.

- Selection is the pool kind's (`gateway/dispatch/kinds.py`, `Disaggregated`): it picks both
  workers, each with its role's policy, and builds a `PdAttempt` with the pool's runner.
- `attempt.py`: `PdAttempt`, what every protocol shares: both slots in one `Holding`, the prefill
  leg (`prefill.py`, its own task), the decode leg (the single-leg relay, `SingleLeg.serve`), the
  two at once (`both`), a stream committed before its decode leg opens (`deferred.py`), and which
  leg a failure is held against (`failed_worker`).
- One small runner per protocol, each only the order of its legs: `sglang.py` (the same body to
  both at once), `nixl.py` (the prefill first, then the decode with the KV handle it answered),
  `mooncake.py` (both at once, tied by a transfer id; the engine id the registry keeps).
- `requests.py`: the pure builders (the parsed engine body + the worker's facts -> each leg's
  request bytes, each encoded once).
- `account.py`: `PdAccount`, the one object the attempt reports its facts to (every record field,
  PD metric and worker-health verdict a PD attempt causes is written there).
"""
