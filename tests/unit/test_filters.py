"""Filters: role filters, by-label, label-selector-filter, header-based-testing-filter."""

from __future__ import annotations

from typing import Any

import pytest

from epp.framework import (
    ConfigError,
    CycleState,
    Endpoint,
    Filter,
)
from epp.framework.params import decode_params
from epp.framework.registry import lookup
from epp.plugins.filters.by_label import ByLabelFilter
from epp.plugins.filters.decode_filter import DecodeFilter
from epp.plugins.filters.encode_filter import EncodeFilter
from epp.plugins.filters.header_based_testing import HeaderBasedTestingFilter
from epp.plugins.filters.label_selector import LabelSelectorFilter
from epp.plugins.filters.prefill_filter import PrefillFilter
from tests.unit.factories import endpoint, request

ROLE = "llm-d.ai/role"


def build(cls: type[Filter], raw: dict[str, Any] | None = None) -> Any:
    """Instantiate like the loader does: decode the YAML parameters, then construct."""
    return cls("f", decode_params(cls.Params, raw, "plugins[0].parameters"))


def names(endpoints: list[Endpoint]) -> list[str]:
    return [e.metadata.name for e in endpoints]


def run(f: Filter, endpoints: list[Endpoint], headers: dict[str, str] | None = None) -> list[str]:
    return names(f.filter(CycleState(), request(headers=headers), endpoints))


# --- role filters -----------------------------------------------------------------------------

ROLE_ENDPOINTS = [
    endpoint("decode", labels={ROLE: "decode"}),
    endpoint("prefill", labels={ROLE: "prefill"}),
    endpoint("encode", labels={ROLE: "encode"}),
    endpoint("prefill-decode", labels={ROLE: "prefill-decode"}),
    endpoint("encode-prefill", labels={ROLE: "encode-prefill"}),
    endpoint("encode-prefill-decode", labels={ROLE: "encode-prefill-decode"}),
    endpoint("both", labels={ROLE: "both"}),
    endpoint("other-role", labels={ROLE: "router"}),
    endpoint("empty-role", labels={ROLE: ""}),
    endpoint("unlabelled", labels={"app": "vllm"}),
]


def test_decode_filter_keeps_decode_roles_and_unlabelled() -> None:
    assert run(build(DecodeFilter), ROLE_ENDPOINTS) == [
        "decode",
        "prefill-decode",
        "encode-prefill-decode",
        "both",
        "unlabelled",
    ]


def test_prefill_filter_keeps_prefill_roles_and_drops_unlabelled() -> None:
    assert run(build(PrefillFilter), ROLE_ENDPOINTS) == [
        "prefill",
        "prefill-decode",
        "encode-prefill",
        "encode-prefill-decode",
        "both",
    ]


def test_encode_filter_keeps_encode_roles_and_drops_unlabelled() -> None:
    assert run(build(EncodeFilter), ROLE_ENDPOINTS) == ["encode", "encode-prefill", "encode-prefill-decode"]


def test_role_filters_report_their_configured_type() -> None:
    for type_name, cls in (
        ("decode-filter", DecodeFilter),
        ("prefill-filter", PrefillFilter),
        ("encode-filter", EncodeFilter),
    ):
        assert lookup(type_name) is cls
        assert cls.type_name == type_name
        assert build(cls).typed_name == f"f/{type_name}"


def test_role_filters_take_no_parameters() -> None:
    with pytest.raises(ConfigError) as e:
        build(DecodeFilter, {"label": "x"})
    assert e.value.field == "plugins[0].parameters.label"


# --- by-label ---------------------------------------------------------------------------------


def test_by_label_keeps_valid_values_and_optionally_unlabelled() -> None:
    endpoints = [
        endpoint("a", labels={"tier": "gold"}),
        endpoint("b", labels={"tier": "bronze"}),
        endpoint("c"),
        endpoint("d", labels={"tier": "silver"}),
    ]
    strict = build(ByLabelFilter, {"label": "tier", "validValues": ["gold", "silver"]})
    assert run(strict, endpoints) == ["a", "d"]
    lenient = build(ByLabelFilter, {"label": "tier", "validValues": ["gold"], "allowsNoLabel": True})
    assert run(lenient, endpoints) == ["a", "c"]
    only_unlabelled = build(ByLabelFilter, {"label": "tier", "allowsNoLabel": True})
    assert run(only_unlabelled, endpoints) == ["c"]


def test_by_label_absent_label_reads_as_empty_value_like_the_reference() -> None:
    f = build(ByLabelFilter, {"label": "tier", "validValues": [""]})
    assert run(
        f, [endpoint("a", labels={"tier": ""}), endpoint("b"), endpoint("c", labels={"tier": "x"})]
    ) == ["a", "b"]


