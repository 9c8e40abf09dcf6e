"""``RewriteStore``: InferenceModelRewrite precedence, weighted targets, malformed objects."""

from __future__ import annotations

import collections
import copy
import datetime as dt
import random
from typing import Any

import pytest
from structlog.testing import capture_logs

from epp.datalayer.rewrites import RewriteStore

POOL = "my-pool"


def exact(*models: str) -> list[dict[str, Any]]:
    return [{"model": {"type": "Exact", "value": m}} for m in models]


def targets(*pairs: tuple[str, int | None]) -> list[dict[str, Any]]:
    out = []
    for model, weight in pairs:
        t: dict[str, Any] = {"modelRewrite": model}
        if weight is not None:
            t["weight"] = weight
        out.append(t)
    return out


def rule(matches: list[dict[str, Any]] | None, *pairs: tuple[str, int | None]) -> dict[str, Any]:
    r: dict[str, Any] = {"targets": targets(*pairs)}
    if matches is not None:
        r["matches"] = matches
    return r


def rewrite(
    name: str,
    rules: list[dict[str, Any]],
    *,
    created: Any = "2025-01-01T00:00:00Z",
    pool: str = POOL,
    **meta: Any,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "default", **meta}
    if created is not None:
        metadata["creationTimestamp"] = created
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": metadata,
        "spec": {"poolRef": {"group": "inference.networking.k8s.io", "name": pool}, "rules": rules},
    }


@pytest.fixture
def store() -> RewriteStore:
    return RewriteStore(pool_name=POOL)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


def test_no_rules_means_no_rewrite(store: RewriteStore, rng: random.Random) -> None:
    assert store.choose("llama", rng) is None
    store.upsert_object(rewrite("r", [rule(exact("other"), ("x", 1))]))
    assert store.choose("llama", rng) is None
    assert store.choose("other", rng) == ("x", "r")


def test_exact_match_beats_an_older_generic_rule(store: RewriteStore, rng: random.Random) -> None:
    store.upsert_object(rewrite("generic", [rule(None, ("catch-all", 1))], created="2020-01-01T00:00:00Z"))
    store.upsert_object(
        rewrite("specific", [rule(exact("llama"), ("llama-v2", 1))], created="2025-01-01T00:00:00Z")
    )
    assert store.choose("llama", rng) == ("llama-v2", "specific")
    assert store.choose("mistral", rng) == ("catch-all", "generic")  # generic rules apply to any model


def test_empty_matches_list_is_generic(store: RewriteStore, rng: random.Random) -> None:
    store.upsert_object(rewrite("g", [rule([], ("t", 1))]))
    assert store.choose("anything", rng) == ("t", "g")


def test_oldest_object_wins_then_name(store: RewriteStore, rng: random.Random) -> None:
    store.upsert_object(
        rewrite("b-newer", [rule(exact("m"), ("from-newer", 1))], created="2025-03-01T00:00:00Z")
    )
    store.upsert_object(
        rewrite("z-older", [rule(exact("m"), ("from-older", 1))], created="2025-02-01T00:00:00Z")
    )
    assert store.choose("m", rng) == ("from-older", "z-older")
    # Same creation second (Kubernetes timestamps have one-second resolution): the name decides.
    store.upsert_object(rewrite("a-same", [rule(exact("m"), ("from-a", 1))], created="2025-02-01T00:00:00Z"))
    assert store.choose("m", rng) == ("from-a", "a-same")


def test_generic_precedence_is_also_by_age(store: RewriteStore, rng: random.Random) -> None:
    store.upsert_object(rewrite("new", [rule(None, ("new-t", 1))], created="2025-05-01T00:00:00+02:00"))
    store.upsert_object(rewrite("old", [rule(None, ("old-t", 1))], created="2025-04-30T23:00:00Z"))
    assert store.choose("m", rng) == ("new-t", "new")  # 2025-04-30T22:00Z is older than 23:00Z


def test_first_matching_rule_within_an_object_wins(store: RewriteStore, rng: random.Random) -> None:
    store.upsert_object(
        rewrite(
            "r",
            [
                rule(exact("a"), ("first-a", 1)),
                rule(exact("b", "a"), ("second-ab", 1)),
                rule(None, ("generic-1", 1)),
                rule(None, ("generic-2", 1)),
            ],
        )
    )
    assert store.choose("a", rng) == ("first-a", "r")
    assert store.choose("b", rng) == ("second-ab", "r")
    assert store.choose("c", rng) == ("generic-1", "r")


