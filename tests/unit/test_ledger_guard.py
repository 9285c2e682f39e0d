"""Only the ledger (gateway/dispatch/ledger.py) accounts for a request: no other gateway module
assigns a `RequestRecord` field, calls a metric's `.labels(` (gateway/observability/metrics.py names those writes
for code outside the request path) or issues a passive-health verdict on a worker. Read from the
source (AST), like tests/unit/test_import_graph.py; the simulator (gateway/sim/) has its own metrics."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from gateway.observability.record import RequestRecord
from tests.support import REPO_ROOT

PACKAGE = REPO_ROOT / "gateway"
LEDGER = "gateway/dispatch/ledger.py"
FIELDS = frozenset(f.name for f in dataclasses.fields(RequestRecord))
VERDICTS = frozenset({"request_failed", "request_succeeded", "throttled", "connect_failed"})
"""The registry's passive-health verdicts (gateway/backends/registry.py), issued after an attempt."""

LABELS_ALLOWED = frozenset({LEDGER, "gateway/observability/metrics.py"})
VERDICTS_ALLOWED = frozenset({LEDGER, "gateway/backends/registry.py"})  # the ledger, and where they are defined
RECORD_ALLOWED = frozenset({LEDGER})


def _is_record(node: ast.expr) -> bool:
    """Whether an expression names a request's record: `record`, `self._record`, `ledger.record`,
    `dispatch.record`, any name or attribute spelled with `record`."""
    if isinstance(node, ast.Name):
        return "record" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "record" in node.attr.lower()
    return False


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found: list[ast.expr] = []
        for target in node.targets:
            found.extend(target.elts if isinstance(target, ast.Tuple | ast.List) else [target])
        return found
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def violations(source: str, path: str) -> list[str]:
    """Every accounting act in `source` (the text of module `path`, relative to the repository)
    that only the ledger may do, as `path:line: what`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            if (path not in RECORD_ALLOWED and isinstance(target, ast.Attribute) and target.attr in FIELDS
                    and _is_record(target.value)):
                found.append(f"{path}:{node.lineno}: assigns the record's `{target.attr}`")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name == "labels" and path not in LABELS_ALLOWED:
                found.append(f"{path}:{node.lineno}: calls a metric's .labels(")
            elif name in VERDICTS and path not in VERDICTS_ALLOWED:
                found.append(f"{path}:{node.lineno}: issues the health verdict {name}()")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and path not in RECORD_ALLOWED and node.args and _is_record(node.args[0])):
            found.append(f"{path}:{node.lineno}: sets a record field with setattr")
    return sorted(found, key=lambda v: int(v.split(":")[1]))


def gateway_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "sim" not in p.relative_to(PACKAGE).parts[:1])


def test_only_the_ledger_writes_the_record_touches_request_metrics_and_issues_verdicts() -> None:
    found = [v for p in gateway_modules()
             for v in violations(p.read_text(encoding="utf-8"), p.relative_to(REPO_ROOT).as_posix())]
    assert found == [], "report a fact to the request's Ledger (gateway/dispatch/ledger.py) instead, or name " \
                        "the metric's write in gateway/observability/metrics.py:\n" + "\n".join(found)


def test_the_guard_finds_each_kind_of_violation() -> None:
    """The check can fail: a synthetic module doing each forbidden act is caught, line by line,
    and the same acts are allowed where they belong."""
    source = (
        "def f(record, self, dispatch, metrics, registry, worker):\n"
        "    record.outcome = 'error'\n"                       # 2: a field, by name
        "    self._record.usage = {}\n"                        # 3: through an attribute
        "    dispatch.ledger.record.attempts += 1\n"           # 4: augmented, through the ledger's record
        "    record.worker, record.reason = 'w', 'r'\n"        # 5: a tuple of fields
        "    metrics.requests.labels('chat').inc()\n"          # 6
        "    registry.request_failed(worker, 'x')\n"           # 7
        "    registry.throttled(worker, 1.0)\n"                # 8
        "    setattr(record, 'status', 500)\n"                 # 9
        "    self.pool = 'p'\n"                                # not a record: allowed
        "    record.note = 1\n"                                # not a field: allowed
        "    registry.probe_failed(worker, 'x')\n"             # a probe's verdict, not the request's: allowed
    )
    found = violations(source, "gateway/dispatch/somewhere.py")
    assert [int(v.split(":")[1]) for v in found] == [2, 3, 4, 5, 5, 6, 7, 8, 9]
    assert violations(source.replace("    setattr(record, 'status', 500)\n", ""), LEDGER) == []
    assert [v.split(": ", 1)[1] for v in violations(source, "gateway/observability/metrics.py")][-3:] == [
        "issues the health verdict request_failed()", "issues the health verdict throttled()",
        "sets a record field with setattr"]


def test_every_record_field_is_known_to_the_guard() -> None:
    """The guard's field list is the dataclass's own (a new field is guarded from its first day)."""
    assert {"outcome", "status", "usage", "pool", "worker", "attempts", "migration"} <= FIELDS
