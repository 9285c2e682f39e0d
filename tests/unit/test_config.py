"""Config loading: YAML, ${ENV} interpolation, env overrides, errors that name the path."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.cli import main
from gateway.config import ConfigError, explain_validation_error, load_config, parse_config
from tests.support import REPO_ROOT

POOL = {"name": "p", "engine": "vllm", "workers": ["http://127.0.0.1:9"], "max_context_tokens": 1000}


@pytest.mark.parametrize("name", ["demo.yaml", "k3-production.yaml"])
def test_shipped_configs_load(name: str) -> None:
    config = load_config(REPO_ROOT / "config" / name, environ={})
    assert [p.max_context_tokens for p in config.pools] == sorted(p.max_context_tokens for p in config.pools)


def test_env_interpolation_and_defaults() -> None:
    data = {"pools": [{**POOL, "workers": ["${W0}", "${W1:-http://fallback:8000}"], "api_key": "${KEY:-}"}]}
    config = parse_config(data, environ={"W0": "http://w0:8000/"})
    assert config.pools[0].workers == ["http://w0:8000", "http://fallback:8000"]
    assert config.pools[0].api_key is None
    with pytest.raises(ConfigError, match="W0 is not set"):
        parse_config(data, environ={})


def test_env_overrides_top_level_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIMI_GATEWAY_REDIS_URL", "redis://elsewhere:6379/2")
    monkeypatch.setenv("KIMI_GATEWAY_PORT", "9001")
    config = parse_config({"pools": [POOL], "port": 8000})
    assert (config.redis_url, config.port) == ("redis://elsewhere:6379/2", 9001)


@pytest.mark.parametrize(("change", "path"), [
    ({"engine": "tgi"}, "pools.0.engine"),
    ({"workers": ["localhost:80"]}, "pools.0.workers"),
    ({"workers": []}, "pools.0.workers"),
    ({"max_context_tokens": 0}, "pools.0.max_context_tokens"),
    ({"policy": "random"}, "pools.0.policy"),
    ({"colour": "red"}, "pools.0.colour"),
])
def test_errors_name_the_offending_path(change: dict[str, object], path: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_config({"pools": [{**POOL, **change}]}, environ={})
    assert explain_validation_error(info.value).startswith(f"{path}: ")


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
