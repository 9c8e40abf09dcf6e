"""InferenceObjective / InferenceModelRewrite for several pools: ``poolRef``, ``poolRefs[]``,
``poolSelector``, and the per-pool stores fed by one watch (``epp.k8s.pool_policies``)."""

from __future__ import annotations

from typing import Any

from epp.datalayer.objectives import ObjectiveStore, pool_ref_matches, selector_matches
from epp.k8s.pool_policies import PoolPolicies
from epp.k8s.pool_set import CONFIG_KEY, config_source
from tests.fakekube import objects

GROUP = objects.POOL_GROUP


def _objective(name: str, priority: int, namespace: str = "ns", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": objects.POLICY_API,
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"priority": priority, **spec},
    }


def _pool(name: str, namespace: str = "ns", **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels}}


class _Director:
    objectives: Any = None
    rewrites: Any = None


def test_pool_refs_name_several_pools() -> None:
    spec = {"poolRefs": [{"name": "a"}, {"name": "b", "group": GROUP}]}
    assert pool_ref_matches(spec, "a", GROUP, "InferenceObjective", "o")
    assert pool_ref_matches(spec, "b", GROUP, "InferenceObjective", "o")
    assert not pool_ref_matches(spec, "c", GROUP, "InferenceObjective", "o")
    # poolRef and poolRefs are unioned
    assert pool_ref_matches({"poolRef": {"name": "c"}, **spec}, "c", GROUP, "InferenceObjective", "o")
    # another group names another pool
    assert not pool_ref_matches({"poolRefs": [{"name": "a", "group": "x.io"}]}, "a", GROUP, "K", "o")
    # malformed: not a list, an entry without a name
    assert pool_ref_matches({"poolRefs": {"name": "a"}}, "a", GROUP, "K", "o") is None
    assert pool_ref_matches({"poolRefs": [{"group": GROUP}]}, "a", GROUP, "K", "o") is None


def test_pool_selector_matches_the_pools_labels() -> None:
    selector = {"matchLabels": {"tier": "chat"}, "matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
    assert selector_matches(selector, {"tier": "chat", "gpu": "h100"})
    assert not selector_matches(selector, {"tier": "chat"})
    assert not selector_matches(selector, {"tier": "batch", "gpu": "h100"})
    assert selector_matches({}, {"any": "pool"})  # empty: every pool
    not_in = {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["batch"]}]}
    assert selector_matches(not_in, {"tier": "chat"}) and not selector_matches(not_in, {"tier": "batch"})
    assert selector_matches({"matchExpressions": [{"key": "k", "operator": "Near"}]}, {}) is None
    spec = {"poolSelector": selector}
    assert pool_ref_matches(spec, "a", GROUP, "K", "o", {"tier": "chat", "gpu": "x"})
    assert not pool_ref_matches(spec, "a", GROUP, "K", "o", {})


def test_one_watch_feeds_each_pools_own_stores() -> None:
    policies = PoolPolicies(GROUP)
    sink = policies.objectives
    a, b, other_ns = _Director(), _Director(), _Director()
    policies.attach("a", _pool("a", tier="chat"), a)
    policies.attach("b", _pool("b", tier="batch"), b)
    policies.attach("x/a", _pool("a", namespace="x", tier="chat"), other_ns)
    sink.upsert_object(_objective("only-a", 5, poolRef={"name": "a"}))  # v1alpha2: the pool it names
    sink.upsert_object(_objective("both", 7, poolRefs=[{"name": "a"}, {"name": "b"}]))
    sink.upsert_object(_objective("chat", 9, poolSelector={"matchLabels": {"tier": "chat"}}))
    assert isinstance(a.objectives, ObjectiveStore)
    assert a.objectives.snapshot() == {"only-a": 5, "both": 7, "chat": 9}
    assert b.objectives.snapshot() == {"both": 7}
    assert other_ns.objectives.snapshot() == {}  # objects apply in their own namespace only

    # a pool that appears later gets the objects that apply to it
    c = _Director()
    policies.attach("c", _pool("c", tier="chat"), c)
    assert c.objectives.snapshot() == {"chat": 9}
    # a pool whose labels change is matched again
    policies.pool_changed("b", _pool("b", tier="chat"))
    assert b.objectives.snapshot() == {"both": 7, "chat": 9}
    policies.pool_changed("a", _pool("a", tier="batch"))
    assert a.objectives.snapshot() == {"only-a": 5, "both": 7}
    # deleted: gone from every pool
    sink.delete_object(_objective("both", 0))
    assert "both" not in a.objectives and "both" not in b.objectives
    policies.detach("c")
    sink.upsert_object(_objective("late", 1, poolRef={"name": "c"}))
    assert "late" not in c.objectives  # a detached pool's store is no longer fed


def test_rewrites_fan_out_too() -> None:
    policies = PoolPolicies(GROUP)
    a, b = _Director(), _Director()
    policies.attach("a", _pool("a"), a)
    policies.attach("b", _pool("b"), b)
    rewrite = objects.model_rewrite("ns", "r", "m", {"m-v2": 1}, pool="a")
    rewrite["spec"]["poolRefs"] = [{"name": "b", "group": GROUP}]
    policies.rewrites.upsert_object(rewrite)
    assert len(a.rewrites) == 1 and len(b.rewrites) == 1


def test_config_annotation() -> None:
    annotated = {"metadata": {"annotations": {"epp.llm-d.ai/config-map": "chat-config"}}}
    assert config_source(annotated) == ("chat-config", CONFIG_KEY)
    annotated["metadata"]["annotations"]["epp.llm-d.ai/config-map"] = "chat-config/epp.yaml"
    assert config_source(annotated) == ("chat-config", "epp.yaml")
    assert config_source({"metadata": {}}) is None
