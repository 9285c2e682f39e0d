"""Generate the kustomize overlays in deploy/kubernetes/overlays/ from the plans, and the PrometheusRule.

One overlay per plan that config/k3-production.yaml names (`pools: - plan: plans/X.yaml`), in a
folder named after the plan (`overlays/plan-a/`), and `overlays/production/`: all of them behind one
gateway, as the production config has it, except the plans of OPTIONAL_ACCELERATORS (Ascend): each
of those is a kustomize Component, `components/<plan>/` (component_files), that adds its pool to
production, and `overlays/production-<plan>/` is production with it. Everything an overlay says
about its plans comes from the plan file through gateway.plans (the same loader the gateway and
`kimi-gateway plan` use):

- ConfigMap `kimi-gateway-config`: the production config with only the overlay's pool entries and
  `redis_url: ${REDIS_URL}` (an external URL from the Secret, no localhost fallback), the plan file
  and its model card, mounted as /etc/kimi-gateway/{gateway.yaml,plans/...,models/...};
- the engine workloads (engine_objects): a StatefulSet per pool of single-node instances (one pod =
  one engine = one gateway worker) with its headless Service; for a plan whose instance spans
  nodes, a LeaderWorkerSet per pool (one group of `nodes` pods per instance, restarted and rolled
  out as a group) with a leader-only Service `<pool>-leaders`; NVL72: a ComputeDomain. Each pool
  also gets a PodDisruptionBudget that never evicts its last instance, the PriorityClass
  `kimi-k3-engine`, Guaranteed resources, probes on the serving pod from each engine kind's own
  endpoints (ENGINE_PROBES), and a drain sidecar (its own image, DRAIN_IMAGE) whose preStop hook
  runs `kimi-gateway drain` on every gateway replica (the headless Service `kimi-gateway-replicas`)
  before the engine gets SIGTERM, holding the engine its drain time when that fails, and which
  undrains the worker when the pod starts, with a key of the `drain` scope only;
- ConfigMap `<pool>-launch`: the engine's launch script for Kubernetes (launch_script: the plan's
  flags from gateway.plans.emit, the key from the environment, LWS ranks), which the container runs;
- a patch of the gateway Deployment: one `<WORKER_ENV>_<i>` URL per engine instance (the variables
  the plan's pool reads), the engine key from the Secret `kimi-engine-keys`, and
  terminationGracePeriodSeconds = preStop + shutdown.drain_delay + shutdown.grace_period + a
  margin, where the overlay's config raises grace_period to the longest request its pools allow
  (gateway_grace_seconds);
- the HorizontalPodAutoscaler's minReplicas: the config's `replicas`;
- NetworkPolicies: engine ports only from the gateway pods, any port between the pods of one
  multi-node instance (NCCL, the process group), and the gateway's port from the engines' drain
  sidecars.

Also base/monitoring/prometheusrule.yaml from deploy/prometheus/alerts.yml (the same groups, text kept).

    python deploy/kubernetes/generate.py           # write
    python deploy/kubernetes/generate.py --check   # exit 1 and name the files that differ (tests run this)
"""

from __future__ import annotations

import argparse
import posixpath
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from gateway.backends.client import first_byte_budget  # noqa: E402
from gateway.dispatch.params import TimeoutConfig  # noqa: E402
from gateway.plans.emit import sglang_args, sglang_launcher, shell_command, vllm_args  # noqa: E402
from gateway.plans.models import LoadedPlan, load_plan  # noqa: E402
from gateway.plans.safety import pool_request_seconds  # noqa: E402
from gateway.serving.params import ShutdownConfig  # noqa: E402

PRODUCTION = ROOT / "config" / "k3-production.yaml"
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = KUBE / "overlays"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_RULE = KUBE / "base" / "monitoring" / "prometheusrule.yaml"
PRODUCTION_OVERLAY = "production"  # every plan of the production config behind one gateway

CONFIG_DIR = "/etc/kimi-gateway"  # where the gateway's ConfigMap is mounted (base/gateway.yaml)
PRESTOP_SECONDS = 5  # base/gateway.yaml lifecycle.preStop.sleep
TERMINATION_MARGIN_SECONDS = 10  # SIGKILL comes this long after the drain should have ended
SGLANG_DIST_PORT = 5000  # the leader's port for SGLang's process group (--dist-init-addr host:port)
VLLM_MASTER_PORT = 29501  # vLLM's --master-port default (ParallelConfig): torch.distributed across nodes
VLLM_DP_RPC_PORT = 13345  # vLLM's --data-parallel-rpc-port default: data-parallel engines' handshake
WEIGHTS_CLAIM = "kimi-k3-weights"  # a ReadOnlyMany PVC with the weights, created by the operator
ENGINE_KEYS_SECRET = "kimi-engine-keys"
# Engine releases the gateway's protocol code was checked against (gateway/protocol, gateway/sim).
# vllm-ascend's tags do not follow vLLM's (PyPI's newest vllm-ascend is 0.23.0.post1) and no
# release was checked for K3: its image has no usable default, `images:` in your overlay must set one
# (deploy/README.md, "Images and architectures", says how each tag was checked).
ENGINE_IMAGES = {
    "vllm": "vllm/vllm-openai:v0.33.0",
    "sglang": "lmsysorg/sglang:v0.5.23",
    "ascend": "quay.io/ascend/vllm-ascend:set-a-validated-tag",
}
# A headless Service over every gateway replica (ready or not): `kimi-gateway drain --every-address`
# resolves it to each replica's address, so a drain reaches every replica even when they share no Redis.
GATEWAY_REPLICAS_SERVICE = "kimi-gateway-replicas"
GATEWAY_REPLICAS_URL = f"http://{GATEWAY_REPLICAS_SERVICE}:8000"
PRIORITY_CLASS = "kimi-k3-engine"
DRAIN_KEY_SECRET = "kimi-gateway-drain"  # the drain key itself (the gateway's Secret holds only its hash)
DRAIN_KEY_ENV = "KIMI_GATEWAY_DRAIN_KEY"  # what the engines' `kimi-gateway drain` reads it from
DRAIN_KEY_NAME = "engine-drains"  # its entry in the gateway's auth.keys: scope `drain` only
DRAIN_KEY_HASH_ENV = "DRAIN_KEY_SHA256"  # the gateway's variable with its SHA-256 (Secret kimi-gateway-keys)
# The drain sidecar's image: the gateway's image pushed under its own name and pinned tag (the
# `kimi-gateway drain` command and the admin routes it calls are stable across gateway releases), so
# an `images:` entry bumping `kimi-gateway` changes the gateway Deployment only and never rewrites (and
# so rolls) the engine pods. Bump `kimi-gateway-drain` on purpose, when an engine rollout is wanted.
DRAIN_IMAGE = "kimi-gateway-drain:0.1.0"
DRAIN_DONE = "/drain/done"  # the file the drain sidecar's preStop touches when the engine may get SIGTERM
DRAIN_STOPPING = "/drain/stopping"  # touched first by that preStop: the sidecar's undrain loop ends
DRAIN_UNDRAIN_PID = "/drain/undrain.pid"  # the undrain the sidecar runs now, which that preStop ends first
DRAIN_MARGIN_SECONDS = 30  # the drain's own round trips beyond the longest request
ENGINE_EXIT_SECONDS = 60  # after the drain: the engine's SIGTERM handling and process exit
# vLLM's --shutdown-timeout (vllm/engine/arg_utils.py; default 0 = abort what runs at SIGTERM): requests
# still running then (a drain that failed and held the engine its drain time instead) get this long.
VLLM_SHUTDOWN_TIMEOUT_SECONDS = 45  # inside ENGINE_EXIT_SECONDS, with time left for the process exit
# Overlay parameters: what one node offers the engine pod (requests = limits: Guaranteed QoS, so a
# pod staging weights through host RAM is not the first evicted). Use your nodes' allocatable
# (`kubectl describe node`); /dev/shm (a Memory emptyDir) counts toward the memory limit.
NODE_RESOURCES = {
    "B300": {"cpu": "96", "memory": "1536Gi", "shm": "64Gi"},   # HGX B300: 2 sockets, 2-4 TB
    "B200": {"cpu": "96", "memory": "1536Gi", "shm": "64Gi"},   # DGX B200: 112 cores, 2 TB
    "GB200": {"cpu": "128", "memory": "768Gi", "shm": "64Gi"},  # NVL72 tray: 2 Grace (144 cores), ~960 GB LPDDR5X
    "Ascend 950": {"cpu": "160", "memory": "1024Gi", "shm": "64Gi"},  # an assumption: no published server spec
}
WEIGHTS_READ_BYTES_PER_SECOND = 1e9  # per node, from the weights volume (parameter: your storage's rate)
ENGINE_WARMUP_SECONDS = 600  # after loading: kernel compile, CUDA graph capture, KV cache allocation
# vLLM's --safetensors-load-strategy for the weights volume (vllm/config/load.py LoadConfig: `eager`
# reads each file whole before loading it, "recommended for models on network filesystems (e.g.,
# Lustre, NFS)", one file at a time per worker in host RAM; `lazy` memory-maps, for local NVMe;
# the default auto-prefetches only a checkpoint within 90% of RAM, which K3's 1.57 TB is not).
VLLM_SAFETENSORS_LOAD_STRATEGY: str | None = "eager"
# A ReadWriteMany PVC for the engines' kernel and compile caches (torch.compile, Inductor, Triton,
# FlashInfer and DeepGEMM JIT): a restarted pod reuses them instead of compiling again. One
# sub-directory per pool (subPath), so accelerators and engine versions never share one.
COMPILE_CACHE_CLAIM = "kimi-k3-compile-cache"
COMPILE_CACHE_MOUNT = "/var/cache/kimi-k3"
# The host CPU architecture of an accelerator's nodes, where it is fixed: GB200 trays are Grace
# (arm64). Those engine pods select it (kubernetes.io/arch), and their images must have it.
NODE_ARCH = {"GB200": "arm64"}
# Accelerators whose pools are a kustomize component (`components/<plan>`) that `overlays/production`
# does not include: an NVIDIA-only cluster applies production as it is.
OPTIONAL_ACCELERATORS = ("Ascend",)
# kube-prometheus-stack's Prometheus selects ServiceMonitors, PodMonitors and PrometheusRules by
# `release: <its Helm release name>`: set yours (None: no such label).
MONITORING_RELEASE_LABEL: str | None = "kube-prometheus-stack"
RDMA_RESOURCE = "rdma/rdma_shared_device_a"  # NVIDIA Network Operator's shared RDMA device plugin (its example name)
# Accelerators whose TP spans trays: the node label naming one NVLink partition (GPU feature discovery).
NVLINK_DOMAIN = {"GB200": "nvidia.com/gpu.clique"}
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LEADER_DNS_ATTEMPTS = 60  # x 5 s: how long a node waits for its leader's DNS name before it gives up
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on the leader


