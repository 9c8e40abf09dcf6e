"""Pool selection (``PoolRegistry``), the pool notifier and the config-time overlap errors."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.store import EndpointStore
from epp.framework.endpoint import EndpointMetadata
from epp.framework.errors import ErrorCode, InferenceError
from epp.framework.wire import POOL_LABEL, SUBSET_KEY, SUBSET_NAMESPACE
from epp.plugins.discovery.file_discovery import parse_endpoints
from epp.server.pools import Pool, PoolNotifier, PoolRegistry, check_overlaps, route_pool

NONE: Any = None


def _pool(name: str, config: str | None = None) -> Pool:
    return Pool(name, NONE, EndpointStore(), director=NONE, flow_control=None, data_layer=NONE, gauges=NONE)


def _md(name: str, port: int, pool: str = "", address: str = "10.0.0.1") -> EndpointMetadata:
    labels = {POOL_LABEL: pool} if pool else {}
    return EndpointMetadata(name=name, address=address, port=port, labels=labels)


def _registry(*names: str) -> PoolRegistry:
    registry = PoolRegistry(_pool(names[0]), _pool, multi=len(names) > 1)
    for name in names[1:]:
        registry.get_or_add(name)
    return registry


def _hint(*entries: str) -> dict[str, dict[str, Any]]:
    return {SUBSET_NAMESPACE: {SUBSET_KEY: ",".join(entries)}}


def test_one_pool_serves_every_request() -> None:
    registry = _registry("only")
    assert not registry.multi
    assert registry.select("", {}) is registry.primary


def test_the_route_names_the_pool() -> None:
    registry = _registry("a", "b", "c")
    assert registry.multi
    assert registry.select("b", {}).name == "b"
    # the route wins over a hint for another pool's endpoints
    registry.pools["c"].store.upsert(_md("c-0", 8000))
    assert registry.select("b", _hint("10.0.0.1:8000")).name == "b"


def test_unknown_pool_is_a_404_naming_it() -> None:
    registry = _registry("a", "b")
    with pytest.raises(InferenceError) as e:
        registry.select("zzz", {})
    assert e.value.code is ErrorCode.NOT_FOUND
    assert "zzz" in e.value.message and "x-epp-pool" in e.value.message


def test_the_subset_hint_picks_the_pool_holding_its_endpoints() -> None:
    registry = _registry("a", "b")
    registry.pools["a"].store.upsert(_md("a-0", 8000))
    registry.pools["b"].store.upsert(_md("b-0", 8001))
    assert registry.select("", _hint("10.0.0.1:8001")).name == "b"
    assert registry.select("", _hint("10.0.0.1:8000")).name == "a"
    with pytest.raises(InferenceError) as e:
        registry.select("", _hint("10.0.0.1:8000", "10.0.0.1:8001"))
    assert e.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(InferenceError) as e:
        registry.select("", _hint("10.9.9.9:1"))
    assert e.value.code is ErrorCode.NOT_FOUND and "10.9.9.9:1" in e.value.message
    registry.pools["b"].store.delete("default/b-0")
    with pytest.raises(InferenceError):
        registry.select("", _hint("10.0.0.1:8001"))


def test_no_route_and_no_hint_with_several_pools_is_a_404() -> None:
    with pytest.raises(InferenceError) as e:
        _registry("a", "b").select("", {})
    assert e.value.code is ErrorCode.NOT_FOUND


def test_route_pool_reads_the_stream_metadata() -> None:
    assert route_pool([("user-agent", "envoy"), ("x-epp-pool", "a")]) == "a"
    assert route_pool([("x-epp-pool", b"b")]) == "b"
    assert route_pool([]) == ""


def test_notifier_creates_pools_and_removes_empty_ones() -> None:
    registry = _registry("epp")
    notifier = PoolNotifier(registry)
    notifier.upsert(_md("x-0", 8000, "x"))
    notifier.upsert(_md("y-0", 8001, "y"))
    assert set(registry.pools) == {"epp", "x", "y"} and registry.multi
    assert registry.pools["x"].store.keys() == {"default/x-0"}
    notifier.delete("default/y-0")
    assert set(registry.pools) == {"epp", "x"}
    # an endpoint without a pool is the first pool's
    notifier.upsert(_md("plain", 8002))
    assert registry.primary.store.keys() == {"default/plain"}


def test_notifier_refuses_an_endpoint_already_in_another_pool() -> None:
    problems: list[str] = []
    registry = _registry("epp")
    notifier = PoolNotifier(registry, problems.append)
    notifier.upsert(_md("x-0", 8000, "x"))
    notifier.upsert(_md("y-0", 8000, "y"))  # same address and port
    assert "y" not in registry.pools or not len(registry.pools["y"].store)
    assert problems and "already in pool 'x'" in problems[0]


def test_without_a_builder_only_the_first_pool_exists() -> None:
    registry = PoolRegistry(_pool("epp"))
    PoolNotifier(registry).upsert(_md("x-0", 8000, "x"))
    assert set(registry.pools) == {"epp"} and not registry.multi


def test_grouped_file_labels_each_endpoint_with_its_pool() -> None:
    text = b"""
pools:
- name: a
  endpoints:
  - {name: a-0, address: 10.0.0.1, port: 8000}
- name: b
  endpoints:
  - {name: b-0, address: 10.0.0.2, port: 8000}
