"""`check-config` production-safety warnings and `--strict` (gateway/plans/safety.py) on the shipped
production config: it passes with its variables set and fails for each unsafe setting."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from gateway.plans.safety import env_references, read_tree
from tests.support import REPO_ROOT

PRODUCTION = REPO_ROOT / "config" / "k3-production.yaml"
MULTI_MODEL = REPO_ROOT / "config" / "k3-multi-model.yaml"


def production_env(config: Path = PRODUCTION) -> dict[str, str]:
    """A value for every variable `config` references, as a deployment would set them."""
    env = {}
    for path, name, _ in env_references(read_tree(config)):
        if ".workers." in path:
            env[name] = f"https://10.1.0.{len(env) + 1}:8000"  # plaintext http:// beyond loopback warns
        elif name.endswith("_SHA256"):
            env[name] = f"{len(env):x}".rjust(64, "c")
        elif name == "REDIS_URL":
            env[name] = "rediss://redis.kimi.svc.cluster.local:6380/0?ssl_ca_certs=/etc/redis-tls/ca.crt"
        else:
            env[name] = f"engine-key-{name.lower()}"
    return env


@pytest.fixture
def deployed(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = production_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in [n for n in os.environ if n.startswith("KIMI_GATEWAY_")]:
        monkeypatch.delenv(name)
    return env


def check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run `check-config --strict PATH`: (exit status, stdout + stderr)."""
    code, message = 0, ""
    try:
        main(["check-config", "--strict", str(path)])
    except SystemExit as exc:  # sys.exit("text") prints the text and exits 1
        code, message = (1, exc.code) if isinstance(exc.code, str) else (int(exc.code or 0), "")
    out, err = capsys.readouterr()
    return code, out + err + message


