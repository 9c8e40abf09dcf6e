"""deploy/monitoring: the PrometheusRule passes ``promtool check rules`` and its ``promtool test
rules`` unit tests (Debian's ``prometheus`` package; installed here when missing and possible),
every alert has a unit test and a runbook section in docs/observability.md, and the dashboard is
well-formed Grafana JSON whose panels all query epp's metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.prometheus_fixture import panel_queries, require_prometheus, rule_groups
from tests.unit import _kustomize as kz

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
RULE = MONITORING / "prometheus-rule.yaml"
RULE_TESTS = MONITORING / "tests" / "prometheus-rule.test.yaml"
DASHBOARD = MONITORING / "epp-dashboard.json"
DOC = ROOT / "docs" / "observability.md"


def _alerts() -> list[str]:
    return [r["alert"] for g in rule_groups(RULE) for r in g["rules"] if "alert" in r]


def _promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    _, promtool = require_prometheus()
    (tmp_path / "epp-rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(RULE)}))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    return subprocess.run([promtool, *args], cwd=tmp_path, capture_output=True, text=True, check=False)


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    done = _promtool(tmp_path, "check", "rules", "epp-rules.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(_alerts())} rules found" in done.stdout


def test_promtool_unit_tests_pass_and_cover_every_alert(tmp_path: Path) -> None:
    done = _promtool(tmp_path, "test", "rules", RULE_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {
        case["alertname"] for t in tests for case in t.get("alert_rule_test", ()) if case.get("exp_alerts")
    }
    assert firing == set(_alerts())


def test_every_alert_has_a_runbook_section() -> None:
    text = DOC.read_text()
    headings = {h.strip().lower() for h in re.findall(r"^#### (\S+)", text, re.M)}
    for group in rule_groups(RULE):
        for rule in group["rules"]:
            anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
            assert rule["alert"].lower() == anchor and anchor in headings, rule["alert"]


def test_the_dashboard_queries_epp_metrics_with_its_variables() -> None:
    doc = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in doc["templating"]["list"]]
    assert names == ["datasource", "namespace", "pod"]
    queries = panel_queries(
        DASHBOARD, {"namespace": ".*", "pod": ".*", "__rate_interval": "1m", "__range": "1h"}
    )
    assert len(queries) >= 25
    for title, expr in queries:
        assert "llm_d_epp_" in expr and "$" not in expr, title
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_the_service_monitor_scrapes_the_metrics_port_of_both_deployments() -> None:
    kube = ROOT / "deploy" / "kubernetes"
    (monitor,) = [o for o in kz.build(kube / "monitoring") if o["kind"] == "ServiceMonitor"]
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    (endpoint,) = monitor["spec"]["endpoints"]
    for overlay in ("base", "standalone"):
        (service,) = [
            o for o in kz.build(kube / overlay) if o["kind"] == "Service" and "epp" in o["metadata"]["name"]
        ]
        assert service["metadata"]["labels"][expression["key"]] in expression["values"], overlay
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, overlay