def test_datetime_timestamps_and_missing_timestamps(store: RewriteStore, rng: random.Random) -> None:
    store.upsert_object(
        rewrite("dated", [rule(exact("m"), ("dated", 1))], created=dt.datetime(2025, 1, 1, tzinfo=dt.UTC))
    )
    assert store.choose("m", rng) == ("dated", "dated")
    store.upsert_object(rewrite("undated", [rule(exact("m"), ("undated", 1))], created=None))
    assert store.choose("m", rng) == ("undated", "undated")  # no timestamp sorts first (Go's zero time)


def test_delete(store: RewriteStore, rng: random.Random) -> None:
    store.upsert_object(rewrite("old", [rule(exact("m"), ("old-t", 1))], created="2020-01-01T00:00:00Z"))
    store.upsert_object(rewrite("new", [rule(exact("m"), ("new-t", 1))]))
    store.delete("old")
    assert store.choose("m", rng) == ("new-t", "new")
    store.delete("missing")
    store.delete("new")
    store.upsert_object(rewrite("g", [rule(None, ("g-t", 1))]))
    store.upsert_object(rewrite("elsewhere", [rule(exact("m"), ("x", 1))], pool="other"))
    assert store.names() == ["g"]
    assert store.choose("m", rng) == ("g-t", "g")
    store.delete("g")
    assert len(store) == 0
    assert store.choose("m", rng) is None


def test_update_replaces_the_rules_and_other_pools_are_ignored(
    store: RewriteStore, rng: random.Random
) -> None:
    store.upsert_object(rewrite("r", [rule(exact("m"), ("v1", 1))]))
    store.upsert_object(rewrite("r", [rule(exact("m"), ("v2", 1))]))
    assert store.choose("m", rng) == ("v2", "r")
    store.upsert_object(rewrite("r", [rule(exact("m"), ("v3", 1))], pool="other"))
    assert store.choose("m", rng) is None
    store.upsert_object(rewrite("r", [rule(exact("m"), ("v4", 1))], deletionTimestamp="2025-01-02T00:00:00Z"))
    assert len(store) == 0


def test_weighted_split_is_statistically_right(store: RewriteStore) -> None:
    store.upsert_object(rewrite("canary", [rule(exact("m"), ("stable", 90), ("canary", 10))]))
    rng = random.Random(42)
    n = 2000
    counts = collections.Counter(store.choose("m", rng) for _ in range(n))
    assert set(counts) == {("stable", "canary"), ("canary", "canary")}
    share = counts[("canary", "canary")] / n
    # binomial sd = sqrt(0.1 * 0.9 / 2000) ≈ 0.0067; 4 sd ≈ 0.027
    assert abs(share - 0.10) < 0.027


def test_zero_weight_targets_are_never_chosen_when_others_have_weight(store: RewriteStore) -> None:
    store.upsert_object(rewrite("r", [rule(exact("m"), ("off", 0), ("on", 3), ("off2", 0))]))
    rng = random.Random(7)
    assert {store.choose("m", rng) for _ in range(500)} == {("on", "r")}


def test_all_zero_weights_are_uniform(store: RewriteStore) -> None:
    store.upsert_object(rewrite("r", [rule(exact("m"), ("a", 0), ("b", 0), ("c", None))]))
    rng = random.Random(3)
    n = 3000
    counts = collections.Counter(store.choose("m", rng) for _ in range(n))
    for model in ("a", "b", "c"):
        assert abs(counts[(model, "r")] / n - 1 / 3) < 0.04


def test_mixed_weights_warn_and_unweighted_targets_are_never_chosen(store: RewriteStore) -> None:
    with capture_logs() as logs:
        store.upsert_object(rewrite("r", [rule(exact("m"), ("weighted", 5), ("unweighted", None))]))
    assert any(e["log_level"] == "warning" and e["object"] == "r" for e in logs)
    rng = random.Random(11)
    assert {store.choose("m", rng) for _ in range(300)} == {("weighted", "r")}


def test_rule_without_targets_rewrites_nothing_and_shadows_generic_rules(store: RewriteStore) -> None:
    """Quirk Q10: the reference rewrites to "" (an empty body model); here the model stays."""
    with capture_logs() as logs:
        store.upsert_object(rewrite("empty", [rule(exact("m"))]))
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["object"] == "empty" and warning["field"] == "spec.rules[0].targets"
    store.upsert_object(rewrite("generic", [rule(None, ("g", 1))], created="2019-01-01T00:00:00Z"))
    rng = random.Random(0)
    assert store.choose("m", rng) is None
    assert store.choose("other", rng) == ("g", "generic")


