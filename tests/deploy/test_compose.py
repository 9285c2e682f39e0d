"""deploy/compose: the file passes the Compose specification's schema (check-jsonschema, and a broken
copy does not), its simulated engines are the plans' pools (engine, port, context, served name,
count) at the hosts the shipped production config falls back to, two gateway replicas share Redis
behind one published port, and its Prometheus config is valid (promtool)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.config import load_config
from gateway.plans.command import plans_of
from tests.deploy.tools import DEPLOY, run, tool
from tests.support import REPO_ROOT

COMPOSE = DEPLOY / "compose" / "compose.yaml"
PRODUCTION = REPO_ROOT / "config" / "k3-production.yaml"
CHECK_JSONSCHEMA = tool("check-jsonschema")
PROMTOOL = tool("promtool")
HAPROXY = tool("haproxy")
needs_check_jsonschema = pytest.mark.skipif(CHECK_JSONSCHEMA is None,
                                            reason="check-jsonschema not installed (PyPI, dev extra)")
_COMPOSE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_value(text: str) -> str:
    """Compose's own interpolation with nothing set in the environment: `${X:-default}` -> default."""
    return _COMPOSE_VAR.sub(lambda m: m.group(2) or "", text)


def validate(path: Path) -> Any:
    return run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)])


@needs_check_jsonschema
def test_compose_file_matches_the_compose_specification() -> None:
    result = validate(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_check_jsonschema
def test_the_schema_check_fails_broken_compose_files(tmp_path: Path) -> None:
    """An unknown service key and a wrong type: each file is reported as failing."""
    unknown_key, wrong_type = compose(), compose()
    unknown_key["services"]["gateway"]["replica"] = 2
    wrong_type["services"]["gateway"]["depends_on"] = 5  # a list or a mapping
    paths = []
    for name, data in [("unknown-key", unknown_key), ("wrong-type", wrong_type)]:
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(data))
    result = run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", *map(str, paths)])
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "unknown-key.yaml" in output and "wrong-type.yaml" in output, output


def sim_args(service: dict[str, Any]) -> dict[str, str]:
    assert service["entrypoint"] == ["kimi-gateway", "sim"]
    args = service["command"]
    return {args[i]: compose_value(args[i + 1]) for i in range(0, len(args), 2)}


def test_simulated_engines_are_the_plans_pools() -> None:
    services = compose()["services"]
    sims = {name: sim_args(s) for name, s in services.items() if s.get("entrypoint") == ["kimi-gateway", "sim"]}
    gateway_env = {k: compose_value(str(v)) for k, v in services["gateway"]["environment"].items()}
    expected = set()
    for loaded in plans_of(PRODUCTION):
        plan = loaded.plan
        for index in range(plan.replicas):
            name = f"{plan.pool.name}-{index}"
            expected.add(name)
            args = sims[name]
            assert args["--engine"] == plan.engine.kind, name
            assert int(args["--port"]) == plan.engine.port, name
            assert int(args["--max-context"]) == plan.max_context_tokens, name
            assert args["--served-model-name"] == plan.engine.served_model_name, name
            assert args["--host"] == "0.0.0.0", name
            # The image's HEALTHCHECK probes /health on KIMI_GATEWAY_PORT (the Dockerfile's 8000 unless set).
            health_port = services[name].get("environment", {}).get("KIMI_GATEWAY_PORT", "8000")
            assert int(health_port) == plan.engine.port, name
            assert plan.engine.api_key_env is not None
            assert args["--api-key"] == gateway_env[plan.engine.api_key_env], name
    assert set(sims) == expected


def test_the_shipped_production_config_reaches_the_simulated_engines() -> None:
    """The gateways run config/k3-production.yaml unchanged, with compose's environment: every
    worker URL names a sim service on its port, with the same context and served name."""
    services = compose()["services"]
    env = {k: compose_value(str(v)) for k, v in services["gateway"]["environment"].items()}
    config = load_config(PRODUCTION, environ=env)
    assert config.redis_url == "redis://redis:6379/0" and "redis" in services
    assert config.auth.enabled
    seen = set()
    for pool in config.pools:
        for url in pool.workers:
            parts = urlsplit(url)
            args = sim_args(services[parts.hostname])
            assert int(args["--port"]) == parts.port
            assert int(args["--max-context"]) == pool.max_context_tokens
            assert args["--served-model-name"] == pool.served_model_name
            assert pool.api_key is not None and pool.api_key.get_secret_value() == args["--api-key"]
            seen.add(parts.hostname)
    assert len(seen) == sum(len(p.workers) for p in config.pools) == 6


def test_two_gateway_replicas_behind_one_port() -> None:
    services = compose()["services"]
    gateway = services["gateway"]
    assert gateway["deploy"]["replicas"] == 2
    assert "ports" not in gateway  # only the load balancer publishes
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert published["lb"] == ["127.0.0.1:8000:8000"]
    assert all(p[0].startswith("127.0.0.1:") for p in published.values())  # a laptop demo: loopback only
    haproxy = (DEPLOY / "compose" / "haproxy.cfg").read_text()
    assert re.search(r"server-template \w+ \d+ gateway:8000", haproxy)
    assert "option httpchk GET /ready" in haproxy
    # One failed check is no verdict, and a draining replica (shutdown.drain_delay 5 s) leaves
    # the rotation before its listener closes.
    check = re.search(r"default-server check inter (\d+)s fall (\d+) rise (\d+)", haproxy)
    assert check is not None
    inter, fall, rise = map(int, check.groups())
    assert fall >= 2 and rise >= 2 and inter * fall < 5
    # The drain (shutdown.drain_delay 5 s + grace_period 30 s) fits in compose's stop timeout.
    assert int(gateway["stop_grace_period"].rstrip("s")) > 5 + 30


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_compose_prometheus_config_is_valid_with_the_alert_rules(tmp_path: Path) -> None:
    services = compose()["services"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in services["prometheus"]["volumes"]}
    for target, source in mounts.items():
        shutil.copy(COMPOSE.parent / source, tmp_path / Path(target).name)
    result = run([str(PROMTOOL), "check", "config", "prometheus.yml"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout + result.stderr)
    scrape = yaml.safe_load((tmp_path / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["job_name"] == "kimi-gateway"  # KimiGatewayDown selects it
    assert scrape["dns_sd_configs"][0]["names"] == ["gateway"]


@pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (Debian package haproxy)")
def test_haproxy_config_is_valid(tmp_path: Path) -> None:
    config = DEPLOY / "compose" / "haproxy.cfg"
    result = run([str(HAPROXY), "-c", "-f", str(config)])
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "haproxy.cfg"
    broken.write_text(config.read_text().replace("balance leastconn", "balance fewestconn"))
    assert run([str(HAPROXY), "-c", "-f", str(broken)]).returncode != 0