def fabric(accelerator: str) -> dict[str, str]:
    """NCCL/NVSHMEM settings of a multi-node engine pod (overlay parameters: set your fabric's).

    The socket interface is the pod network's (bootstrap, Gloo); the HCA prefix selects the
    ConnectX RDMA devices the RDMA device plugin hands the pod. NVSHMEM (SGLang's DeepEP) bootstraps
    over the same interface. NVL72: NCCL_MNNVL_ENABLE=1 and NCCL_CUMEM_ENABLE=1 let NCCL use NVLink
    across trays through the IMEX channel.
    """
    env = {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5",
           "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0", "NCCL_DEBUG": "WARN"}
    if accelerator in NVLINK_DOMAIN:
        env |= {"NCCL_MNNVL_ENABLE": "1", "NCCL_CUMEM_ENABLE": "1"}
    return env

def node_selector(accelerator: str) -> dict[str, str]:
    """The pod's nodeSelector for `accelerator`'s nodes: their CPU architecture where NODE_ARCH fixes it."""
    arch = NODE_ARCH.get(accelerator)
    return {"kubernetes.io/arch": arch} if arch else {}


def weights_load_args(loaded: LoadedPlan) -> list[str]:
    """Engine flags for reading the weights from the network volume (VLLM_SAFETENSORS_LOAD_STRATEGY).
    vLLM and vllm-ascend (vLLM's loader); SGLang gets none: its default loader is kept (no SGLang
    recommendation for network storage was found)."""
    if loaded.plan.engine.kind == "sglang" or VLLM_SAFETENSORS_LOAD_STRATEGY is None:
        return []
    return [f"--safetensors-load-strategy {VLLM_SAFETENSORS_LOAD_STRATEGY}"]


def compile_cache_env(loaded: LoadedPlan) -> list[dict[str, str]]:
    """Where the engine's compilers keep their caches, all under COMPILE_CACHE_MOUNT: vLLM's
    VLLM_CACHE_ROOT (vllm/envs.py: torch.compile artifacts), PyTorch Inductor's
    TORCHINDUCTOR_CACHE_DIR, Triton's TRITON_CACHE_DIR, FlashInfer's FLASHINFER_WORKSPACE_BASE and
    SGLang's DeepGEMM SGLANG_DG_CACHE_DIR (python/sglang/srt/environ.py)."""
    dirs = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
            "FLASHINFER_WORKSPACE_BASE": "flashinfer"}
    dirs |= {"SGLANG_DG_CACHE_DIR": "deep_gemm"} if loaded.plan.engine.kind == "sglang" else {"VLLM_CACHE_ROOT": "vllm"}
    return [{"name": k, "value": f"{COMPILE_CACHE_MOUNT}/{v}"} for k, v in sorted(dirs.items())]


def compile_cache_volume(loaded: LoadedPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the pod's volume, the engine container's mount) of the compile cache, the pool's sub-directory."""
    return ({"name": "compile-cache", "persistentVolumeClaim": {"claimName": COMPILE_CACHE_CLAIM}},
            {"name": "compile-cache", "mountPath": COMPILE_CACHE_MOUNT, "subPath": loaded.plan.pool.name})


def optional_plan(loaded: LoadedPlan) -> bool:
    """Whether the plan's pool is a component production leaves out (OPTIONAL_ACCELERATORS)."""
    return loaded.plan.hardware.accelerator.startswith(OPTIONAL_ACCELERATORS)


GENERATED = ("# Generated by deploy/kubernetes/generate.py from {source}. "
             "Do not edit: change the source and run it again.\n")


def device_resource(accelerator: str) -> str:
    """The extended resource a node's device plugin registers for `accelerator` (one per GPU/NPU).

    NVIDIA's device plugin: `nvidia.com/gpu`. Ascend: Huawei's device plugin names the resource per
    chip generation (`huawei.com/Ascend910` for the 910); `huawei.com/Ascend950` follows that pattern
    and is an assumption: use the name your cluster's plugin reports (`kubectl describe node`).
    """
    return "huawei.com/Ascend950" if accelerator.lower().startswith("ascend") else "nvidia.com/gpu"


def gateway_shutdown(config: dict[str, Any]) -> ShutdownConfig:
    """The production config's `shutdown:` section with the gateway's defaults (seconds)."""
    return ShutdownConfig(**(config.get("shutdown") or {}))


