"""file-discovery: loading, validation, and reloading real files in tmp_path."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from epp.datalayer.store import EndpointStore
from epp.framework import ConfigError
from epp.framework.params import decode_params
from epp.plugins.discovery.file_discovery import (
    FileDiscovery,
    FileDiscoveryError,
    FileDiscoveryParams,
    parse_endpoints,
)
from tests.unit.polling import until


def _write(path: Path, endpoints: list[Any]) -> None:
    path.write_text(yaml.safe_dump({"endpoints": endpoints}))


def _replace(path: Path, endpoints: list[dict[str, Any]]) -> None:
    """Atomic replacement: write a temporary file next to it, then rename over it."""
    tmp = path.with_name(path.name + ".tmp")
    _write(tmp, endpoints)
    os.replace(tmp, path)


def _ep(name: str, address: str = "10.0.0.1", port: Any = 8000, **extra: Any) -> dict[str, Any]:
    return {"name": name, "address": address, "port": port, **extra}


def _discovery(path: Path, watch: bool = False) -> FileDiscovery:
    raw = {"path": str(path), "watchFile": watch}
    discovery = FileDiscovery("files", decode_params(FileDiscoveryParams, raw, "plugins[0].parameters"))
    discovery.poll_interval = 0.01
    return discovery


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[Path, EndpointStore, FileDiscovery]]:
    path = tmp_path / "endpoints.yaml"
    _write(path, [_ep("a", "10.0.0.1"), _ep("b", "10.0.0.2")])
    store = EndpointStore()
    discovery = _discovery(path, watch=True)
    await discovery.start(store)
    yield path, store, discovery
    await discovery.stop()


# --- initial load --------------------------------------------------------------------------------


async def test_initial_load_builds_endpoint_metadata(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(
        """
endpoints:
- name: vllm-0
  namespace: inference
  address: "10.0.0.1"
  port: "8000"
  labels: {llm-d.ai/role: decode, llm-d.ai/engine-type: vllm, gpus: 8}
- name: vllm-1
  address: 10.0.0.2
  port: 8001