def test_by_label_requires_a_label() -> None:
    for raw in ({}, {"label": "", "validValues": ["x"]}):
        with pytest.raises(ConfigError) as e:
            build(ByLabelFilter, raw)
        assert e.value.field == "plugins[0].parameters.label"
        assert e.value.reason == "invalid configuration for 'by-label' filter: 'label' must be specified"


def test_by_label_requires_values_unless_unlabelled_allowed() -> None:
    with pytest.raises(ConfigError) as e:
        build(ByLabelFilter, {"label": "tier", "validValues": []})
    assert e.value.field == "plugins[0].parameters.validValues"
    assert e.value.reason == (
        "invalid configuration for 'by-label' filter: "
        "either 'validValues' must be non-empty or 'allowsNoLabel' must be true"
    )


def test_by_label_rejects_non_string_values() -> None:
    with pytest.raises(ConfigError) as e:
        build(ByLabelFilter, {"label": "tier", "validValues": ["a", 3]})
    assert e.value.field == "plugins[0].parameters.validValues[1]"


# --- label-selector-filter --------------------------------------------------------------------

SELECTOR_ENDPOINTS = [
    endpoint("gold-east", labels={"tier": "gold", "zone": "east"}),
    endpoint("gold-west", labels={"tier": "gold", "zone": "west"}),
    endpoint("silver", labels={"tier": "silver"}),
    endpoint("bare", labels={}),
    endpoint("canary", labels={"tier": "gold", "canary": "true"}),
]


def test_label_selector_match_labels_are_anded() -> None:
    f = build(LabelSelectorFilter, {"matchLabels": {"tier": "gold", "zone": "east"}})
    assert run(f, SELECTOR_ENDPOINTS) == ["gold-east"]


def test_label_selector_operators() -> None:
    def sel(*exprs: dict[str, Any]) -> list[str]:
        return run(build(LabelSelectorFilter, {"matchExpressions": list(exprs)}), SELECTOR_ENDPOINTS)

    assert sel({"key": "zone", "operator": "In", "values": ["east", "north"]}) == ["gold-east"]
    # NotIn keeps endpoints without the label
    assert sel({"key": "zone", "operator": "NotIn", "values": ["east"]}) == [
        "gold-west",
        "silver",
        "bare",
        "canary",
    ]
    assert sel({"key": "canary", "operator": "Exists"}) == ["canary"]
    assert sel({"key": "tier", "operator": "DoesNotExist"}) == ["bare"]
    assert sel(
        {"key": "tier", "operator": "In", "values": ["gold"]},
        {"key": "canary", "operator": "DoesNotExist"},
    ) == ["gold-east", "gold-west"]


def test_label_selector_combines_labels_and_expressions() -> None:
    f = build(
        LabelSelectorFilter,
        {
            "matchLabels": {"tier": "gold"},
            "matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["west"]}],
        },
    )
    assert run(f, SELECTOR_ENDPOINTS) == ["gold-east", "canary"]


def test_label_selector_empty_selector_matches_everything() -> None:
    assert run(build(LabelSelectorFilter), SELECTOR_ENDPOINTS) == names(SELECTOR_ENDPOINTS)
    assert run(
        build(LabelSelectorFilter, {"matchLabels": {}, "matchExpressions": []}), SELECTOR_ENDPOINTS
    ) == names(SELECTOR_ENDPOINTS)


def test_label_selector_prefixed_keys() -> None:
    f = build(LabelSelectorFilter, {"matchLabels": {"llm-d.ai/role": "decode"}})
    assert run(f, [endpoint("a", labels={ROLE: "decode"}), endpoint("b", labels={ROLE: "prefill"})]) == ["a"]


def test_label_selector_registered_under_both_names() -> None:
    assert lookup("label-selector-filter") is LabelSelectorFilter
    assert lookup("by-label-selector") is LabelSelectorFilter