def termination_grace_seconds(shutdown: ShutdownConfig) -> int:
    """preStop sleep + drain_delay + grace_period + margin, whole seconds rounded up."""
    total = PRESTOP_SECONDS + shutdown.drain_delay + shutdown.grace_period + TERMINATION_MARGIN_SECONDS
    return int(-(-total // 1))


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _dump(*docs: Any) -> str:
    return "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=120) for d in docs)


def instances(loaded: LoadedPlan) -> list[dict[str, Any]]:
    """The engine instances of a plan: workload name, pods per instance, and the gateway worker URL of each.

    Single-node plans: one StatefulSet `<pool>` with `replicas` pods; instance i is pod `<pool>-i`.
    Multi-node plans: one LeaderWorkerSet `<pool>` with `replicas` groups of `nodes` pods; instance i
    is group i, whose leader pod `<pool>-i` serves (its workers are `<pool>-i-1` ...). Both resolve
    as `<pod>.<pool>`: the StatefulSet's headless Service, or the one the LWS controller creates
    for its pods' shared subdomain (named after the LWS).
    Returns [{"set": name, "pods": pods per instance, "host": dns name, "url": http://host:port, "env": VAR}].
    """
    plan = loaded.plan
    pool, port = plan.pool.name, plan.engine.port
    return [{"set": pool, "pods": plan.hardware.nodes, "host": f"{pool}-{index}.{pool}",
             "url": f"http://{pool}-{index}.{pool}:{port}", "env": f"{plan.worker_env()}_{index}"}
            for index in range(plan.replicas)]


def _labels(pool: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": pool, "app.kubernetes.io/instance": pool,
            "app.kubernetes.io/component": "engine"}


def request_budget_seconds(config: dict[str, Any], loaded: LoadedPlan) -> int:
    """The longest request the gateway lets run on this plan's pool, in whole seconds (rounded up):
    `gateway.plans.safety.pool_request_seconds` of the plan's context under the config's timeouts.
    Plan C (1,048,576 tokens) under the production timeouts: their `total`, 3,600 s.
    """
    timeouts = TimeoutConfig(**(config.get("timeouts") or {}))
    return int(-(-pool_request_seconds(timeouts, loaded.plan.max_context_tokens) // 1))


def startup_seconds(loaded: LoadedPlan) -> int:
    """How long an engine pod may take to serve after it starts: its share of the weights read at
    WEIGHTS_READ_BYTES_PER_SECOND, plus ENGINE_WARMUP_SECONDS (kernel compile, CUDA graphs, KV cache).

    Each node reads its tensor/expert shard of one full copy of the weights per data-parallel rank:
    weights x DP / nodes. Plan B (MXFP4, 1,568 GB, 2 nodes): 784 GB at 1 GB/s + 600 s = 1,385 s.
    """
    plan = loaded.plan
    per_node = loaded.card.weight_bytes(plan.engine.precision) * plan.parallelism.data / plan.hardware.nodes
    return int(-(-(per_node / WEIGHTS_READ_BYTES_PER_SECOND + ENGINE_WARMUP_SECONDS) // 1))


def engine_api_key_env(loaded: LoadedPlan) -> str | None:
    """The variable the engine itself reads its key from, set from the Secret key `api_key_env`.

    vLLM and vllm-ascend read VLLM_API_KEY when --api-key is absent
    (vllm/entrypoints/openai/api_server.py: `args.api_key or envs.VLLM_API_KEY`); SGLang reads no
    variable, so its launcher (gateway.plans.emit.sglang_launcher) reads the plan's `api_key_env`."""
    engine = loaded.plan.engine
    if not engine.api_key_env:
        return None
    return engine.api_key_env if engine.kind == "sglang" else "VLLM_API_KEY"


# Probes per engine kind, from the engines' own endpoints (one table: the overlays and the tests read it).
# - vLLM 0.33 and vllm-ascend (its API server): `/health` (vllm/entrypoints/serve/instrumentator/health.py)
#   answers at once, 200 unless the engine core died (EngineDeadError: 503); the HTTP port answers only
#   once the engine is loaded. It needs no key (vllm/entrypoints/serve/middleware/authenticate.py guards /v1).
# - SGLang 0.5.23 (python/sglang/srt/entrypoints/http_server.py): `/ready` is a flag check, 200 once
#   the warm-up request set the server Up, 503 while starting, paused or shutting down; `/health`
#   submits a one-token generation and polls each second for any output, up to SGLANG_HEALTH_CHECK_TIMEOUT
#   (20 s), then answers 503 (and marks the server UnHealthy until a later /health passes): it never
#   answers within the kubelet's default 1 s, and during a long prefill no output comes at all. Both
#   are exempt from its key (sglang/srt/utils/auth.py).
# `answer_s`: the longest the liveness path takes to answer when the engine is well; the probe's
# timeoutSeconds is that plus PROBE_MARGIN_SECONDS.
ENGINE_PROBES: dict[str, dict[str, Any]] = {
    "vllm": {"startup": "/health", "readiness": "/health", "liveness": "/health", "answer_s": 1},
    "ascend": {"startup": "/health", "readiness": "/health", "liveness": "/health", "answer_s": 1},
    "sglang": {"startup": "/ready", "readiness": "/ready", "liveness": "/health", "answer_s": 20},
}
PROBE_MARGIN_SECONDS = 9  # on top of answer_s: a loaded API server's event loop, the network
FLAG_PROBE_TIMEOUT_SECONDS = 5  # startup and readiness paths: flag checks that answer at once
LIVENESS_PERIOD_SECONDS = 60


def prefill_seconds(config: dict[str, Any], loaded: LoadedPlan) -> int:
    """The longest prefill the gateway allows on this plan's pool, whole seconds rounded up: the
    first-byte budget (`gateway.backends.client.first_byte_budget`) of a prompt as long as the pool's
    context. Plan C (1,048,576 tokens, the production timeouts): 60 + 524.3 = 585 s."""
    timeouts = TimeoutConfig(**(config.get("timeouts") or {}))
    return int(-(-first_byte_budget(timeouts, loaded.plan.max_context_tokens) // 1))


def engine_probes(loaded: LoadedPlan, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """startupProbe, readinessProbe and livenessProbe of the serving engine container, from ENGINE_PROBES.

    Startup: `startup_seconds` to load and warm up. Readiness: 3 failures 10 s apart. Liveness: a
    timeout above the path's own answer time, and failures tolerated for longer than the longest
    allowed prefill (`prefill_seconds` + one period): an engine busy with a 1M-token prompt is not
    restarted (SGLang's /health fails throughout one; vLLM's API server may stall tokenizing it)."""
    paths = ENGINE_PROBES[loaded.plan.engine.kind]
    period = 10

    def probe(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}}

    live_timeout = paths["answer_s"] + PROBE_MARGIN_SECONDS
    return {
        "startupProbe": {**probe(paths["startup"]), "periodSeconds": period,
                         "timeoutSeconds": FLAG_PROBE_TIMEOUT_SECONDS,
                         "failureThreshold": -(-startup_seconds(loaded) // period)},
        "readinessProbe": {**probe(paths["readiness"]), "periodSeconds": period,
                           "timeoutSeconds": FLAG_PROBE_TIMEOUT_SECONDS, "failureThreshold": 3},
        "livenessProbe": {**probe(paths["liveness"]), "periodSeconds": LIVENESS_PERIOD_SECONDS,
                          "timeoutSeconds": live_timeout,
                          "failureThreshold": -(-prefill_seconds(config, loaded) // LIVENESS_PERIOD_SECONDS) + 1},
    }


def engine_exit_args(loaded: LoadedPlan) -> list[str]:
    """Engine flags for how it stops on SIGTERM. vLLM (and vllm-ascend, under vLLM's CLI):
    `--shutdown-timeout` (vllm/engine/arg_utils.py, VllmConfig.shutdown_timeout: 0, the default,
    aborts every running request at once). SGLang needs none: on SIGTERM its tokenizer manager waits
    for every request to end (TokenizerManager.sigterm_watchdog, sglang/srt/managers/tokenizer_manager.py)."""
    if loaded.plan.engine.kind == "sglang":
        return []
    return [f"--shutdown-timeout {VLLM_SHUTDOWN_TIMEOUT_SECONDS}"]


def _gateway_flags(gateways: Sequence[str]) -> str:
    return " ".join(f"--gateway {g}" for g in gateways) + " --every-address"


def drain_hook(pool: str, worker: str, wait: int, *, gateways: Sequence[str] = (GATEWAY_REPLICAS_URL,),
               done: str = DRAIN_DONE, stopping: str = DRAIN_STOPPING, undrain_pid: str = DRAIN_UNDRAIN_PID,
               key_env: str = DRAIN_KEY_ENV) -> str:
    """The drain sidecar's preStop (sh). First it stops the sidecar's undrain loop
    (drain_sidecar_script), which may still be retrying: it touches `stopping` (the loop starts no
    undrain after it) and ends the undrain running now (its pid in `undrain_pid`), waiting until it
    is gone, so no undrain lands after the drain. Then `kimi-gateway drain` of `worker` through
    every gateway replica (`--every-address` over `gateways`: the headless Service), waiting up to
    `wait` s for its requests; then `done` is touched, which releases the engine container's preStop
    (SIGTERM follows). Fails closed: when the drain fails (a refused key, no gateway answering, an
    unknown worker) the hook still holds the engine until `wait` s have passed since it began, so
    requests running then can end."""
    return (f"start=$(date +%s); touch {stopping}; "
            f'pid=$(cat {undrain_pid} 2>/dev/null) && kill "$pid" 2>/dev/null && '
            f'while kill -0 "$pid" 2>/dev/null; do sleep 1; done; '
            f"kimi-gateway drain {_gateway_flags(gateways)} --pool {pool} "
            f"--worker {worker} --wait {wait} --admin-key-env {key_env} || "
            f'{{ left=$(( {wait} - ($(date +%s) - start) )); [ "$left" -gt 0 ] && sleep "$left"; }}; '
            f"touch {done}")


def drain_sidecar_script(pool: str, worker: str, *, gateways: Sequence[str] = (GATEWAY_REPLICAS_URL,),
                         stopping: str = DRAIN_STOPPING, undrain_pid: str = DRAIN_UNDRAIN_PID,
                         key_env: str = DRAIN_KEY_ENV, retry_s: int = 10) -> str:
    """The drain sidecar's own command (sh, PID 1): put `worker` back into service on every gateway
    replica (`kimi-gateway drain --undrain`, retried every `retry_s` s until the undrain is in force:
    shared through Redis, or taken by every replica that answers; gateway/drain_command.py): a drain
    left by the pod this one replaces, e.g. after a rolling restart, is lifted as the engine starts;
    the gateways' health probes hold its traffic until it is healthy. Then it idles. The loop ends
    as soon as `stopping` exists (the pod's preStop, drain_hook, touches it and ends the undrain
    running then, whose pid is in `undrain_pid`), so it never undrains the worker the preStop drains.
    SIGTERM ends it at once, an undrain running or not: each command runs in the background and is
    waited on, since sh runs a trap only once a foreground command ended (and a shell as PID 1
    ignores the signal without a trap, holding the pod Terminating for its whole grace period)."""
    return (f"trap 'exit 0' TERM; "
            f"until [ -e {stopping} ]; do "
            f"kimi-gateway drain {_gateway_flags(gateways)} --pool {pool} --worker {worker} "
            f"--undrain --admin-key-env {key_env} & echo $! > {undrain_pid}; "
            f'[ -e {stopping} ] && kill $! 2>/dev/null; wait $!; ok=$?; rm -f {undrain_pid}; '
            f'[ "$ok" = 0 ] && break; sleep {retry_s} & wait $!; done; '
            "sleep infinity & wait $!")


def gateway_replicas_service() -> dict[str, Any]:
    """The headless Service over every gateway replica (GATEWAY_REPLICAS_SERVICE), ready or not:
    what the engines' drain sidecars resolve to reach each replica (a terminating replica still
    finishes requests on the worker; a starting one already routes)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": GATEWAY_REPLICAS_SERVICE, "labels": {"app.kubernetes.io/name": "kimi-gateway",
                                                                     "app.kubernetes.io/component": "gateway"}},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"app.kubernetes.io/name": "kimi-gateway"},
                     "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]}}


def drain_key_entry() -> dict[str, Any]:
    """The gateway config's auth key for the engines' drain sidecars: the `drain` scope only."""
    return {"name": DRAIN_KEY_NAME, "sha256": f"${{{DRAIN_KEY_HASH_ENV}}}", "scopes": ["drain"]}


def launch_script(loaded: LoadedPlan) -> str:
    """The engine container's command (bash), for Kubernetes: the plan's engine flags
    (gateway.plans.emit, as deploy/engines/<pool>.sh has them) without the key on the command line,
    and for multi-node plans the ranks from LeaderWorkerSet's variables, with no Ray:

    - vLLM: every node runs `vllm serve` with `--nnodes $LWS_GROUP_SIZE --node-rank $LWS_WORKER_INDEX
      --master-addr <leader IP>` (vllm/engine/arg_utils.py, ParallelConfig); the leader
      serves HTTP, the others add `--headless` (vllm/entrypoints/cli/serve.py: run_headless starts a
      bare MultiprocExecutor on a node whose rank within its data-parallel group is > 0). With
      DP > 1 each DP rank spans nodes / DP nodes (`--data-parallel-size-local 1`); the first node of
      each rank runs its engine headless with `--data-parallel-start-rank` and reaches the leader's
      `--data-parallel-address`.
    - SGLang: `--nnodes --node-rank --dist-init-addr <leader IP>:5000` (server_args.py); node
      0 serves HTTP, the others run the scheduler only.
    """
    plan = loaded.plan
    engine, hw, par = plan.engine, plan.hardware, plan.parallelism
    key_env = engine_api_key_env(loaded)
    drop = ("--api-key", "--distributed-executor-backend", "--data-parallel-backend", "--nnodes", "--node-rank",
            "--dist-init-addr")
    if engine.kind == "sglang":
        args = [a for a in sglang_args(loaded) if not a.startswith(drop)]
    else:
        args = ['"${MODEL_PATH:-' + engine.model_path + '}"']
        args += [a for a in vllm_args(loaded) if not a.startswith(drop)] + weights_load_args(loaded)
    args += engine_exit_args(loaded)
    out = [
        "#!/usr/bin/env bash",
        f"# {plan.pool.name}: {plan.title}, on Kubernetes (deploy/kubernetes/generate.py; the flags are "
        f"deploy/engines/{plan.pool.name}.sh's).",
        f"# The engine key comes from the environment ({key_env}), never the command line (/proc/PID/cmdline).",
        "set -euo pipefail",
    ]
    if key_env:
        out.append(f': "${{{key_env}:?set {key_env}: the bearer key the gateway sends pool {plan.pool.name}}}"')
    if hw.nodes > 1:
        out += [
            f"# One LeaderWorkerSet group = one instance of {hw.nodes} nodes; the controller sets the rank variables.",
            ': "${LWS_LEADER_ADDRESS:?}" "${LWS_WORKER_INDEX:?}" "${LWS_GROUP_SIZE:?}"',
            "rank=$LWS_WORKER_INDEX",
            "# The leader's address as an IP (its DNS record appears once its pod has one): the process",
            "# group's and the engines' sockets bind and connect on it.",
            f"for _ in $(seq {LEADER_DNS_ATTEMPTS}); do",
            '  leader=$(getent hosts "$LWS_LEADER_ADDRESS" | awk \'{print $1; exit}\') && [ -n "$leader" ] && break',
            "  sleep 5",
            "done",
            ': "${leader:?cannot resolve $LWS_LEADER_ADDRESS}"',
        ]
        if engine.kind == "sglang":
            args += ['--nnodes "$LWS_GROUP_SIZE"', '--node-rank "$rank"',
                     f'--dist-init-addr "$leader:{SGLANG_DIST_PORT}"']
        else:
            args += ['--nnodes "$LWS_GROUP_SIZE"', '--node-rank "$rank"', '--master-addr "$leader"',
                     f"--master-port {VLLM_MASTER_PORT}"]
            if par.data > 1:
                args += ["--data-parallel-size-local 1", '--data-parallel-address "$leader"',
                         f"--data-parallel-rpc-port {VLLM_DP_RPC_PORT}"]
    if engine.kind == "sglang":
        out.append("launcher=" + shlex.quote(sglang_launcher(key_env or "SGLANG_API_KEY")))
        return "\n".join(out) + "\n" + shell_command(args, 'exec python3 -c "$launcher"')
    if hw.nodes == 1:
        return "\n".join(out) + "\n" + shell_command(args, "exec vllm serve")
    out += ["args=(", *[f"  {a}" for a in args], ")"]
    per_rank = hw.nodes // par.data
    if par.data > 1:
        out += [f"# Nodes 0, {per_rank}, ... start data-parallel ranks 0..{par.data - 1} ({per_rank} nodes each).",
                f'if [ "$rank" != 0 ] && [ $((rank % {per_rank})) = 0 ]; then '
                f"args+=(--data-parallel-start-rank $((rank / {per_rank}))); fi"]
    out += ['if [ "$rank" != 0 ]; then', '  exec vllm serve "${args[@]}" --headless', "fi",
            'exec vllm serve "${args[@]}"']
    return "\n".join(out) + "\n"


def _drain_seconds(config: dict[str, Any], loaded: LoadedPlan) -> int:
    return request_budget_seconds(config, loaded) + DRAIN_MARGIN_SECONDS


def _engine_env(loaded: LoadedPlan, multi: bool) -> list[dict[str, Any]]:
    plan = loaded.plan
    env: list[dict[str, Any]] = [
        {"name": "MODEL_PATH", "value": posixpath.join("/models", plan.engine.model_path)},
        {"name": "HF_HUB_OFFLINE", "value": "1"},  # the weights come from the volume, never a download
        *compile_cache_env(loaded),
    ]
    key_env = engine_api_key_env(loaded)
    if key_env:
        env.append({"name": key_env, "valueFrom": {"secretKeyRef": {
            "name": ENGINE_KEYS_SECRET, "key": plan.engine.api_key_env}}})
    if multi:
        env += [{"name": k, "value": v} for k, v in fabric(plan.hardware.accelerator).items()]
        env += host_ip_env(loaded)
    return env


def host_ip_env(loaded: LoadedPlan) -> list[dict[str, Any]]:
    """vLLM's VLLM_HOST_IP (vllm/envs.py; vllm/utils get_ip falls back to the interface of a route
    to the internet, which on a pod with a second, RDMA network need not be the pod network's) set
    to the pod's IP, the address its peers reach; SGLang gets none (it binds to --dist-init-addr)."""
    if loaded.plan.engine.kind == "sglang":
        return []
    return [{"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def _engine_container(loaded: LoadedPlan, config: dict[str, Any], *, multi: bool, serves: bool) -> dict[str, Any]:
    """The engine container of one pod: a leader (or single-node pod) that serves HTTP, or a worker."""
    plan = loaded.plan
    engine, hw = plan.engine, plan.hardware
    node = NODE_RESOURCES[hw.accelerator]
    limits: dict[str, Any] = {"cpu": node["cpu"], "memory": node["memory"],
                              device_resource(hw.accelerator): hw.devices_per_node}
    if multi:
        limits[RDMA_RESOURCE] = 1
    ports = [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}]
    if multi:
        dist = SGLANG_DIST_PORT if engine.kind == "sglang" else VLLM_MASTER_PORT
        ports.append({"name": "dist", "containerPort": dist, "protocol": "TCP"})
    drain = _drain_seconds(config, loaded)
    container: dict[str, Any] = {
        "name": "engine",
        "image": ENGINE_IMAGES[engine.kind],
        "command": ["bash", f"/opt/kimi-k3/{plan.pool.name}.sh"],
        "ports": ports if serves else ports[1:],
        "env": _engine_env(loaded, multi),
        "resources": {"requests": dict(limits), "limits": dict(limits)},  # Guaranteed QoS: evicted last
        "volumeMounts": [
            {"name": "launch", "mountPath": "/opt/kimi-k3", "readOnly": True},
            {"name": "weights", "mountPath": "/models", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            compile_cache_volume(loaded)[1],
        ],
    }
    if multi:
        # RDMA memory registration pins pages (ibv_reg_mr): the capability lifts RLIMIT_MEMLOCK.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    if serves:
        # Weight loading: the startup probe allows startup_seconds before liveness takes over.
        container |= engine_probes(loaded, config)
        container["volumeMounts"].append({"name": "drain", "mountPath": "/drain"})
        # SIGTERM only once the drain sidecar has taken this worker out of every gateway replica and
        # its streams ended (or the drain's wait ran out): the sidecar touches DRAIN_DONE.
        container["lifecycle"] = {"preStop": {"exec": {"command": [
            "bash", "-c", f"for _ in $(seq {drain}); do [ -e {DRAIN_DONE} ] && exit 0; sleep 1; done"]}}}
    else:
        # A worker outlives its leader's drain: leaving the process group early cuts the leader's streams.
        container["lifecycle"] = {"preStop": {"exec": {"command": [
            "bash", "-c", f"for _ in $(seq {drain}); do (exec 3<>/dev/tcp/$LWS_LEADER_ADDRESS/{engine.port}) "
            "2>/dev/null || exit 0; sleep 1; done"]}}}
    return container


def _drain_container(loaded: LoadedPlan, config: dict[str, Any]) -> dict[str, Any]:
    """The sidecar that takes the pod's worker out of every gateway replica before the engine stops
    (preStop: drain_hook) and puts it back when the pod starts (drain_sidecar_script); the engine
    image has no `kimi-gateway` CLI."""
    plan = loaded.plan
    pool, port = plan.pool.name, plan.engine.port
    wait = request_budget_seconds(config, loaded)
    worker = f"http://${{POD_NAME}}.{pool}:{port}"  # the URL the gateway's config names (instances())
    drain = drain_hook(pool, worker, wait)
    return {
        "name": "drain",
        "image": DRAIN_IMAGE,
        "command": ["sh", "-c", drain_sidecar_script(pool, worker)],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": DRAIN_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": DRAIN_KEY_SECRET,
                                                                       "key": DRAIN_KEY_ENV}}}],
        # The drain CLI is a Python process whose start takes ~0.8 CPU-seconds (measured on loopback):
        # ~16 s of the drain's time at 50m, ~3 s at 250m.
        "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"cpu": "250m", "memory": "128Mi"}},
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", drain]}}},
        "volumeMounts": [{"name": "drain", "mountPath": "/drain"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "runAsUser": 10001, "capabilities": {"drop": ["ALL"]}},
    }


def _pod_spec(loaded: LoadedPlan, config: dict[str, Any], *, multi: bool, serves: bool) -> dict[str, Any]:
    plan = loaded.plan
    pool, hw = plan.pool.name, plan.hardware
    node = NODE_RESOURCES[hw.accelerator]
    containers = [_engine_container(loaded, config, multi=multi, serves=serves)]
    volumes: list[dict[str, Any]] = [
        {"name": "launch", "configMap": {"name": f"{pool}-launch", "defaultMode": 0o555}},
        {"name": "weights", "persistentVolumeClaim": {"claimName": WEIGHTS_CLAIM, "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": node["shm"]}},  # counts toward memory
        compile_cache_volume(loaded)[0],
    ]
    if serves:
        containers.append(_drain_container(loaded, config))
        volumes.append({"name": "drain", "emptyDir": {"sizeLimit": "1Mi"}})
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "priorityClassName": PRIORITY_CLASS,
        # Beyond the drain sidecar's wait (the longest request) and the engine's own shutdown.
        "terminationGracePeriodSeconds": _drain_seconds(config, loaded) + ENGINE_EXIT_SECONDS,
        # GPU/NPU nodes are commonly tainted with their device resource's name.
        "tolerations": [{"key": device_resource(hw.accelerator), "operator": "Exists", "effect": "NoSchedule"}],
        "containers": containers,
        "volumes": volumes,
    }
    if node_selector(hw.accelerator):
        spec["nodeSelector"] = node_selector(hw.accelerator)
    if hw.accelerator in NVLINK_DOMAIN:
        # TP spans trays: the pods share one IMEX channel of the rack's ComputeDomain (NVIDIA DRA driver).
        spec["resourceClaims"] = [{"name": "imex-channel", "resourceClaimTemplateName": f"{pool}-imex-channel"}]
        containers[0]["resources"]["claims"] = [{"name": "imex-channel"}]
    return spec


def engine_objects(loaded: LoadedPlan, config: dict[str, Any]) -> list[dict[str, Any]]:
    """The workload running the plan's engine, its Services, PodDisruptionBudget and NetworkPolicy.

    Single-node instances: a StatefulSet (one pod = one engine = one gateway worker) and its headless
    Service. Multi-node instances: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of `replicas`
    groups of `nodes` pods; a failed pod restarts its whole group (RecreateGroupAfterStart), a
    rollout replaces one group at a time (maxUnavailable 1, maxSurge 0), and a Service
    `<pool>-leaders` selects only the leaders (worker-index 0), the pods that serve HTTP, for DNS
    discovery. NVL72: a ComputeDomain whose IMEX channel every pod of the group claims.
    """
    plan = loaded.plan
    pool, engine, hw = plan.pool.name, plan.engine, plan.hardware
    multi = hw.nodes > 1
    labels = _labels(pool)
    http = [{"name": "http", "port": engine.port, "targetPort": "http", "protocol": "TCP"}]
    objects: list[dict[str, Any]] = []
    if not multi:
        objects.append({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": pool, "labels": labels},
            "spec": {
                "serviceName": pool,
                "replicas": plan.replicas,
                "podManagementPolicy": "Parallel",  # weights load in parallel; order means nothing here
                # One instance at a time: the others keep serving while one reloads its weights.
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                "selector": {"matchLabels": {"app.kubernetes.io/instance": pool}},
                "template": {"metadata": {"labels": labels},
                             "spec": _pod_spec(loaded, config, multi=False, serves=True)},
            },
        })
        objects.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": pool, "labels": labels},
                        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                                 "selector": {"app.kubernetes.io/instance": pool}, "ports": http}})
    else:
        annotations = {}
        if hw.accelerator in NVLINK_DOMAIN:
            # All pods of a group on one NVLink partition (the GPU feature discovery's clique label).
            annotations["leaderworkerset.sigs.k8s.io/exclusive-topology"] = NVLINK_DOMAIN[hw.accelerator]
        objects.append({
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": pool, "labels": labels, **({"annotations": annotations} if annotations else {})},
            "spec": {
                "replicas": plan.replicas,
                "startupPolicy": "LeaderCreated",  # all nodes start together; the leader waits for them
                "rolloutStrategy": {"type": "RollingUpdate",
                                    "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
                "leaderWorkerTemplate": {
                    "size": hw.nodes,
                    # A failed pod recreates its group, but not while one of the group's pods is still
                    # Pending (an image pull, scheduling): no restart loop while a group forms
                    # (LWS v0.9+ restartPolicy; the vendored v0.10.0 CRD schema has it).
                    "restartPolicy": "RecreateGroupAfterStart",
                    "leaderTemplate": {"metadata": {"labels": labels},
                                       "spec": _pod_spec(loaded, config, multi=True, serves=True)},
                    "workerTemplate": {"metadata": {"labels": labels},
                                       "spec": _pod_spec(loaded, config, multi=True, serves=False)},
                },
            },
        })
        objects.append({"apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": f"{pool}-leaders", "labels": labels},
                        "spec": {"clusterIP": "None",
                                 "selector": {LWS_NAME_LABEL: pool, LWS_WORKER_INDEX_LABEL: "0"}, "ports": http}})
        if hw.accelerator in NVLINK_DOMAIN:
            objects.append({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
                            "metadata": {"name": pool, "labels": labels},
                            "spec": {"numNodes": 0,  # 0: IMEX daemons with DNS names (the driver's default)
                                     "channel": {"resourceClaimTemplate": {"name": f"{pool}-imex-channel"}}}})
    # Voluntary evictions (node drains) take one pod at a time, and none while any instance is down;
    # a pool of one instance blocks them: drain it through the gateway first (deploy/README.md).
    objects.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": pool, "labels": labels},
                    "spec": {"maxUnavailable": 1 if plan.replicas > 1 else 0,
                             "selector": {"matchLabels": {"app.kubernetes.io/name": pool}}}})
    ingress: list[dict[str, Any]] = [{
        "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kimi-gateway"}}}],
        "ports": [{"port": engine.port, "protocol": "TCP"}],
    }]
    if multi:
        ingress.append({"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": pool}}}]})
    objects.append({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": pool},
        "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": pool}},
                 "policyTypes": ["Ingress"], "ingress": ingress},
    })
    return objects


