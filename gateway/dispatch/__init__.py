"""The dispatch: one request from its parsed body to an accepted upstream answer (design §2).

Modules, each with one job: `service.py` (ProxyService: the request sequence and the dispatch
loop, orchestration only), `context.py` (one request's dispatch state), `steps.py` (choose the
pool, the policy's decision, the engine body), `kinds.py` (pool kinds: what makes a pool's
attempts), `attempt.py` (one attempt and what it owns), `failures.py` (judging failed attempts,
the exhausted answer), `answers.py` (the answers handed back: buffered, relayed, errors, headers).
"""

from gateway.dispatch.answers import BufferedResponse, RelayResponse
from gateway.dispatch.attempt import UPSTREAM_PATHS
from gateway.dispatch.service import ProxyService

__all__ = ["UPSTREAM_PATHS", "BufferedResponse", "ProxyService", "RelayResponse"]