endpoints:
- {name: old, address: 10.0.0.3, port: 8000}
- {name: tagged, address: 10.0.0.4, port: 8000, pool: b}
"""
    result = parse_endpoints(text)
    pools = {k: md.labels.get(POOL_LABEL, "") for k, md in result.endpoints.items()}
    assert pools == {"default/a-0": "a", "default/b-0": "b", "default/old": "", "default/tagged": "b"}
    assert result.invalid == ()


def test_an_endpoint_in_two_pools_is_an_error() -> None:
    text = b"""
pools:
- name: a
  endpoints: [{name: a-0, address: 10.0.0.1, port: 8000}]
- name: b
  endpoints: [{name: b-0, address: 10.0.0.1, port: 8000}, {name: a-0, address: 10.0.0.2, port: 1}]
"""
    result = parse_endpoints(text)
    assert list(result.endpoints) == ["default/a-0"]
    assert len(result.invalid) == 2
    assert all("'a' and 'b'" in reason for reason in result.invalid)
    assert check_overlaps([("a", [_md("p", 1)]), ("b", [_md("q", 1)])]) == [
        "endpoint 10.0.0.1:1 (default/q) is in pools 'a' and 'b'"
    ]


def test_a_pools_entry_of_the_wrong_shape_is_rejected() -> None:
    from epp.plugins.discovery.file_discovery import FileDiscoveryError

    with pytest.raises(FileDiscoveryError):
        parse_endpoints(b"pools: [{name: a}]")
    with pytest.raises(FileDiscoveryError):
        parse_endpoints(b"pools: {a: []}")


def test_envoy_config_names_each_pool_on_its_routes() -> None:
    from epp.dev.envoy.bootstrap import EXT_PROC_FILTER, envoy_bootstrap

    bootstrap = envoy_bootstrap(pools=["a", "b"])
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hosts = hcm["route_config"]["virtual_hosts"]
    assert [h["domains"] for h in hosts] == [["a", "a:*"], ["b", "b:*"], ["*"]]
    for host, pool in zip(hosts[:2], ("a", "b"), strict=True):
        for route in host["routes"]:
            override = route["typed_per_filter_config"][EXT_PROC_FILTER]["overrides"]
            assert override["grpc_initial_metadata"] == [{"key": "x-epp-pool", "value": pool}]
    assert all(EXT_PROC_FILTER not in r.get("typed_per_filter_config", {}) for r in hosts[2]["routes"])


def test_epp_run_pools_split_the_sims_round_robin() -> None:
    from epp.dev.stack.local import StackOptions

    opts = StackOptions(sims=5, pools=2)
    labels = opts.endpoint_labels()
    assert [labels[f"sim-{i}"][POOL_LABEL] for i in range(5)] == ["pool-1", "pool-2"] * 2 + ["pool-1"]
    assert StackOptions(sims=3).endpoint_labels() == {} and StackOptions(sims=3).pool_names == []
    with pytest.raises(ValueError, match="pools"):
        StackOptions(sims=1, pools=2).check()


_RELOAD = """
plugins:
- {name: group, type: label-selector-filter, parameters: {matchLabels: {group: GROUP}}}
- {type: queue-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: group}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""


def test_a_config_reload_reaches_every_pool_on_the_shared_config() -> None:
    from epp.server.app import EppServer, ServeOptions
    from epp.server.config_reload import plan_reload
    from tests.unit.factories import config

    before, after = _RELOAD.replace("GROUP", "a"), _RELOAD.replace("GROUP", "b")

    def load(store: EndpointStore, text: str | None = None) -> Any:
        return config(before if text is None else text)

    server = EppServer(config(before), ServeOptions(pool_name="a"), pool_config=load)
    b = server.pools.get_or_add("b")
    own = server.pools.get_or_add("c", before)
    assert own.own_config and not b.own_config
    old_b, old_c = b.director.scheduler, own.director.scheduler
    candidate = config(after)
    server.apply_reload(candidate, plan_reload(server.cfg, candidate), after)
    for pool in (server.pools.primary, b):
        assert pool.cfg.document == candidate.document
        group: Any = pool.cfg.plugins["group"]
        assert group.params.match_labels == {"group": "b"}
    assert b.director.scheduler is not old_b
    assert own.director.scheduler is old_c  # a pool with its own config keeps it
    assert server.pools.get_or_add("d").cfg.document == candidate.document  # later pools: the new text


def test_every_pools_models_keep_their_metric_label() -> None:
    """The model-name label bound learns the models of every pool, not only the first's: a request
    to the second pool's model is not recorded as ``other``."""
    import dataclasses

    from epp.datalayer.served_models import ServedModels
    from epp.labels import OVERFLOW, BoundedLabel

    registry = _registry("a", "b")
    for pool, model in (("a", "model-a"), ("b", "model-b")):
        store = registry.pools[pool].store
        store.upsert(_md(f"{pool}-0", 8000, address=f"10.0.0.{len(pool) + ord(pool[0])}"))
        (endpoint,) = store.endpoints()
        endpoint.metrics = dataclasses.replace(endpoint.metrics, served_models=(model,))
    bound = BoundedLabel("model_name")
    ServedModels(registry, bound=bound).refresh()
    assert bound.bound("model-b") == "model-b" and bound.bound("model-a") == "model-a"
    assert bound.bound("unknown") == OVERFLOW