def kustomize_configuration() -> dict[str, Any]:
    """Transformer configuration teaching kustomize the LeaderWorkerSet's pod templates: the
    generated ConfigMap and Secret names (with their content hash) and `images:` overrides reach
    its leader and worker pods, as they reach a StatefulSet's."""
    templates = ["spec/leaderWorkerTemplate/leaderTemplate/spec", "spec/leaderWorkerTemplate/workerTemplate/spec"]
    def specs(*paths: str) -> list[dict[str, Any]]:
        return [{"kind": "LeaderWorkerSet", "path": f"{t}/{p}"} for t in templates for p in paths]
    return {
        "nameReference": [
            {"kind": "ConfigMap", "version": "v1", "fieldSpecs": specs("volumes/configMap/name")},
            {"kind": "Secret", "version": "v1", "fieldSpecs": specs("containers/env/valueFrom/secretKeyRef/name")},
        ],
        "images": specs("containers/image"),
    }


def shared_objects() -> list[dict[str, Any]]:
    """Objects every overlay with engines has once: the engines' PriorityClass, and the policy that
    lets the engines' drain sidecars reach the gateway's port (base/network-policy.yaml admits only
    the ingress and monitoring namespaces)."""
    return [
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": PRIORITY_CLASS},
         "value": 1000000, "preemptionPolicy": "PreemptLowerPriority", "globalDefault": False,
         "description": "Kimi K3 engines: scheduled before, and preempted after, ordinary workloads"},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "kimi-gateway-drains"},
         "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kimi-gateway"}},
                  "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}}}],
                               "ports": [{"port": "http", "protocol": "TCP"}]}]}},
        gateway_replicas_service(),
    ]


