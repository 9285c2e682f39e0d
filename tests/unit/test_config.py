"""Config loading: YAML, ${ENV} interpolation, env overrides, errors that name the path."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.cli import main
from gateway.config import ConfigError, load_config, parse_config
from gateway.config_base import explain_validation_error
from tests.support import REPO_ROOT

POOL = {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 1000}


@pytest.mark.parametrize("name", ["demo.yaml", "k3-production.yaml"])
def test_shipped_configs_load(name: str) -> None:
    # The production file enables auth: its key digests have no default.
    environ = {"CLIENT_KEY_SHA256": "a" * 64, "ADMIN_KEY_SHA256": "b" * 64} if "production" in name else {}
    config = load_config(REPO_ROOT / "config" / name, environ=environ)
    assert [p.max_context_tokens for p in config.pools] == sorted(p.max_context_tokens for p in config.pools)


def test_the_multi_model_example_gives_each_model_its_own_chain() -> None:
    """config/k3-multi-model.yaml (docs/routing.md "Several models"): K3 on the four plan pools,
    a second model and an embedding model each on their own pool, two adapters on the vLLM pool."""
    environ = {"CLIENT_KEY_SHA256": "a" * 64, "ADMIN_KEY_SHA256": "b" * 64}
    config = load_config(REPO_ROOT / "config" / "k3-multi-model.yaml", environ=environ)
    chains = {m.name: [p.name for p in config.model_pools(m.name)] for m in config.served_models()}
    assert chains == {"kimi-k3": ["vllm-128k", "ascend-128k", "sglang-512k", "nvl72-1m"],
                      "qwen3-30b-a3b": ["qwen3-30b"], "qwen3-embedding-8b": ["embed"]}
    served = config.pool_served_names()
    assert served["vllm-128k"] == ("moonshotai/Kimi-K3",) and served["embed"] == ("Qwen/Qwen3-Embedding-8B",)
    vllm = config.pool("vllm-128k")
    assert vllm.lora_adapters == ["sql-lora"] and [m.name for m in vllm.lora_on_demand] == ["support-lora"]


def test_env_interpolation_and_defaults() -> None:
    data = {"pools": [{**POOL, "workers": ["${W0}", "${W1:-http://fallback:8000}"], "api_key": "${KEY:-}"}]}
    config = parse_config(data, environ={"W0": "http://w0:8000/"})
    assert config.pools[0].workers == ["http://w0:8000", "http://fallback:8000"]
    assert config.pools[0].api_key is None
    data["pools"][0]["api_key"] = "${KEY}"
    with pytest.raises(ConfigError) as info:
        parse_config(data, environ={})
    assert str(info.value) == ("environment variables not set (and no ${NAME:-default}): "
                               "pools.0.workers.0: ${W0}; pools.0.api_key: ${KEY}")


def test_env_overrides_top_level_fields() -> None:
    environ = {"KIMI_GATEWAY_REDIS_URL": "redis://elsewhere:6379/2", "KIMI_GATEWAY_PORT": "9001",
               "kimi_gateway_max_attempts": "1", "KIMI_GATEWAY_NOT_A_FIELD": "x",
               "KIMI_GATEWAY_SHUTDOWN": '{"drain_delay": 0}', "KIMI_GATEWAY_ADMIN_ORIGINS": '["https://ops.example"]'}
    config = parse_config({"pools": [POOL], "port": 8000, "shutdown": {"grace_period": 7}}, environ=environ)
    assert (config.redis_url, config.port, config.max_attempts) == ("redis://elsewhere:6379/2", 9001, 1)
    # A section from the environment is merged into the file's: the file's grace period stays.
    assert (config.shutdown.drain_delay, config.shutdown.grace_period) == (0, 7)
    assert config.admin_origins == ["https://ops.example"]


HOSTILE_ENVIRONMENT = {
    "KIMI_GATEWAY_MAX_ATTEMPTS": "1", "KIMI_GATEWAY_PORT": "9001", "KIMI_GATEWAY_REDIS_URL": "redis://nowhere:1/0",
    "KIMI_GATEWAY_AUTH": '{"enabled": tru', "KIMI_GATEWAY_POOLS": "[]", "KIMI_GATEWAY_LOG_LEVEL": "shout",
    "W0": "http://from-the-process-environment:1",
}


@pytest.mark.parametrize("environ", [{}, None])
def test_the_process_environment_is_never_read(monkeypatch: pytest.MonkeyPatch,
                                               environ: dict[str, str] | None) -> None:
    """Only the mapping passed in counts: a developer's exported KIMI_GATEWAY_* (or any) variable
    changes nothing (with pydantic-settings, KIMI_GATEWAY_MAX_ATTEMPTS=1 broke three failover tests)."""
    for name, value in HOSTILE_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    data = {"pools": [{**POOL, "workers": ["${W0:-http://default:1}"]}]}
    config = parse_config(data, environ=environ) if environ is not None else parse_config(data)
    assert (config.max_attempts, config.port, config.redis_url, config.log_level) == (3, 8000, None, "info")
    assert config.pools[0].workers == ["http://default:1"] and not config.auth.enabled
    path = REPO_ROOT / "config" / "demo.yaml"
    assert load_config(path, environ={}) == load_config(path)
    assert load_config(path, environ={}).max_attempts == 3
    # The same variables, passed explicitly, do count.
    with pytest.raises(ConfigError, match="KIMI_GATEWAY_AUTH is not valid JSON"):
        parse_config(data, environ=HOSTILE_ENVIRONMENT)



@pytest.mark.parametrize(("change", "path"), [
    ({"engine": "tgi"}, "pools.0.engine"),
    ({"workers": ["localhost:80"]}, "pools.0.workers"),
    ({"workers": []}, "pools.0.workers"),
    ({"max_context_tokens": 0}, "pools.0.max_context_tokens"),
    ({"policy": "random"}, "pools.0.policy"),
    ({"colour": "red"}, "pools.0.colour"),
    ({"workers": ["http://user:secret@w:8000"]}, "pools.0.workers"),
    ({"workers": ["http://w:8000/?x=1"]}, "pools.0.workers"),
    ({"workers": ["http://w:99999"]}, "pools.0.workers"),
    ({"served_model_name": ""}, "pools.0.served_model_name"),
])
def test_errors_name_the_offending_path(change: dict[str, object], path: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_config({"pools": [{**POOL, **change}]}, environ={})
    assert explain_validation_error(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize(("top", "path", "words"), [
    ({"redis_url": "not a url"}, "redis_url", "redis://"),
    ({"health": {"ejection_base": 600}}, "health", "ejection_base (600.0) must not exceed ejection_max"),
    ({"estimation": {"image_tokens_min": 10, "image_tokens_max": 5}}, "estimation", "image_tokens_min"),
    ({"model": {"name": ""}}, "model.name", "at least 1 character"),
    ({"model": {"aliases": ["kimi-k3"]}}, "model", "must differ"),
])
def test_settings_that_cannot_work_are_refused(top: dict[str, object], path: str, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_config({"pools": [POOL], **top}, environ={})
    explained = explain_validation_error(info.value)
    assert explained.startswith(f"{path}: ") and words in explained
    assert "secret" not in explained


def test_yaml_merge_keys_and_redis_py_url_forms_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("pools:\n  - &base {name: a, engine: vllm, max_context_tokens: 5000, workers: ['http://w:1']}\n"
                    "  - {<<: *base, name: b, max_context_tokens: 9000}\n")
    merged = load_config(path, environ={}).pool("b")  # a merged key may be overridden: not a duplicate
    assert (merged.engine, merged.workers, merged.max_context_tokens) == ("vllm", ["http://w:1"], 9000)
    data = {"pools": [{**POOL, "name": "a"}, {**POOL, "name": "b", "max_context_tokens": 9000}]}
    for url in ("REDIS://h:6379/0", "unix:/run/redis.sock", "unix:///run/redis.sock?db=2", "rediss://u:p@h:6380"):
        assert parse_config({**data, "redis_url": url}, environ={}).redis_url == url


def test_worker_credentials_never_echo_in_the_error() -> None:
    with pytest.raises(ValidationError) as info:
        parse_config({"pools": [{**POOL, "workers": ["http://user:secret@w:8000"]}]}, environ={})
    assert "secret" not in explain_validation_error(info.value).split("input_value")[0]


def test_duplicate_pool_names_are_refused() -> None:
    with pytest.raises(ValidationError, match="unique"):
        parse_config({"pools": [POOL, POOL]}, environ={})


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["check-config", str(REPO_ROOT / "config" / "demo.yaml")])
    assert "pool sglang-512k: sglang, 2 worker(s), max context 524,288 tokens" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - name: p\n    engine: vllm\n    workers: [x]\n    max_context_tokens: 5\n")
    with pytest.raises(SystemExit) as info:
        main(["check-config", str(bad)])
    assert "pools.0.workers: Value error, worker URL must be http(s)://host:port" in str(info.value.code)
    (tmp_path / "broken.yaml").write_text("pools: [\n")
    with pytest.raises(SystemExit, match="not valid YAML"):
        main(["check-config", str(tmp_path / "broken.yaml")])


def test_check_config_reports_bad_files_and_overrides_without_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = "pools:\n  - {name: p, engine: vllm, workers: ['http://w:1'], max_context_tokens: 5000}\n"
    cases = {
        "binary.yaml": (b"\xff\xfe", "is not UTF-8 text"),
        "twice.yaml": ((good + "port: 1\nport: 2\n").encode(), "duplicate key 'port'"),
        "env.yaml": (good.replace("http://w:1", "${NOPE_URL}").encode(), "pools.0.workers.0: ${NOPE_URL}"),
    }
    for name, (content, words) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SystemExit) as info:
            main(["check-config", str(tmp_path / name)])
        assert words in str(info.value.code) and str(tmp_path / name) in str(info.value.code), name
    (tmp_path / "good.yaml").write_text(good)
    monkeypatch.setenv("KIMI_GATEWAY_AUTH", '{"enabled": tru')
    with pytest.raises(SystemExit) as info:
        main(["check-config", str(tmp_path / "good.yaml")])
    assert "KIMI_GATEWAY_* overrides are JSON" in str(info.value.code)
