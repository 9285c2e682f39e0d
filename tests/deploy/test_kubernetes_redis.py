"""deploy/kubernetes/components: Redis deployed with the gateway (`redis-sentinel`: three redis-server
pods with a Sentinel each, persistence off) and the CA of a TLS Redis mounted in the gateway
(`redis-tls-ca`). Each is added to a generated overlay the way an operator would (an overlay of
their own naming the overlay and the component), rendered with `kubectl kustomize`, validated with
`kubernetes-validate --strict`, and the gateway's own config loader reads the result."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from gateway.config import load_config
from gateway.plans.safety import production_findings, read_tree
from tests.deploy.test_kubernetes import (
    KUBE,
    KUBECTL,
    VALID_KEYS,
    by_kind,
    core_objects,
    gateway_environ,
    gateway_files,
    needs_kubectl,
    needs_validate,
    strict_validate,
)
from tests.deploy.tools import kustomize

COMPONENTS = KUBE / "components"
SENTINEL_URL = "redis+sentinel://:pw@kimi-redis-sentinel:26379/kimi/0?sentinel_password=pw"


def with_components(tmp_path: Path, overlay: str, *components: str) -> list[dict[str, Any]]:
    """`overlay` with `components` added, from an overlay of the operator's own in `tmp_path`."""
    own = tmp_path / "own"
    own.mkdir()
    up = os.path.relpath(KUBE, own)
    (own / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"{up}/overlays/{overlay}"], "components": [f"{up}/components/{c}" for c in components]}))
    assert KUBECTL is not None
    return kustomize(KUBECTL, {"own": own})["own"]


@needs_kubectl
@needs_validate
def test_the_redis_components_render_and_validate(tmp_path: Path) -> None:
    objects = with_components(tmp_path, "production", "redis-sentinel", "redis-tls-ca")
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all(core_objects(objects)))
    result = strict_validate([path])
    assert result.returncode == 0, result.stdout + result.stderr


@needs_kubectl
def test_redis_with_sentinel_is_a_cache_the_gateway_follows(tmp_path: Path) -> None:
    """Three pods, a sentinel in each (quorum 2), no persistence anywhere, a password from a Secret
    (never on a command line), reachable from the gateway and Redis pods only; the gateway accepts
    the in-namespace plaintext link and its config loads with the Sentinel URL."""
    objects = with_components(tmp_path, "plan-a", "redis-sentinel")
    redis = by_kind(objects, "StatefulSet")["kimi-redis"]
    spec = redis["spec"]
    assert spec["replicas"] == 3 and "volumeClaimTemplates" not in spec
    pod = spec["template"]["spec"]
    assert all("persistentVolumeClaim" not in v for v in pod["volumes"])
    server, sentinel = pod["containers"]
    script = server["args"][0]
    assert 'echo "save \\"\\""' in script and 'echo "appendonly no"' in script
    assert "requirepass $REDIS_PASSWORD" in script and "--requirepass" not in script
    assert "sentinel monitor kimi $primary 6379 2" in sentinel["args"][0]
    assert server["image"] == sentinel["image"] and server["image"].startswith("redis:7.4.")
    secrets = {o["metadata"]["name"] for o in by_kind(objects, "Secret").values()}
    for container in (server, sentinel):
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "secretKeyRef" in e.get(
            "valueFrom", {})}
        assert refs and refs <= secrets
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    policy = by_kind(objects, "NetworkPolicy")["kimi-redis"]["spec"]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in policy["ingress"][0]["from"]] == [
        "kimi-gateway", "kimi-redis"]
    services = by_kind(objects, "Service")
    assert services["kimi-redis"]["spec"]["publishNotReadyAddresses"] is True
    assert by_kind(objects, "PodDisruptionBudget")["kimi-redis"]["spec"]["maxUnavailable"] == 1

    env = {**gateway_environ(objects), **VALID_KEYS, "REDIS_URL": SENTINEL_URL}
    assert json.loads(env["KIMI_GATEWAY_ALLOW_PLAINTEXT"]) == ["engines", "redis"]
    config_path = gateway_files(objects, tmp_path)
    config = load_config(config_path, environ=env)
    assert config.redis_url == SENTINEL_URL
    findings = [str(f) for f in production_findings(read_tree(config_path), config, env)]
    assert not [f for f in findings if "redis" in f.lower()], findings


@needs_kubectl
def test_the_ca_of_a_tls_redis_is_mounted_where_the_url_names_it(tmp_path: Path) -> None:
    objects = with_components(tmp_path, "plan-a", "redis-tls-ca")
    pod = by_kind(objects, "Deployment")["kimi-gateway"]["spec"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "redis-ca"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "redis-ca"]
    assert volume["secret"]["secretName"] in by_kind(objects, "Secret")  # kustomize's hashed name
    ca_path = f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    assert f"ssl_ca_certs={ca_path}" in VALID_KEYS["REDIS_URL"]  # the URL the deployment tests use
    assert "redis" not in json.loads(gateway_environ(objects)["KIMI_GATEWAY_ALLOW_PLAINTEXT"])


def test_components_are_kustomize_components() -> None:
    for folder in sorted(p for p in COMPONENTS.iterdir() if p.is_dir()):
        doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
        assert doc["kind"] == "Component", folder