def edited_copy(tmp_path: Path, change: Callable[[dict[str, Any]], object]) -> Path:
    shutil.copytree(REPO_ROOT / "config", tmp_path / "config")
    path = tmp_path / "config" / "k3-production.yaml"
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_shipped_production_config_passes_strict_with_its_variables_set(
        deployed: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert {"VLLM_API_KEY", "SGLANG_API_KEY", "NVL72_API_KEY", "ASCEND_API_KEY", "REDIS_URL"} <= set(deployed)
    code, out = check(PRODUCTION, capsys)
    assert code == 0, out
    assert "OK" in out and "warning" not in out


def test_shipped_production_config_fails_strict_without_them(
        deployed: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in deployed:
        if not name.endswith("_SHA256"):
            monkeypatch.delenv(name)
    code, out = check(PRODUCTION, capsys)
    assert code == 1
    assert ("warning: pools.0.workers.0: ${VLLM_128K_WORKER_0} is not set: falls back to "
            "'http://vllm-128k-0:8000'") in out
    assert "warning: redis_url: 2 gateway replicas but Redis is on this host" in out
    assert ("warning: pools.0.workers: pool vllm-128k reaches vllm-128k-0, vllm-128k-1 over plaintext "
            "http://") in out
    assert "check-config --strict: 16 warning(s)" in out  # the 12 fallbacks and checks of before + 4 pools over
    # plaintext http:// (their fallback hosts)


def test_auth_off_on_0_0_0_0_fails_strict(
        deployed: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = edited_copy(tmp_path, lambda d: d.update(auth={"enabled": False}))
    code, out = check(path, capsys)
    assert code == 1
    assert "warning: host: listens on 0.0.0.0 (beyond loopback) with auth off" in out
    # without --strict the same file passes with the warning printed
    main(["check-config", str(path)])  # returns: no SystemExit
    assert "warning: host: listens on 0.0.0.0" in capsys.readouterr().out


def test_auth_off_on_loopback_is_fine(deployed: dict[str, str], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = edited_copy(tmp_path, lambda d: d.update(auth={"enabled": False}, host="127.0.0.1"))
    code, out = check(path, capsys)
    assert code == 0, out
    code, out = check(REPO_ROOT / "config" / "demo.yaml", capsys)
    assert code == 0, out


@pytest.mark.parametrize(("redis_url", "warned"), [
    ("redis://localhost:6379/0", True),
    ("redis://[::1]:6379", True),
    ("unix:///run/redis.sock", True),
    ("rediss://redis.kimi.svc.cluster.local:6380/0", False),
])
def test_replicas_with_a_local_redis_fail_strict(
        redis_url: str, warned: bool, deployed: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    code, out = check(PRODUCTION, capsys)
    assert (code, "2 gateway replicas but Redis is on this host" in out) == (int(warned), warned), out


def test_one_replica_may_use_a_local_redis(deployed: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    code, out = check(edited_copy(tmp_path, lambda d: d.update(replicas=1)), capsys)
    assert code == 0, out


def test_a_pool_without_engine_credentials_fails_strict(
        deployed: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ASCEND_API_KEY", "")  # set, but empty: no credential
    code, out = check(PRODUCTION, capsys)
    assert code == 1
    assert ("warning: pools.1.api_key: pool ascend-128k sends no engine credential while "
            "vllm-128k, sglang-512k, nvl72-1m do") in out


def test_a_placeholder_worker_host_fails_strict(
        deployed: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SGLANG_512K_WORKER_1", "http://sglang-1.example.com:30000")
    code, out = check(PRODUCTION, capsys)
    assert code == 1
    assert "warning: pools.2.workers.1: http://sglang-1.example.com:30000 is a placeholder host" in out


@pytest.mark.parametrize(("redis_url", "finding"), [
    ("redis://:s3cret@redis.kimi.svc.cluster.local:6379/0", "plaintext redis:// to redis.kimi.svc.cluster.local"),
    ("redis+sentinel://:s3cret@10.0.0.5,10.0.0.6/mymaster", "plaintext redis+sentinel:// to 10.0.0.5, 10.0.0.6"),
    ("redis+cluster://:s3cret@10.0.0.7:7000,127.0.0.1:7001", "plaintext redis+cluster:// to 10.0.0.7"),
    ("rediss://:s3cret@redis.kimi.svc.cluster.local:6380/0?ssl_cert_reqs=required", None),
    ("rediss+cluster://:s3cret@10.0.0.7:7000", None),
    ("redis://:s3cret@127.0.0.1:6379/0", None),  # loopback (one replica: the local-Redis check is quiet)
])
def test_plaintext_redis_beyond_loopback_fails_strict(
        redis_url: str, finding: str | None, deployed: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    path = edited_copy(tmp_path, lambda d: d.update(replicas=1))
    code, out = check(path, capsys)
    assert "s3cret" not in out
    if finding is None:
        assert code == 0, out
        return
    assert code == 1 and f"warning: redis_url: {finding}" in out, out
    assert "allow_plaintext: [redis]" in out
    accepted = edited_copy(tmp_path / "accepted", lambda d: d.update(replicas=1, allow_plaintext=["redis"]))
    assert check(accepted, capsys)[0] == 0


def test_plaintext_engines_beyond_loopback_fail_strict(
        deployed: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SGLANG_512K_WORKER_1", "http://10.1.0.40:30000")
    monkeypatch.setenv("NVL72_1M_WORKER_0", "http://127.0.0.1:8000")  # loopback: a sidecar, fine
    code, out = check(PRODUCTION, capsys)
    assert code == 1
    assert ("warning: pools.2.workers: pool sglang-512k reaches 10.1.0.40 over plaintext http://: the engine key "
            "and every prompt and answer cross the network unencrypted; use https:// or accept it with "
            "allow_plaintext: [engines]") in out
    assert "check-config --strict: 1 warning(s)" in out
    assert check(edited_copy(tmp_path, lambda d: d.update(allow_plaintext=["engines"])), capsys)[0] == 0


def test_the_multi_model_example_passes_strict_and_says_what_each_pool_serves(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in production_env(MULTI_MODEL).items():
        monkeypatch.setenv(name, value)
    for name in [n for n in os.environ if n.startswith("KIMI_GATEWAY_")]:
        monkeypatch.delenv(name)
    code, out = check(MULTI_MODEL, capsys)
    assert code == 0, out
    assert "OK — 3 models" in out
    assert "model qwen3-embedding-8b (aliases: Qwen/Qwen3-Embedding-8B): pools embed" in out
    assert "LoRA adapters sql-lora, support-lora (on demand)" in out and "apis embeddings" in out
