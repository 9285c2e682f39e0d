"""Test support for deploy/: a real Prometheus server, and the PromQL of the Grafana dashboards and the
alert rules with Grafana's template variables replaced by concrete values."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO_ROOT

PROMETHEUS = Path("/usr/bin/prometheus")  # Debian package `prometheus` (also ships promtool)
PROMTOOL = Path("/usr/bin/promtool")
DEPLOY = REPO_ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
PODMONITOR = DEPLOY / "kubernetes" / "base" / "monitoring" / "podmonitor.yaml"

# What Grafana puts in place of its variables; a variable missing here fails `substitute`.
GRAFANA_VARIABLES = {"pool": ".*", "worker": ".*", "__rate_interval": "1m", "__interval": "1m",
                     "__range": "1h"}
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")  # not "$1" (label_replace)
_GATEWAY_NAME = re.compile(r"(?<![\w:])kimi_gateway_\w+(?![\w:])")
_ENGINE_NAME = re.compile(r"(?<![\w:])(?:vllm|sglang|llamacpp):\w+(?![\w:])")
_RECORDED_NAME = re.compile(r"(?<![\w:])(?!(?:vllm|sglang|llamacpp):\w+(?![\w:]))[A-Za-z_]\w*:[\w:]+")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.+),\s*\w+\s*\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\((.+)\)\s*$", re.S)
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count")}


@dataclass(frozen=True)
class Query:
    """One PromQL expression from deploy/ and where it is (`file: panel [refId]` or `file: alert`)."""

    where: str
    expr: str


def substitute(expr: str) -> str:
    """`expr` with every Grafana variable (`$pool`, `${pool}`, `$__rate_interval`...) replaced from
    GRAFANA_VARIABLES; KeyError names a variable that has no value there."""
    return _VARIABLE.sub(lambda m: GRAFANA_VARIABLES[m.group(1) or m.group(2)], expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def variable_query(variable: dict[str, Any]) -> str | None:
    """The PromQL inside a query variable's `label_values(selector, label)` or `query_result(expr)`
    (Grafana's Prometheus variable functions), else its text; None for `label_values(label)`."""
    query = variable["query"]
    text = query["query"] if isinstance(query, dict) else query
    if match := _LABEL_VALUES.match(text) or _QUERY_RESULT.match(text):
        return match.group(1)
    return None if text.strip().startswith("label_values(") else text


def dashboard_queries(path: Path) -> list[Query]:
    """Every panel target's expr and every query variable's PromQL of one dashboard, substituted."""
    board = json.loads(path.read_text())
    queries = []
    for panel in _panels(board["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append(Query(f"{path.name}: {panel['title']} [{target['refId']}]", substitute(target["expr"])))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query" and (expr := variable_query(variable)) is not None:
            queries.append(Query(f"{path.name}: variable {variable['name']}", substitute(expr)))
    return queries


def rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    """Every rule (recording and alerting) of a rule file, in order."""
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def rule_queries(path: Path = ALERTS) -> list[Query]:
    return [Query(f"{path.name}: {rule.get('alert') or rule['record']}", rule["expr"]) for rule in rules(path)]


def gateway_names(expr: str) -> set[str]:
    """The `kimi_gateway_*` series names an expression selects (not recording-rule names)."""
    return set(_GATEWAY_NAME.findall(expr))


def engine_names(expr: str) -> set[str]:
    """The engines' own series names (`vllm:*`, `sglang:*`, `llamacpp:*`) an expression selects."""
    return set(_ENGINE_NAME.findall(expr))


def recorded_names(expr: str) -> set[str]:
    """Recording-rule names (`level:metric:operations`, with colons) an expression uses; not the
    engines' names (`vllm:num_requests_waiting`...)."""
    return set(_RECORDED_NAME.findall(expr))


_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex",
                 "action": "action", "replacement": "replacement", "separator": "separator", "modulus": "modulus"}


def podmonitor_scrape_config(pods: dict[str, dict[str, str]], interval: str = "500ms") -> dict[str, Any]:
    """A Prometheus scrape config doing what the Prometheus Operator makes of the PodMonitor's endpoint
    (deploy/kubernetes/base/monitoring/podmonitor.yaml), for static targets instead of pod discovery.

    `pods` maps a target `host:port` to its pod's labels (`{"app.kubernetes.io/name": "vllm-128k"}`),
    given to the relabelings as `__meta_kubernetes_pod_label_<name>` with every non-word character
    as `_`, as Kubernetes discovery does. The endpoint's path and relabelings are the PodMonitor's
    (camelCase keys as the operator translates them); `interval` replaces its scrape interval."""
    (endpoint,) = yaml.safe_load(PODMONITOR.read_text())["spec"]["podMetricsEndpoints"]
    relabel = [{_RELABEL_KEYS[k]: v for k, v in rule.items()} for rule in endpoint["relabelings"]]
    groups = [{"targets": [address],
               "labels": {"__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", k): v for k, v in labels.items()}}
              for address, labels in pods.items()]
    return {"job_name": "podmonitor", "metrics_path": endpoint["path"], "scrape_interval": interval,
            "scrape_timeout": interval, "static_configs": groups, "relabel_configs": relabel}


def series_names(families: dict[str, str]) -> set[str]:
    """Series names of metric families `{name: type}` (a counter `x` is exposed as `x_total`...)."""
    return {name + suffix for name, kind in families.items() for suffix in _SUFFIXES[kind]}


def exposed_families(exposition: str) -> dict[str, str]:
    """`{family name: type}` of a /metrics text, also for families that have no sample yet."""
    return {family.name: family.type for family in text_string_to_metric_families(exposition)}


class RunningPrometheus:
    """A Prometheus server on 127.0.0.1:`port` with `config` (a prometheus.yml mapping), its TSDB and log
    in `workdir`. `start()` waits for /-/ready (RuntimeError with the log's tail after `timeout` s)."""

    def __init__(self, config: dict[str, Any], workdir: Path, port: int) -> None:
        self.config, self.workdir, self.port = config, workdir, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> RunningPrometheus:
        config_file = self.workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config))
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={config_file}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus was not ready after {timeout} s: {self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def api(self, path: str, **params: str) -> httpx.Response:
        """GET /api/v1/`path` (Prometheus' HTTP API: JSON `{"status", "data" | "errorType", "error"}`)."""
        return httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10.0)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of `expr` now; AssertionError with Prometheus' error when it fails."""
        response = self.api("query", query=expr)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single sample of `expr` now, or None when the result is empty."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: more than one series: {result}"
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, done: Callable[[float | None], bool], timeout: float = 20.0) -> float | None:
        """Poll `expr` until `done(value)`; AssertionError with the last value after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not done(value := self.value(expr)):
            assert time.monotonic() < deadline, f"{expr} stayed at {value} for {timeout} s"
            time.sleep(0.2)
        return value