def gateway_grace_seconds(config: dict[str, Any], plans: list[LoadedPlan]) -> int:
    """`shutdown.grace_period` for a gateway in front of `plans`: the longest request any of their
    pools allows (request_budget_seconds), or the config's own grace period if that is longer.
    A gateway that stops sooner cuts the most expensive streams, the long prefills, on every
    rollout or scale-down."""
    longest = max((request_budget_seconds(config, loaded) for loaded in plans), default=0)
    return max(longest, int(-(-gateway_shutdown(config).grace_period // 1)))


def gateway_config(config: dict[str, Any], entries: list[dict[str, Any]], plans: list[LoadedPlan]) -> dict[str, Any]:
    """The production config with only `entries` as its pools, Redis from ${REDIS_URL} (required),
    and a shutdown grace period covering the longest request of these plans' pools."""
    out = dict(config)
    out["pools"] = list(entries)
    out["redis_url"] = "${REDIS_URL}"
    out["shutdown"] = {**(config.get("shutdown") or {}), "grace_period": gateway_grace_seconds(config, plans)}
    auth = dict(config.get("auth") or {})
    auth["keys"] = [*(auth.get("keys") or []), drain_key_entry()]
    out["auth"] = auth
    return out


def gateway_patch(plans: list[LoadedPlan], config: dict[str, Any], items: list[dict[str, str]]) -> dict[str, Any]:
    """Strategic-merge patch of base/gateway.yaml's Deployment for these plans' pools."""
    env = [{"name": inst["env"], "value": inst["url"]} for loaded in plans for inst in instances(loaded)]
    env_from: list[dict[str, Any]] = [{"secretRef": {"name": "kimi-gateway-keys"}}]
    if any(loaded.plan.engine.api_key_env for loaded in plans):
        env_from.append({"secretRef": {"name": "kimi-engine-keys"}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "kimi-gateway"},
        "spec": {
            "template": {"spec": {
                "terminationGracePeriodSeconds": termination_grace_seconds(gateway_shutdown(
                    gateway_config(config, [], plans))),
                "containers": [{"name": "gateway", "env": env, "envFrom": env_from}],
                "volumes": [{"name": "config", "configMap": {"name": "kimi-gateway-config", "items": items}}],
            }},
        },
    }


def single_pool_readiness(pairs: list[tuple[LoadedPlan, dict[str, Any]]]) -> dict[str, Any]:
    """The gateway config's `readiness` for an overlay of one pool: `none`, so a replica is ready while
    it runs and is not draining. With the default `any` every replica would answer /ready 503 while
    the pool's only engines load their weights (15 to 36 minutes) or its NVL72 group rolls: the
    Service would have no endpoints (clients get the ingress's errors, not the gateway's 503 with
    Retry-After) and node drains would wait on the gateway's PodDisruptionBudget. Overlays of
    several pools keep the config's own setting."""
    return {"readiness": {"pools": "none"}} if len(pairs) == 1 else {}


def monitoring_patches() -> list[dict[str, Any]]:
    """Kustomize patches giving every Prometheus Operator object of the overlay the label
    `release: MONITORING_RELEASE_LABEL` (kube-prometheus-stack's default selector); none without one."""
    if MONITORING_RELEASE_LABEL is None:
        return []
    return [{"target": {"group": "monitoring.coreos.com"},
             "patch": _dump([{"op": "add", "path": "/metadata/labels/release", "value": MONITORING_RELEASE_LABEL}])}]


Pairs = list[tuple[LoadedPlan, dict[str, Any]]]  # (plan, its pool entry in the production config)


def component_files(members: Pairs, everything: Pairs, config: dict[str, Any]) -> dict[str, str]:
    """A kustomize Component adding `members`' pools to the production overlay (which leaves them out):
    their engines, launch scripts and engine keys, and the gateway's config, worker variables and
    mounted files as for `everything` (the production config's plans, members included). Path in the
    component's folder -> text."""
    full = overlay_files(PRODUCTION_OVERLAY, everything, config)
    generators = yaml.safe_load(full["kustomization.yaml"])["configMapGenerator"]
    (gateway_files,) = [g for g in generators if g["name"] == "kimi-gateway-config"]
    plans = [loaded for loaded, _ in members]
    sources = ", ".join(f"config/{posixpath.normpath(entry['plan'])}" for _, entry in members)
    files = {key: text for key, text in full.items() if key == "gateway-patch.yaml" or (
        key.startswith("files/") and (not key.endswith(".sh") or any(key == f"files/{p.plan.pool.name}.sh"
                                                                      for p in plans)))}
    files["engines.yaml"] = GENERATED.format(source=sources) + _dump(
        *[obj for loaded in plans for obj in engine_objects(loaded, config)])
    component: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "resources": ["engines.yaml"],
        "patches": [{"path": "gateway-patch.yaml"}],
        "configMapGenerator": [
            {**gateway_files, "behavior": "replace"},
            *[{"name": f"{p.plan.pool.name}-launch", "files": [f"{p.plan.pool.name}.sh=files/{p.plan.pool.name}.sh"]}
              for p in plans],
        ],
    }
    key_envs = sorted({p.plan.engine.api_key_env for p in plans if p.plan.engine.api_key_env})
    if key_envs:  # EMPTY, as the production overlay's: set them in your private overlay
        component["secretGenerator"] = [{"name": ENGINE_KEYS_SECRET, "behavior": "merge",
                                         "literals": [f"{k}=" for k in key_envs]}]
    names = " ".join(p.plan.name for p in plans)
    files["kustomization.yaml"] = (GENERATED.format(source=sources)
                                   + f"# {names}: not in overlays/{PRODUCTION_OVERLAY}, which applies on a cluster "
                                   "without these accelerators.\n# Add it to production in your overlay: "
                                   f"`resources: [.../overlays/{PRODUCTION_OVERLAY}]` and `components: "
                                   f"[.../components/{plans[0].plan.name}]` (overlays/{PRODUCTION_OVERLAY}-"
                                   f"{plans[0].plan.name} does).\n" + _dump(component))
    return files


def overlay_files(name: str, pairs: list[tuple[LoadedPlan, dict[str, Any]]], config: dict[str, Any]) -> dict[str, str]:
    """The files of overlay `name` for (plan, its pool entry in the config) pairs: path in the folder -> text."""
    config_dir = PRODUCTION.parent.resolve()
    files: dict[str, str] = {}
    items = [{"key": "gateway.yaml", "path": "gateway.yaml"}]
    for loaded, _ in pairs:
        card_file = (loaded.path.parent / loaded.plan.model).resolve()
        for file in (loaded.path.resolve(), card_file):
            path = file.relative_to(config_dir).as_posix()  # ValueError outside config/
            key = posixpath.basename(path)
            if key == "gateway.yaml" or any(i["key"] == key and i["path"] != path for i in items):
                raise ValueError(f"{path}: its file name collides with another file of the overlay")
            if not any(i["key"] == key for i in items):
                items.append({"key": key, "path": path})
                files[f"files/{key}"] = file.read_text(encoding="utf-8")
        files[f"files/{loaded.plan.pool.name}.sh"] = launch_script(loaded)
    plans = [loaded for loaded, _ in pairs]
    sources = ", ".join(f"config/{posixpath.normpath(entry['plan'])}" for _, entry in pairs)
    overlay_config = gateway_config(config, [entry for _, entry in pairs], plans) | single_pool_readiness(pairs)
    files["files/gateway.yaml"] = (GENERATED.format(source=f"config/k3-production.yaml (its pools for {sources})")
                                   + _dump(overlay_config))
    files["engines.yaml"] = GENERATED.format(source=sources) + _dump(
        *shared_objects(), *[obj for loaded in plans for obj in engine_objects(loaded, config)])
    files["kustomizeconfig.yaml"] = GENERATED.format(source="deploy/kubernetes/generate.py") + _dump(
        kustomize_configuration())
    files["gateway-patch.yaml"] = (GENERATED.format(source=sources + " and config/k3-production.yaml")
                                   + _dump(gateway_patch(plans, config, items)))
    replicas = int(config.get("replicas", 1))
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["../../base", "engines.yaml"],
        "configurations": ["kustomizeconfig.yaml"],
        "patches": [
            {"path": "gateway-patch.yaml"},
            {"target": {"kind": "HorizontalPodAutoscaler", "name": "kimi-gateway"},
             "patch": _dump([{"op": "replace", "path": "/spec/minReplicas", "value": replicas}])},
            *monitoring_patches(),
        ],
        "configMapGenerator": [
            {"name": "kimi-gateway-config", "files": [f"{i['key']}=files/{i['key']}" for i in items]},
            *[{"name": f"{p.plan.pool.name}-launch", "files": [f"{p.plan.pool.name}.sh=files/{p.plan.pool.name}.sh"]}
              for p in plans],
        ],
    }
    key_envs = sorted({p.plan.engine.api_key_env for p in plans if p.plan.engine.api_key_env})
    if key_envs:
        # EMPTY on purpose: the launch scripts refuse to start without their key. Replace it in a
        # private overlay (behavior: replace) or manage kimi-engine-keys with an external secret store.
        kustomization["secretGenerator"] = [{"name": ENGINE_KEYS_SECRET, "literals": [f"{k}=" for k in key_envs]}]
    # The drain key the engines' drain sidecars send the gateway (scope `drain` only; its SHA-256 is
    # DRAIN_KEY_SHA256 in kimi-gateway-keys): EMPTY as well (the drain is refused, and the engine then
    # waits its whole drain time before SIGTERM). Replace it as the other two.
    kustomization.setdefault("secretGenerator", []).append({"name": DRAIN_KEY_SECRET,
                                                            "literals": [f"{DRAIN_KEY_ENV}="]})
    summary = "".join(
        f"# {p.plan.title}: pool {p.plan.pool.name}, {p.plan.replicas} engine instance(s) of {p.plan.hardware.nodes} "
        f"node(s) x {p.plan.hardware.devices_per_node} {p.plan.hardware.accelerator}, "
        f"max context {p.plan.max_context_tokens:,}.\n" for p in plans)
    files["kustomization.yaml"] = (GENERATED.format(source=sources) + summary
                                   + f"# Render: kubectl kustomize deploy/kubernetes/overlays/{name}\n"
                                   + _dump(kustomization))
    return files


def prometheus_rule() -> str:
    """base/monitoring/prometheusrule.yaml: alerts.yml's groups under a PrometheusRule's spec, text kept."""
    lines = ALERTS.read_text(encoding="utf-8").splitlines()
    body = [line for line in lines if not line.startswith("#")]  # the file's own header comment
    while body and not body[0].strip():
        body.pop(0)
    head = (GENERATED.format(source="deploy/prometheus/alerts.yml")
            + "# The Prometheus Operator loads these rules; your Prometheus may select PrometheusRules by a label\n"
            + "# (kube-prometheus-stack: `release: <its release name>`): add it to the metadata.\n"
            + "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata:\n  name: kimi-gateway\n"
            + "  labels:\n    app.kubernetes.io/name: kimi-gateway\nspec:\n")
    return head + "\n".join(f"  {line}" if line.strip() else "" for line in body) + "\n"


def render_all() -> dict[Path, str]:
    """Every generated file: absolute path -> text. One overlay per plan, `production` with every plan
    but the optional ones (optional_plan), and for each of those its component and `production-<plan>`."""
    config = yaml.safe_load(PRODUCTION.read_text(encoding="utf-8"))
    out: dict[Path, str] = {PROMETHEUS_RULE: prometheus_rule()}
    pairs = [(load_plan(PRODUCTION.parent / entry["plan"]), entry) for entry in config["pools"]
             if isinstance(entry, dict) and "plan" in entry]  # a pool typed in the config has no plan to deploy
    overlays = {loaded.plan.name: [(loaded, entry)] for loaded, entry in pairs}
    core = [(loaded, entry) for loaded, entry in pairs if not optional_plan(loaded)]
    if len(pairs) > 1:
        overlays[PRODUCTION_OVERLAY] = core
    for name, members in overlays.items():
        for file, text in overlay_files(name, members, config).items():
            out[OVERLAYS / name / file] = text
    if len(pairs) > 1:
        out |= optional_components([pair for pair in pairs if optional_plan(pair[0])], pairs, config)
    return out


def components_dir() -> Path:
    """deploy/kubernetes/components/: the generated components and hand-written ones (gateway-api)."""
    return OVERLAYS.parent / "components"


def optional_components(optional: Pairs, everything: Pairs, config: dict[str, Any]) -> dict[Path, str]:
    """components/<plan>/ for each optional plan (component_files), and overlays/production-<plan>/,
    production with that component: absolute path -> text."""
    out: dict[Path, str] = {}
    for pair in optional:
        name = pair[0].plan.name
        for file, text in component_files([pair], everything, config).items():
            out[components_dir() / name / file] = text
        example = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                   "resources": [f"../{PRODUCTION_OVERLAY}"], "components": [f"../../components/{name}"]}
        out[OVERLAYS / f"{PRODUCTION_OVERLAY}-{name}" / "kustomization.yaml"] = (
            GENERATED.format(source="deploy/kubernetes/generate.py")
            + f"# overlays/{PRODUCTION_OVERLAY} with the {name} pool (components/{name}).\n" + _dump(example))
    return out