def test_match_without_model_matches_nothing_and_other_types_are_ignored(store: RewriteStore) -> None:
    with capture_logs() as logs:
        store.upsert_object(
            rewrite(
                "r",
                [
                    rule([{}], ("never", 1)),
                    rule([{"model": {"type": "RegularExpression", "value": "m.*"}}], ("regex", 1)),
                    rule([{"model": {"value": "m"}}], ("default-type-is-exact", 1)),
                ],
            )
        )
    rng = random.Random(0)
    assert store.choose("m", rng) == ("default-type-is-exact", "r")
    assert store.choose("mx", rng) is None
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["field"] == "spec.rules[1].matches[0].model.type"


GOOD_RULE = rule(exact("m"), ("t", 1))


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda o: o["spec"].__setitem__("rules", {"a": 1}), "spec.rules"),
        (lambda o: o["spec"]["rules"].append("rule"), "spec.rules[1]"),
        (lambda o: o["spec"]["rules"][0].__setitem__("matches", "m"), "spec.rules[0].matches"),
        (lambda o: o["spec"]["rules"][0]["matches"].append(3), "spec.rules[0].matches[1]"),
        (
            lambda o: o["spec"]["rules"][0]["matches"][0]["model"].__setitem__("value", 5),
            "spec.rules[0].matches[0].model.value",
        ),
        (
            lambda o: o["spec"]["rules"][0]["matches"][0].__setitem__("model", "m"),
            "spec.rules[0].matches[0].model",
        ),
        (
            lambda o: o["spec"]["rules"][0]["targets"][0].pop("modelRewrite"),
            "spec.rules[0].targets[0].modelRewrite",
        ),
        (
            lambda o: o["spec"]["rules"][0]["targets"][0].__setitem__("modelRewrite", ""),
            "spec.rules[0].targets[0].modelRewrite",
        ),
        (
            lambda o: o["spec"]["rules"][0]["targets"][0].__setitem__("weight", "ten"),
            "spec.rules[0].targets[0].weight",
        ),
        (
            lambda o: o["spec"]["rules"][0]["targets"][0].__setitem__("weight", -1),
            "spec.rules[0].targets[0].weight",
        ),
        (
            lambda o: o["spec"]["rules"][0]["targets"][0].__setitem__("weight", 0.5),
            "spec.rules[0].targets[0].weight",
        ),
        (
            lambda o: o["spec"]["rules"][0]["targets"][0].__setitem__("weight", True),
            "spec.rules[0].targets[0].weight",
        ),
        (
            lambda o: o["spec"]["rules"][0].__setitem__("targets", {"modelRewrite": "t"}),
            "spec.rules[0].targets",
        ),
        (lambda o: o["metadata"].__setitem__("creationTimestamp", "yesterday"), "metadata.creationTimestamp"),
        (lambda o: o["metadata"].__setitem__("creationTimestamp", 12), "metadata.creationTimestamp"),
        (lambda o: o.__setitem__("spec", ["x"]), "spec"),
        (lambda o: o["spec"].__setitem__("poolRef", "my-pool"), "spec.poolRef"),
        (lambda o: o["metadata"].pop("name"), "metadata.name"),
    ],
)
def test_malformed_objects_are_skipped_with_a_warning(store: RewriteStore, mutate: Any, field: str) -> None:
    store.upsert_object(rewrite("r", [copy.deepcopy(GOOD_RULE)]))
    bad = rewrite("r", [copy.deepcopy(GOOD_RULE)])
    mutate(bad)
    with capture_logs() as logs:
        store.upsert_object(bad)  # never raises
        store.upsert_object(rewrite("ok", [rule(None, ("g", 1))]))
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert warnings and all(e["field"] == field for e in warnings)
    if field != "metadata.name":
        assert all(e["object"] == "r" for e in warnings)
    # the earlier good version of "r" is gone too, unless the bad one has no name to find it by
    if field == "metadata.name":
        assert store.names() == ["ok", "r"]
        assert store.choose("m", random.Random(0)) == ("t", "r")  # r's exact rule still wins
    else:
        assert store.names() == ["ok"]
        assert store.choose("m", random.Random(0)) == ("g", "ok")


def test_target_equal_to_the_incoming_model_is_still_a_decision(store: RewriteStore) -> None:
    store.upsert_object(rewrite("keep", [rule(exact("m"), ("m", 1))]))
    assert store.choose("m", random.Random(0)) == ("m", "keep")
