"""The dispatch: one request from its parsed body to an accepted upstream answer (design §2).

Modules, each with one job: `service.py` (ProxyService: the request sequence and the dispatch
loop, orchestration only), `context.py` (one request's dispatch state), `steps.py` (choose the
pool, the policy's decision, the engine body), `kinds.py` (pool kinds: what makes a pool's
attempts), `attempt.py` (one attempt and what it owns), `failures.py` (judging failed attempts,
the exhausted answer), `answers.py` (the answers handed back: buffered, relayed, errors, headers),
`params.py` (its config sections). This file imports nothing, so that `params.py` loads alone.
"""
