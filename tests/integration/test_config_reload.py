"""``--watch-config-file`` through real Envoy, the real EPP and simulators: the config file is edited
while requests flow; a valid edit changes routing without a restart, an invalid or refused one keeps
the running config and sets the reload metrics, and no request fails meanwhile."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import Envoy, Epp, Rig, chat_body, marker

pytestmark = pytest.mark.integration

CONFIG: dict[str, Any] = yaml.safe_load(
    """
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- {name: group, type: label-selector-filter, parameters: {matchLabels: {group: a}}}
- {type: queue-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: group}, {pluginRef: queue-scorer, weight: 1}, {pluginRef: max-score-picker}]
"""
)


def _write(path: Path, document: dict[str, Any]) -> None:
    """Replace the file atomically, as a ConfigMap update does (a new file renamed over it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(document, sort_keys=False))
    os.replace(tmp, path)


def _metric(epp: Epp, series: str) -> float:
    for line in epp.metrics().splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _log_reasons(epp: Epp) -> list[str]:
    """The reasons of the EPP's "not applied" log lines, oldest first."""
    lines = epp.child.log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if "configuration change not applied" in line]


def _wait(what: str, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _Traffic:
    """Requests in a loop from two threads until stopped; every status and serving port kept."""

    def __init__(self, envoy: Envoy) -> None:
        self.envoy = envoy
        self.results: list[tuple[int, int | None]] = []
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(2)
        self._runs = [self._pool.submit(self._loop) for _ in range(2)]

    def _loop(self) -> None:
        while not self._stop.is_set() and len(self.results) < 5000:
            resp = self.envoy.post("/v1/chat/completions", chat_body(marker()))
            self.results.append((resp.status, resp.port))

    def last_ports(self, n: int) -> set[int | None]:
        count = len(self.results)
        _wait(f"{n} more requests", lambda: len(self.results) >= count + n)
        return {port for _, port in self.results[-n:]}

    def stop(self) -> list[tuple[int, int | None]]:
        self._stop.set()
        for run in self._runs:
            run.result(timeout=30)
        self._pool.shutdown()
        return self.results


def test_config_file_edits_apply_live_and_bad_ones_keep_the_running_config(rig: Rig) -> None:
    sims = rig.start_sims(2)
    labels = {sims[0].name: {"group": "a"}, sims[1].name: {"group": "b"}}
    path = rig.log_dir / "epp-config.yaml"
    epp = rig.start_epp(sims, config=CONFIG, labels=labels, extra=["--watch-config-file"], config_file=path)
    envoy = rig.start_envoy(epp)
    running = yaml.safe_load(path.read_text())
    traffic = _Traffic(envoy)
    try:
        assert traffic.last_ports(10) == {sims[0].port}

        # A plugin parameter and a weight change: applied while requests flow.
        edited = yaml.safe_load(yaml.safe_dump(running))
        edited["plugins"][1]["parameters"]["matchLabels"] = {"group": "b"}  # [0] is file-discovery
        edited["schedulingProfiles"][0]["plugins"][1]["weight"] = 2
        _write(path, edited)
        _wait(
            "the edit applied", lambda: _metric(epp, 'llm_d_epp_config_reloads_total{result="applied"}') == 1
        )
        assert traffic.last_ports(10) == {sims[1].port}
        assert _metric(epp, "llm_d_epp_config_reload_last_success") == 1

        # An invalid edit: logged, counted, the running config stays.
        broken = yaml.safe_load(yaml.safe_dump(edited))
        broken["schedulingProfiles"][0]["plugins"][1]["weigth"] = 3
        _write(path, broken)
        _wait(
            "the invalid edit seen",
            lambda: _metric(epp, 'llm_d_epp_config_reloads_total{result="invalid"}') == 1,
        )
        assert _metric(epp, "llm_d_epp_config_reload_last_success") == 0
        _wait("the invalid edit logged", lambda: len(_log_reasons(epp)) == 1)
        assert "weigth" in _log_reasons(epp)[0]  # the log says why: the misspelt field
        assert traffic.last_ports(10) == {sims[1].port}

        # A valid edit of what cannot change live (the data layer): refused, the running config stays.
        refused = yaml.safe_load(yaml.safe_dump(edited))
        refused["dataLayer"]["injectDefaults"] = False
        _write(path, refused)
        _wait(
            "the refused edit seen",
            lambda: _metric(epp, 'llm_d_epp_config_reloads_total{result="refused"}') == 1,
        )
        _wait("the refused edit logged", lambda: len(_log_reasons(epp)) == 2)
        assert "dataLayer cannot change" in _log_reasons(epp)[1]  # names what cannot change live
        assert traffic.last_ports(10) == {sims[1].port}

        # Back to group a: applied again.
        _write(path, running)
        _wait(
            "the second edit applied",
            lambda: _metric(epp, 'llm_d_epp_config_reloads_total{result="applied"}') == 2,
        )
        assert _metric(epp, "llm_d_epp_config_reload_last_success") == 1
        assert traffic.last_ports(10) == {sims[0].port}
    finally:
        results = traffic.stop()
    assert len(results) >= 50
    assert {status for status, _ in results} == {200}, [r for r in results if r[0] != 200][:5]
    assert epp.child.proc is not None and epp.child.proc.poll() is None  # never restarted
