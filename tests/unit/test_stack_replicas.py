"""``epp run --replicas``: the syncer merged into each replica's config, the replicas' ports, Envoy's
ext_proc cluster spread over their sockets with health checks, and the error without redis-server."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from epp.config import load_config
from epp.dev.envoy.bootstrap import EXT_PROC_CLUSTER, EXTPROC_HEALTH_SERVICE
from epp.dev.stack import EppPorts, LocalStack, StackOptions, epp_config, with_redis_syncer
from epp.dev.stack import local as local_module
from epp.dev.stack.cli import add_arguments, options_from_args
from epp.dev.stack.replicas import EXT_PROC_RETRY_ON, ext_proc_services

ADDRESS = "127.0.0.1:6399"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _loaded(doc: dict[str, object], tmp_path: Path) -> object:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints: []\n")
    return load_config(yaml.safe_dump(epp_config(endpoints, doc)), source="test")  # type: ignore[arg-type]


def test_default_config_gets_the_syncer_in_the_v1_layout(tmp_path: Path) -> None:
    doc = with_redis_syncer(None, ADDRESS)
    assert doc["apiVersion"] == "llm-d.ai/v1"
    (syncer,) = doc["plugins"]
    assert syncer == {"name": "epp-run-redis", "type": "redis-syncer", "parameters": {"address": ADDRESS}}
    assert doc["dataLayer"] == {
        "crossReplica": {"syncerPluginRef": "epp-run-redis", "syncInterval": "100ms"},
        "discovery": {"peers": {"pluginRef": "epp-run-redis"}},
    }
    cfg = _loaded(doc, tmp_path)
    assert cfg.warnings == []  # type: ignore[attr-defined]
    assert cfg.cross_replica.syncer.params.address == ADDRESS  # type: ignore[attr-defined]
    assert cfg.cross_replica.interval == pytest.approx(0.1)  # type: ignore[attr-defined]
    plugins = cfg.plugins  # type: ignore[attr-defined]
    assert {"prefix-spread-scorer", "approx-prefix-cache-producer", "max-score-picker"} <= set(
        plugins
    )  # the defaults


def test_users_config_keeps_its_scheduling_and_its_syncer_settings(tmp_path: Path) -> None:
    user = yaml.safe_load(
        """
        apiVersion: llm-d.ai/v1
        kind: EndpointPickerConfig
        plugins:
        - {type: queue-scorer}
        - {type: max-score-picker}
        - name: mine
          type: redis-state-store
          parameters: {address: "redis.example:6379", passwordEnv: PW, stateTTL: 3s, keyPrefix: k}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
        dataLayer:
          crossReplica: {syncInterval: 250ms}
        """
    )
    doc = with_redis_syncer(user, ADDRESS)
    assert [p["type"] for p in doc["plugins"]] == ["queue-scorer", "max-score-picker", "redis-state-store"]
    assert doc["plugins"][2]["parameters"] == {"address": ADDRESS, "stateTTL": "3s", "keyPrefix": "k"}
    assert doc["dataLayer"]["crossReplica"] == {"syncInterval": "250ms", "syncerPluginRef": "mine"}
    assert doc["schedulingProfiles"] == user["schedulingProfiles"]
    assert user["plugins"][2]["parameters"]["address"] == "redis.example:6379", "input modified"
    assert "crossReplica" in user["dataLayer"] and "syncerPluginRef" not in user["dataLayer"]["crossReplica"]
    cfg = _loaded(doc, tmp_path)
    (warning,) = cfg.warnings  # type: ignore[attr-defined]
    assert "'redis-state-store' is deprecated" in warning  # the user's alias, kept
    params = cfg.cross_replica.syncer.params  # type: ignore[attr-defined]
    assert (params.address, params.password_env, params.key_prefix) == (ADDRESS, "", "k")
    assert cfg.cross_replica.interval == pytest.approx(0.25)  # type: ignore[attr-defined]


def test_v1alpha1_config_gets_its_own_layout(tmp_path: Path) -> None:
    user = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}]}
        ],
    }
    doc = with_redis_syncer(user, ADDRESS)
    assert doc["dataLayer"] == {
        "crossReplicaSyncerPluginRef": "epp-run-redis",
        "crossReplicaSyncInterval": "100ms",
        "peerDiscovery": {"pluginRef": "epp-run-redis"},
    }
    cfg = _loaded(doc, tmp_path)
    assert cfg.cross_replica.syncer.params.address == ADDRESS  # type: ignore[attr-defined]


def test_replica_ports_step_by_100_and_collisions_are_refused() -> None:
    opts = StackOptions(replicas=3, grpc_port=9002, health_port=9003, metrics_port=9090, redis_port=6390)
    assert opts.epps() == [EppPorts(9002, 9003, 9090), EppPorts(9102, 9103, 9190), EppPorts(9202, 9203, 9290)]
    assert {9102, 9203, 9290, 6390} <= set(opts.all_ports())
    opts.check()
    with pytest.raises(ValueError, match="ports used twice: 9102"):
        StackOptions(replicas=2, grpc_port=9002, health_port=9003, metrics_port=9102).check()
    with pytest.raises(ValueError, match="replicas: must be at least 1"):
        StackOptions(replicas=0).check()
    free = StackOptions.on_free_ports(2, replicas=3)
    ports = free.epps()
    assert len(ports) == 3 and free.redis_port and len(set(free.all_ports())) == len(free.all_ports())
    assert (free.grpc_port, free.health_port, free.metrics_port) == (
        ports[0].grpc,
        ports[0].health,
        ports[0].metrics,
    )


def test_cli_flags(tmp_path: Path) -> None:
    opts = options_from_args(_parse(["--replicas", "3", "--redis-port", "7000"]))
    assert (opts.replicas, opts.redis_port) == (3, 7000)
    assert options_from_args(_parse([])).replicas == 1
    with pytest.raises(SystemExit):
        _parse(["--replicas", "0"])


def test_envoy_spreads_ext_proc_over_every_replica_socket_with_health_checks(tmp_path: Path) -> None:
    opts = StackOptions(sims=2, replicas=2, grpc_port=9002, health_port=9003, metrics_port=9090)
    stack = LocalStack(opts, tmp_path)
    clusters = stack.bootstrap()["static_resources"]["clusters"]
    (cluster,) = [c for c in clusters if c["name"] == EXT_PROC_CLUSTER]
    hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["address"]["pipe"]["path"] for h in hosts] == [
        f"{tmp_path}/epp-9002.sock",
        f"{tmp_path}/epp-9102.sock",
    ]
    checked = [h["endpoint"]["health_check_config"]["address"]["socket_address"] for h in hosts]
    assert checked == [{"address": "127.0.0.1", "port_value": p} for p in (9003, 9103)]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": EXTPROC_HEALTH_SERVICE}
    assert cluster["common_lb_config"] == {
        "healthy_panic_threshold": {"value": 0},
        "update_merge_window": "0s",
    }
    services = ext_proc_services(stack.bootstrap())
    assert services and all(s["retry_policy"]["retry_on"] == EXT_PROC_RETRY_ON for s in services)
    assert all(
        s["retry_policy"]["retry_host_predicate"][0]["name"].endswith("previous_hosts") for s in services
    )
    single = LocalStack(StackOptions(sims=2), tmp_path).bootstrap()["static_resources"]["clusters"][0]
    assert "health_checks" not in single  # one fail-closed EPP: as before


def test_replicas_without_redis_server_name_the_debian_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "redis_server_binary", lambda: None)
    stack = LocalStack(StackOptions.on_free_ports(1, replicas=2), tmp_path)
    with pytest.raises(
        FileNotFoundError, match=r"Debian package redis-server \(apt-get install redis-server\)"
    ):
        stack.start()
    assert stack.children == []  # nothing was started


def test_banner_lists_every_replica_and_redis(tmp_path: Path) -> None:
    from epp.dev.stack.cli import _usage
    from epp.dev.stack.supervisor import Child

    opts = StackOptions(sims=2, replicas=2, grpc_port=9002, health_port=9003, metrics_port=9090)
    st = LocalStack(opts, tmp_path)
    st.epps = [Child(f"epp-{i}", [], tmp_path / f"epp-{i}.log") for i in range(2)]
    st.redis_port = 6399
    text = _usage(st)
    assert "2 replicas, all serving" in text
    for e in st.opts.epps():
        assert e.socket == f"{tmp_path}/epp-{e.grpc}.sock"
        assert f"ext_proc unix:{e.socket} and 127.0.0.1:{e.grpc}, health 127.0.0.1:{e.health}" in text
        assert f"http://127.0.0.1:{e.metrics}/metrics" in text
    assert "Redis      127.0.0.1:6399" in text
    assert "EPP replica or Redis that exits is restarted" in text
    unshared = LocalStack(StackOptions(sims=2, replicas=2, share_state=False), tmp_path)
    unshared.epps = st.epps
    assert "Redis" not in _usage(unshared).split("simulators")[0]