@pytest.mark.parametrize(
    ("raw", "field", "reason_part"),
    [
        (
            {"matchExpressions": [{"key": "tier", "operator": "Equals", "values": ["a"]}]},
            "matchExpressions[0].operator",
            "not a valid label selector operator",
        ),
        (
            {"matchExpressions": [{"key": "tier", "operator": "in", "values": ["a"]}]},
            "matchExpressions[0].operator",
            "not a valid label selector operator",
        ),
        (
            {"matchExpressions": [{"key": "tier", "operator": "In"}]},
            "matchExpressions[0].values",
            "can't be empty",
        ),
        (
            {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": []}]},
            "matchExpressions[0].values",
            "can't be empty",
        ),
        (
            {
                "matchExpressions": [
                    {"key": "t", "operator": "In", "values": ["a"]},
                    {"key": "tier", "operator": "Exists", "values": ["a"]},
                ]
            },
            "matchExpressions[1].values",
            "must be empty",
        ),
        (
            {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["ok", "bad value"]}]},
            "matchExpressions[0].values[1]",
            "invalid label value",
        ),
        (
            {"matchExpressions": [{"operator": "Exists"}]},
            "matchExpressions[0].key",
            "name part must be non-empty",
        ),
        (
            {"matchExpressions": [{"key": "a/b/c", "operator": "Exists"}]},
            "matchExpressions[0].key",
            "at most one '/'",
        ),
        (
            {"matchExpressions": [{"key": "tier", "operator": "In", "values": "gold"}]},
            "matchExpressions[0].values",
            "expected a list",
        ),
        (
            {"matchExpressions": [{"key": "tier", "operator": "Exists", "extra": 1}]},
            "matchExpressions[0].extra",
            "unknown parameter",
        ),
        ({"matchLabels": {"-bad": "x"}}, "matchLabels.-bad", "invalid label key"),
        ({"matchLabels": {"Bad.Prefix/name": "x"}}, "matchLabels.Bad.Prefix/name", "prefix part"),
        ({"matchLabels": {"tier": "has space"}}, "matchLabels.tier", "invalid label value"),
        ({"matchLabels": {"tier": "x" * 64}}, "matchLabels.tier", "no more than 63"),
        ({"matchLabels": {"version": 2}}, "matchLabels.version", "must be a string"),
        ({"matchLabels": ["tier"]}, "matchLabels", "expected a mapping"),
    ],
)
def test_label_selector_validation_names_the_field(raw: dict[str, Any], field: str, reason_part: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(LabelSelectorFilter, raw)
    assert e.value.field == f"plugins[0].parameters.{field}"
    assert reason_part in e.value.reason


def test_label_selector_accepts_valid_edge_values() -> None:
    f = build(
        LabelSelectorFilter,
        {"matchLabels": {"example.com/a_b-c.d": "", "x": "A" + "b" * 61 + "9"}},
    )
    labels = {"example.com/a_b-c.d": "", "x": "A" + "b" * 61 + "9"}
    assert run(f, [endpoint("yes", labels=labels), endpoint("no", labels={"x": labels["x"]})]) == ["yes"]


# --- header-based-testing-filter --------------------------------------------------------------

HEADER = "test-epp-endpoint-selection"


def hb(value: str | None, endpoints: list[Endpoint]) -> list[str]:
    headers = {} if value is None else {HEADER: value}
    return run(HeaderBasedTestingFilter("t", None), endpoints, headers)


IP_ENDPOINTS = [
    endpoint("a", address="10.0.0.1", port=8000),
    endpoint("b", address="10.0.0.2", port=8000),
    endpoint("c", address="10.0.0.3", port=8001),
    endpoint("v6", address="fd00::5", port=8000),
]


def test_header_filter_missing_or_blank_header_keeps_nothing() -> None:
    assert hb(None, IP_ENDPOINTS) == []
    assert hb("", IP_ENDPOINTS) == []
    assert hb("  ", IP_ENDPOINTS) == []
    assert hb(" , ", IP_ENDPOINTS) == []


def test_header_filter_follows_header_order() -> None:
    assert hb("10.0.0.3,10.0.0.1", IP_ENDPOINTS) == ["c", "a"]
    assert hb(" 10.0.0.2 , 10.0.0.9 ,10.0.0.1", IP_ENDPOINTS) == ["b", "a"]


def test_header_filter_port_must_match_exactly() -> None:
    assert hb("10.0.0.3:8001", IP_ENDPOINTS) == ["c"]
    assert hb("10.0.0.3:8000", IP_ENDPOINTS) == []
    assert hb("10.0.0.3:", IP_ENDPOINTS) == ["c"]  # empty port = IP only, as Go's SplitHostPort


def test_header_filter_ipv6_forms() -> None:
    assert hb("fd00::5", IP_ENDPOINTS) == ["v6"]
    assert hb("[fd00::5]", IP_ENDPOINTS) == ["v6"]
    assert hb("[fd00::5]:8000", IP_ENDPOINTS) == ["v6"]
    assert hb("[fd00::5]:9999", IP_ENDPOINTS) == []
    assert hb("[fd00::5]:8000, 10.0.0.1", IP_ENDPOINTS) == ["v6", "a"]


def test_header_filter_dedupes_by_ip() -> None:
    ranks = [endpoint("r0", address="10.0.0.7", port=8000), endpoint("r1", address="10.0.0.7", port=8001)]
    # second item names another endpoint of the same IP: dropped
    assert hb("10.0.0.7:8001,10.0.0.7:8000", ranks) == ["r1"]
    assert hb("10.0.0.7:8000,10.0.0.7:8000", ranks) == ["r0"]
    # IP only: the reference's IP map keeps the last candidate with that IP
    assert hb("10.0.0.7", ranks) == ["r1"]


def test_header_filter_ignores_malformed_items() -> None:
    assert hb("[10.0.0.1:8000,10.0.0.2]:80x,10.0.0.1", IP_ENDPOINTS) == ["a"]
