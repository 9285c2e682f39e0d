"""deploy/prometheus through promtool: the config and the alert rules are valid, and the rules' unit tests
(alerts_test.yml: synthetic series in, expected alerts out) pass."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.prometheus_support import ALERTS, DEPLOY, PROMTOOL, recorded_names, rules

pytestmark = pytest.mark.skipif(not PROMTOOL.exists(), reason="promtool not installed (Debian package prometheus)")


def promtool(*args: str, cwd: Path = DEPLOY / "prometheus") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_config_is_valid_and_loads_the_rules() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The unit tests can fail: the same file expecting no alert where one fires is reported."""
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text())
    wrong = (DEPLOY / "prometheus" / "alerts_test.yml").read_text().replace(
        "summary: \"Pool vllm-128k has no healthy worker\"", "summary: \"Pool vllm-128k is fine\"")
    (tmp_path / "alerts_test.yml").write_text(wrong)
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "KimiGatewayPoolNoHealthyWorker" in result.stdout + result.stderr


def test_every_alert_is_labelled_annotated_and_tested() -> None:
    tested = (DEPLOY / "prometheus" / "alerts_test.yml").read_text()
    alerts = [rule for rule in rules() if "alert" in rule]
    assert len(alerts) >= 5
    for rule in alerts:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert "for" in rule, rule["alert"]
        assert f"alertname: {rule['alert']}\n" in tested, f"{rule['alert']} has no test in alerts_test.yml"


def test_recording_rules_used_by_alerts_are_defined() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        assert recorded_names(rule["expr"]) <= recorded, rule.get("alert") or rule["record"]
