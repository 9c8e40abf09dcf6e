"""A private Prometheus for the tests: Debian's ``prometheus`` (and its ``promtool``) run on a free
loopback port with their own data directory, never the package's system service.

Missing binaries are installed with ``apt-get install prometheus`` when this runs as root with
apt (as ``.ci/run`` does); elsewhere the test fails under CI (``CI=true``) and skips, saying why.
Also: Grafana dashboard panels as (title, PromQL) with the template variables substituted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.dev.stack import Child, Supervisor, free_port

DEBIAN_PACKAGE = "prometheus"
READY_TIMEOUT = 60.0


def _install() -> str:
    """Install Debian's package when we may (root, apt-get): "" on success, else why not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root with apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "install", "-y", "-qq", DEBIAN_PACKAGE],
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", DEBIAN_PACKAGE],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode == 0 and argv[1] == "install":
            return ""
    return f"apt-get install {DEBIAN_PACKAGE} failed: {done.stderr.strip()[-300:]}"


def require_prometheus() -> tuple[str, str]:
    """The paths of ``prometheus`` and ``promtool`` (installed here if missing and possible)."""
    why = ""
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        why = _install()
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus and promtool:
        return prometheus, promtool
    message = (
        "prometheus/promtool are not on PATH and could not be installed "
        f"({why or 'not found after install'}): apt-get install {DEBIAN_PACKAGE} to run the dashboard "
        "and alert tests"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class Target:
    """A scrape target with the labels Kubernetes service discovery would give it."""

    job: str
    address: str
    labels: Mapping[str, str]


class Prometheus:
    """One Prometheus process scraping ``targets`` every second, evaluating ``rule_files``."""

    def __init__(self, supervisor: Supervisor, workdir: Path, binary: str) -> None:
        self.supervisor = supervisor
        self.workdir = workdir
        self.binary = binary
        self.port = 0
        self.child: Child | None = None

    def start(self, targets: Sequence[Target], rule_files: Sequence[Path] = ()) -> Prometheus:
        jobs: dict[str, list[dict[str, Any]]] = {}
        for t in targets:
            jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": dict(t.labels)})
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": sc} for job, sc in jobs.items()],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_port()
        data = self.workdir / "prometheus-data"
        data.mkdir(exist_ok=True)
        self.child = self.supervisor.start(
            "prometheus",
            [
                self.binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
        )
        end = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if not self.child.running() or time.monotonic() > end:
                raise AssertionError(f"prometheus did not become ready:\n{self.child.tail(20)}")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as resp:
            body = json.load(resp)
        assert body.get("status") == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector (a scalar result as one sample)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets_up(self) -> dict[str, str]:
        """Each active target's scrape URL and health (up, down, unknown)."""
        data = self._get("/api/v1/targets")
        return {t["scrapeUrl"]: t["health"] for t in data["activeTargets"]}

    def firing(self) -> set[str]:
        """The names of the alerts firing now."""
        data = self._get("/api/v1/alerts")
        return {a["labels"]["alertname"] for a in data["alerts"] if a["state"] == "firing"}


def has_data(result: list[dict[str, Any]]) -> bool:
    """Whether a query result would draw something: a sample whose value is a number (not NaN)."""
    for sample in result:
        value = sample.get("value", [0, "NaN"])[1]
        if value not in ("NaN", "+Inf", "-Inf"):
            return True
    return False


# ------------------------------------------------------------------------------------ Grafana


def _panels(panels: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", ()))


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` / ``[[name]]`` variables replaced (longest
    names first, so ``$__rate_interval`` is not read as ``$__rate``)."""
    for name in sorted(variables, key=len, reverse=True):
        value = variables[name]
        expr = expr.replace(f"${{{name}}}", value).replace(f"[[{name}]]", value).replace(f"${name}", value)
    return expr


def panel_queries(dashboard: Path, variables: Mapping[str, str]) -> list[tuple[str, str]]:
    """Every (panel title, PromQL) of a Grafana dashboard JSON file, variables substituted."""
    doc = json.loads(dashboard.read_text())
    out = []
    for panel in _panels(doc.get("panels", ())):
        for target in panel.get("targets", ()):
            expr = target.get("expr")
            if expr and not target.get("hide"):
                out.append((str(panel.get("title", "")), substitute(expr, variables)))
    return out


def rule_groups(path: Path, shorten_for: str | None = None) -> list[dict[str, Any]]:
    """The ``spec.groups`` of a PrometheusRule file (or ``groups`` of a plain rule file), with every
    ``for:`` replaced by ``shorten_for`` when given."""
    doc = yaml.safe_load(path.read_text())
    groups: list[dict[str, Any]] = doc["spec"]["groups"] if "spec" in doc else doc["groups"]
    if shorten_for is not None:
        for group in groups:
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = shorten_for
    return groups