def drift() -> list[str]:
    """Files that differ from what would be generated, are missing, or are stale in overlays/ or a
    generated component's folder."""
    wanted = render_all()
    problems = [f"{p.relative_to(ROOT)}: differs" for p, text in wanted.items()
                if p.exists() and p.read_text(encoding="utf-8") != text]
    problems += [f"{p.relative_to(ROOT)}: missing" for p in wanted if not p.exists()]
    for folder in _generated_dirs(wanted):
        if folder.exists():
            problems += [f"{p.relative_to(ROOT)}: not generated (stale)" for p in sorted(folder.rglob("*"))
                         if p.is_file() and p not in wanted]
    return problems


def _generated_dirs(wanted: dict[Path, str]) -> list[Path]:
    """overlays/ and each generated component's folder (components/ also holds hand-written ones)."""
    return [OVERLAYS, *sorted({p.parent for p in wanted if p.parent.parent == components_dir()})]


def write() -> list[Path]:
    """Replace overlays/ and the PrometheusRule with freshly generated files; return their paths."""
    wanted = render_all()
    for folder in _generated_dirs(wanted):
        shutil.rmtree(folder, ignore_errors=True)
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return sorted(wanted)


def main(argv: list[str] | None = None) -> int:
    """Command line: write the files, or with --check report drift (exit 1). Returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 naming files that differ")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python deploy/kubernetes/generate.py", file=sys.stderr)
        return 1 if problems else 0
    for path in write():
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
