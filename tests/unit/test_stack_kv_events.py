"""The local stack's KV-events option: each simulator gets its own PUB and replay ports, and the
EPP learns them from endpoint labels (what ``epp run --kv-events`` and the benchmarks use)."""

from __future__ import annotations

import argparse
import json

from epp.dev.stack import StackOptions
from epp.dev.stack.cli import add_arguments, options_from_args
from epp.framework.endpoint import KV_EVENTS_PORT_LABEL, KV_EVENTS_REPLAY_PORT_LABEL


def _kv_config(argv: list[str]) -> dict[str, object]:
    return dict(json.loads(argv[argv.index("--kv-events-config") + 1]))


def test_each_sim_publishes_on_its_own_ports_and_the_labels_say_which() -> None:
    opts = StackOptions(sims=2, sim_args=["--max-tokens", "4"], kv_events_base_port=6000)
    first, second = opts.sim_argv_extra(0), opts.sim_argv_extra(1)
    assert first[:2] == ["--max-tokens", "4"]
    assert _kv_config(first) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:6001",
    }
    assert _kv_config(second)["endpoint"] == "tcp://*:6002"
    assert opts.endpoint_labels() == {
        "sim-0": {KV_EVENTS_PORT_LABEL: "6000", KV_EVENTS_REPLAY_PORT_LABEL: "6001"},
        "sim-1": {KV_EVENTS_PORT_LABEL: "6002", KV_EVENTS_REPLAY_PORT_LABEL: "6003"},
    }
    assert {6000, 6001, 6002, 6003} <= set(opts.all_ports())  # checked for being free at start


def test_without_kv_events_nothing_is_added() -> None:
    opts = StackOptions(sims=2, sim_args=["--max-tokens", "4"])
    assert opts.sim_argv_extra(1) == ["--max-tokens", "4"] and opts.endpoint_labels() == {}


def test_free_ports_keep_the_kv_events_ports_apart_from_the_sims() -> None:
    opts = StackOptions.on_free_ports(3, kv_events=True)
    kv = [p for i in range(3) for p in opts.kv_events_ports(i)]
    assert len(set(kv) | set(opts.sim_ports)) == 9


def test_epp_run_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args([])).kv_events_base_port == 0
    assert options_from_args(parser.parse_args(["--kv-events"])).kv_events_base_port == 5557
    assert options_from_args(parser.parse_args(["--kv-events", "7000"])).kv_events_base_port == 7000
