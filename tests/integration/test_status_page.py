"""The status page in headless Chromium (Debian's ``chromium``) against a running stack (Envoy, the
EPP, simulators): the endpoint table Chromium renders is the EPP's own state (``/status.json``), the
read-only headers are set, and a screenshot is saved. ``epp status`` prints the same table."""

from __future__ import annotations

import html.parser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from epp.cli import main
from epp.observe import ENDPOINT_COLUMNS
from tests.integration.harness import Rig, chat_body, marker, request

pytestmark = pytest.mark.integration

DEBIAN_PACKAGE = "chromium"


def chromium_binary() -> str:
    """Chromium's path; installed with apt-get when missing and root, else a skip saying why."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(
            ["apt-get", "install", "-y", "-qq", DEBIAN_PACKAGE], env=env, capture_output=True, timeout=900
        )
        found = shutil.which("chromium")
        if found:
            return found
        pytest.skip(f"apt-get install {DEBIAN_PACKAGE} failed: {done.stderr.decode()[-300:]}")
    pytest.skip(
        f"no chromium and cannot install it (needs root and apt-get: apt-get install {DEBIAN_PACKAGE})"
    )


def _headless(binary: str, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(home)},  # its profile and crash dumps stay in the test's tmp dir
    )


class _Table(html.parser.HTMLParser):
    """The cells of the table with id ``endpoints``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_table = self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("id", "endpoints") in attrs:
            self._in_table = True
        elif self._in_table and tag == "tr":
            self.rows.append([])
        elif self._in_table and tag in ("td", "th"):
            self._in_cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_table and self._in_cell:
            self.rows[-1][-1] += data


def test_status_page_in_chromium_shows_the_epps_state(
    rig: Rig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = chromium_binary()
    sims = rig.start_sims(3)
    epp = rig.start_epp(sims)
    envoy = rig.start_envoy(epp)
    for _ in range(6):
        assert envoy.post("/v1/chat/completions", chat_body(marker())).status == 200
    base = f"http://127.0.0.1:{epp.metrics_port}"

    resp = request(f"{base}/status")
    assert resp.status == 200
    assert "default-src 'none'" in resp.headers["content-security-policy"]
    assert resp.headers["x-frame-options"] == "DENY" and resp.headers["cache-control"] == "no-store"
    assert resp.headers["x-content-type-options"] == "nosniff"

    dom = _headless(binary, "--dump-dom", f"{base}/status", home=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    table = _Table()
    table.feed(dom.stdout)
    head, *rows = table.rows
    assert head == [h for h, _ in ENDPOINT_COLUMNS]
    state = request(f"{base}/status.json").json()
    endpoints = {e["address"]: e for e in state["pools"][0]["endpoints"]}
    assert {s.address for s in sims} == set(endpoints)
    shown = {r[1]: dict(zip((k for _, k in ENDPOINT_COLUMNS), r, strict=True)) for r in rows}
    assert set(shown) == set(endpoints)
    for address, e in endpoints.items():
        row = shown[address]
        assert row["name"] == e["name"] and row["state"] == e["state"] == "ready"
        assert row["requests_1m"] == str(e["requests_1m"])
    assert sum(e["requests_1m"] for e in endpoints.values()) >= 6  # each request counted where it went
    assert len(state["decisions"]) == 6 and "hello there" not in dom.stdout  # no prompt text

    shot = tmp_path / "status.png"
    done = _headless(
        binary, f"--screenshot={shot}", "--window-size=1100,520", f"{base}/status", home=tmp_path
    )
    assert done.returncode == 0 and shot.stat().st_size > 1000, done.stderr[-2000:]
    print(f"screenshot: {shot}")

    capsys.readouterr()
    assert main(["status", base]) == 0
    out = capsys.readouterr().out
    assert all(s.address in out for s in sims) and "serving: yes" in out