"""
    )
    store = EndpointStore()
    await _discovery(path).start(store)
    assert store.keys() == {"inference/vllm-0", "default/vllm-1"}
    first = store.get("inference/vllm-0")
    assert first is not None
    meta = first.metadata
    assert (meta.name, meta.namespace, meta.address, meta.port) == ("vllm-0", "inference", "10.0.0.1", 8000)
    assert dict(meta.labels) == {"llm-d.ai/role": "decode", "llm-d.ai/engine-type": "vllm", "gpus": "8"}
    assert meta.metrics_hostport == "10.0.0.1:8000"
    second = store.get("default/vllm-1")
    assert second is not None and second.metadata.port == 8001  # integer port accepted (D20)


async def test_json_file_and_empty_files(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"
    path.write_text(json.dumps({"endpoints": [_ep("j", "192.168.1.5", "9000")]}))
    store = EndpointStore()
    await _discovery(path).start(store)
    assert store.keys() == {"default/j"}

    for content in ("", "endpoints: []\n", "{}", "endpoints:\n"):
        path.write_text(content)
        empty = EndpointStore()
        await _discovery(path).start(empty)  # zero endpoints is a valid load
        assert len(empty) == 0


async def test_invalid_entries_are_logged_and_skipped_valid_ones_kept(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    _write(
        path,
        [
            _ep("good-0"),
            _ep("host", address="vllm.example.com"),
            _ep("v6", address="fe80::1"),
            _ep("zeros", address="010.0.0.1"),
            _ep("port0", port=0),
            _ep("port-big", port="70000"),
            _ep("port-text", port="http"),
            _ep("port-bool", port=True),
            _ep("port-missing", port=None),
            {"address": "10.0.0.9", "port": 80},
            _ep("bad-labels", labels=["a"]),
            "not-a-mapping",
            _ep("good-1", address="10.0.0.3", port=" 8080 "),
        ],
    )
    store = EndpointStore()
    with capture_logs() as logs:
        await _discovery(path).start(store)
    assert store.keys() == {"default/good-0", "default/good-1"}
    good = store.get("default/good-1")
    assert good is not None and good.metadata.port == 8080
    reasons = [entry["reason"] for entry in logs if entry["event"] == "skipping invalid endpoint entry"]
    assert len(reasons) == 11
    assert 'endpoint "host": invalid IPv4 address "vllm.example.com"' in reasons
    assert 'endpoint "v6": invalid IPv4 address "fe80::1"' in reasons
    assert 'endpoint "port-big": invalid port "70000"' in reasons
    assert any("endpoints[9]" in r and "name" in r for r in reasons)


def test_duplicates_last_entry_wins() -> None:
    content = yaml.safe_dump(
        {"endpoints": [_ep("a", "10.0.0.1"), _ep("b", "10.0.0.2"), _ep("a", "10.0.0.3", namespace="default")]}
    ).encode()
    result = parse_endpoints(content)
    assert list(result.endpoints) == ["default/b", "default/a"]
    assert result.endpoints["default/a"].address == "10.0.0.3"
    other_ns = parse_endpoints(yaml.safe_dump({"endpoints": [_ep("a"), _ep("a", namespace="x")]}).encode())
    assert set(other_ns.endpoints) == {"default/a", "x/a"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "reading"),
        (b"x" * ((1 << 20) + 1), "exceeds 1 MiB limit"),
        (b"endpoints: [unclosed\n", "unmarshalling"),
        (b'{"endpoints": [}', "unmarshalling"),
        (b"- name: a\n", "the top level must be a mapping"),
        (b"endpoints: {name: a}\n", "'endpoints' must be a list"),
    ],
)
async def test_file_level_errors_fail_the_initial_load(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "endpoints.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(FileDiscoveryError) as info:
        await _discovery(path).start(EndpointStore())
    assert str(info.value).startswith("file-discovery: initial load failed: ")
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_path_parameter_is_required() -> None:
    with pytest.raises(ConfigError) as info:
        decode_params(FileDiscoveryParams, {"watchFile": True}, "plugins[3].parameters")
    assert info.value.field == "plugins[3].parameters.path"
    assert info.value.reason == "file-discovery: 'path' parameter is required"
    with pytest.raises(ConfigError) as direct:
        FileDiscovery("files", FileDiscoveryParams())
    assert direct.value.field == "path"


# --- reloading -----------------------------------------------------------------------------------


async def test_reload_adds_updates_and_removes(watched: tuple[Path, EndpointStore, FileDiscovery]) -> None:
    path, store, _ = watched
    kept = store.get("default/a")
    _write(path, [_ep("a", "10.0.0.1", labels={"llm-d.ai/role": "prefill"}), _ep("c", "10.0.0.4")])
    await until(lambda: store.keys() == {"default/a", "default/c"})
    updated = store.get("default/a")
    assert updated is kept  # same address: updated in place, metrics and counters kept
    assert updated is not None and dict(updated.metadata.labels) == {"llm-d.ai/role": "prefill"}


async def test_atomic_rename_is_picked_up(watched: tuple[Path, EndpointStore, FileDiscovery]) -> None:
    path, store, _ = watched
    _replace(path, [_ep("z", "10.0.0.9")])
    await until(lambda: store.keys() == {"default/z"})
    _replace(path, [_ep("z", "10.0.0.9"), _ep("y", "10.0.0.8")])
    await until(lambda: store.keys() == {"default/z", "default/y"})


async def test_configmap_symlink_swap_is_picked_up(tmp_path: Path) -> None:
    # Kubernetes ConfigMap volume layout: endpoints.yaml -> ..data/endpoints.yaml, ..data -> ..<ts>
    first = tmp_path / "..2026_01_01"
    first.mkdir()
    _write(first / "endpoints.yaml", [_ep("a")])
    (tmp_path / "..data").symlink_to(first.name)
    path = tmp_path / "endpoints.yaml"
    path.symlink_to("..data/endpoints.yaml")
    store = EndpointStore()
    discovery = _discovery(path, watch=True)
    await discovery.start(store)
    try:
        assert store.keys() == {"default/a"}
        second = tmp_path / "..2026_01_02"
        second.mkdir()
        _write(second / "endpoints.yaml", [_ep("b", "10.0.0.2")])
        (tmp_path / "..data_tmp").symlink_to(second.name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        await until(lambda: store.keys() == {"default/b"})
    finally:
        await discovery.stop()


async def test_file_level_error_on_reload_keeps_endpoints(
    watched: tuple[Path, EndpointStore, FileDiscovery],
) -> None:
    path, store, discovery = watched
    with capture_logs() as logs:
        path.write_text("endpoints: [broken\n")
        await until(lambda: any("reloading endpoints file failed" in e["event"] for e in logs))
        assert store.keys() == {"default/a", "default/b"}
        assert discovery.loaded_keys == {"default/a", "default/b"}

        path.unlink()  # deleted: also a file-level error, endpoints stay
        await until(lambda: sum("reloading endpoints file failed" in e["event"] for e in logs) >= 2)
        assert store.keys() == {"default/a", "default/b"}

    _write(path, [_ep("b", "10.0.0.2"), _ep("c", "10.0.0.3")])  # recreated: the watch survives
    await until(lambda: store.keys() == {"default/b", "default/c"})


async def test_entry_invalid_on_reload_is_removed_others_kept(
    watched: tuple[Path, EndpointStore, FileDiscovery],
) -> None:
    path, store, _ = watched
    _write(path, [_ep("a", "10.0.0.1"), _ep("b", "not-an-ip")])
    await until(lambda: store.keys() == {"default/a"})


async def test_same_size_rewrite_within_one_timestamp_tick_is_seen(
    watched: tuple[Path, EndpointStore, FileDiscovery],
) -> None:
    path, store, _ = watched
    before = os.stat(path)
    _write(path, [_ep("a", "10.0.0.1"), _ep("c", "10.0.0.2")])  # same size as "b" with the same address
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # a coarse clock gave the same mtime
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    await until(lambda: store.keys() == {"default/a", "default/c"})


async def test_without_watch_or_after_stop_changes_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    _write(path, [_ep("a")])
    static_store, watched_store = EndpointStore(), EndpointStore()
    static = _discovery(path, watch=False)
    watcher = _discovery(path, watch=True)
    await static.start(static_store)
    await watcher.start(watched_store)
    await watcher.stop()
    _replace(path, [_ep("b", "10.0.0.2")])
    probe_store = EndpointStore()
    probe = _discovery(path, watch=True)
    await probe.start(probe_store)  # a live watcher sees the new file at once...
    try:
        _replace(path, [_ep("c", "10.0.0.3")])
        await until(lambda: probe_store.keys() == {"default/c"})  # ...and reloads it
        assert static_store.keys() == {"default/a"}  # ...while the others never did
        assert watched_store.keys() == {"default/a"}
    finally:
        await probe.stop()


# --- rejected files: all entries invalid -------------------------------------------------------


def _sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return value if value is not None else 0.0


def _failures(reason: str) -> float:
    return _sample("llm_d_epp_discovery_file_load_failures_total", reason=reason)


async def test_all_invalid_entries_fail_the_initial_load(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    _write(path, [_ep("a", address="10.0.0.300"), _ep("b", port="http")])
    before = _failures("no_valid_entries")
    with capture_logs() as logs, pytest.raises(FileDiscoveryError) as info:
        await _discovery(path).start(EndpointStore())
    assert str(info.value).startswith("file-discovery: initial load failed: ")
    assert "none of its 2 endpoint entries is valid" in str(info.value)
    assert info.value.reason == "no_valid_entries"
    assert _failures("no_valid_entries") == before + 1
    reasons = [e["reason"] for e in logs if e["event"] == "skipping invalid endpoint entry"]
    assert reasons == ['endpoint "a": invalid IPv4 address "10.0.0.300"', 'endpoint "b": invalid port "http"']


async def test_all_invalid_reload_keeps_the_last_good_set_and_reports_it(
    watched: tuple[Path, EndpointStore, FileDiscovery],
) -> None:
    path, store, discovery = watched
    problems: list[str] = []
    discovery.on_problem = problems.append
    before = _failures("no_valid_entries")
    with capture_logs() as logs:
        _replace(path, [_ep("a", address="not-an-ip"), _ep("c", port=0), "junk"])
        await until(lambda: _sample("llm_d_epp_discovery_file_rejected") == 1)
        await asyncio.sleep(0.1)  # several more polls of the same (recently written) content
    assert store.keys() == {"default/a", "default/b"}
    assert discovery.loaded_keys == {"default/a", "default/b"}
    assert _failures("no_valid_entries") == before + 1  # once per content, not per poll
    assert _sample("llm_d_epp_discovery_file_invalid_entries") == 3
    entries = [e["reason"] for e in logs if e["event"] == "skipping invalid endpoint entry"]
    assert len(entries) == 3 and 'endpoint "a": invalid IPv4 address "not-an-ip"' in entries
    (rejected,) = [e for e in logs if e["event"].startswith("reloading endpoints file failed")]
    assert rejected["reason"] == "no_valid_entries" and rejected["endpoints"] == 2
    assert problems == [problems[0]] and problems[0].startswith("endpoints file rejected (")
    assert "serving the last good set of 2 endpoints" in problems[0]

    _replace(path, [_ep("a", "10.0.0.1"), _ep("b", "10.0.0.2")])  # back to the content in use
    await until(lambda: _sample("llm_d_epp_discovery_file_rejected") == 0)
    assert problems[-1] == ""

    _replace(path, [_ep("c", "10.0.0.3"), _ep("d", "bad")])  # partly invalid: applied, reported
    await until(lambda: store.keys() == {"default/c"})
    assert problems[-1] == f"1 invalid endpoint entry skipped in {path}"
    assert _sample("llm_d_epp_discovery_file_invalid_entries") == 1


async def test_syntax_error_and_all_invalid_are_treated_the_same(
    watched: tuple[Path, EndpointStore, FileDiscovery],
) -> None:
    path, store, discovery = watched
    problems: list[str] = []
    discovery.on_problem = problems.append
    before = _failures("parse_error")
    path.write_text("endpoints: [broken\n")
    await until(lambda: bool(problems))
    assert store.keys() == {"default/a", "default/b"}
    assert _failures("parse_error") == before + 1
    assert _sample("llm_d_epp_discovery_file_rejected") == 1
    assert problems[0].startswith("endpoints file rejected (unmarshalling")


async def test_explicit_empty_list_still_empties_the_pool(
    watched: tuple[Path, EndpointStore, FileDiscovery],
) -> None:
    path, store, discovery = watched
    problems: list[str] = []
    discovery.on_problem = problems.append
    _replace(path, [])
    await until(lambda: len(store) == 0)
    assert _sample("llm_d_epp_discovery_file_rejected") == 0
    assert problems == [""]
