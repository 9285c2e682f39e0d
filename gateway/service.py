"""Compatibility alias: the dispatch now lives in the `gateway.dispatch` package. Kept so code
written against the old single module (`from gateway.service import ProxyService, ...`) keeps
importing; new code imports from `gateway.dispatch`."""

from gateway.dispatch.answers import BufferedResponse, RelayResponse
from gateway.dispatch.attempt import UPSTREAM_PATHS
from gateway.dispatch.service import ProxyService, quota_used

__all__ = ["UPSTREAM_PATHS", "BufferedResponse", "ProxyService", "RelayResponse", "quota_used"]
