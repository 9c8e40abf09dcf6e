"""Tests of the configuration loader (``epp.config``): defaults, samples, validation paths, effective YAML.

Every test runs inside a registry sandbox: test-local plugin classes are registered for the duration of
the test only. Types that other parts of the tree provide (``openai-parser``, the data-layer plugins,
the P/D plugins) are replaced by stubs only while they are not registered, so the same tests exercise
the real plugins once they exist.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from epp.config import (
    ConfigError,
    ConfigSyntaxError,
    LoadedConfig,
    default_document,
    load_config,
    load_config_file,
)
from epp.config.schema import parse_duration, parse_quantity
from epp.framework import (
    Admitter,
    CycleState,
    DataProducer,
    DataSource,
    Endpoint,
    EndpointDiscovery,
    EndpointNotifier,
    Extractor,
    FairnessPolicy,
    Filter,
    InferenceError,
    LLMRequest,
    NoParams,
    OrderingPolicy,
    Parser,
    Picker,
    Plugin,
    PreRequest,
    Profile,
    ProfileHandler,
    ProfileRunResult,
    RequestBody,
    RequestDone,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    ResponseInfo,
    SchedulingResult,
    ScoredEndpoint,
    Scorer,
    UsageLimitPolicy,
    registry,
)
from epp.framework.params import encode_params
from tests.unit.factories import CONFIG_HEADER as HEADER
from tests.unit.factories import NO_ENV, endpoint
from tests.unit.factories import config as load
from tests.unit.factories import config_error as load_error

# --- stub plugins ------------------------------------------------------------------------------------


class StubParser(Parser):
    type_name = "test-parser"

    def parse_request(self, body: bytes, headers: Mapping[str, str]) -> RequestBody | None:
        return None


class StubFilter(Filter):
    type_name = "test-filter"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return endpoints


class StubScorer(Scorer):
    type_name = "test-scorer"

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        return [0.5] * len(endpoints)


class StubScorerFilter(StubScorer, Filter):
    """A scorer that is also a filter (like context-length-aware): must fill both slots."""

    type_name = "test-scorer-filter"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return endpoints


@dataclass(slots=True, frozen=True)
class StubPickerParams:
    max_num_of_endpoints: int = 1


class StubPicker(Picker):
    type_name = "test-picker"
    Params = StubPickerParams

    def pick(self, cycle: CycleState, request: LLMRequest, scored: list[ScoredEndpoint]) -> ProfileRunResult:
        return ProfileRunResult([s.endpoint for s in scored[:1]])


class StubHandler(ProfileHandler):
    """Runs every profile once; the first profile is primary."""

    type_name = "test-handler"

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, Profile]:
        return {n: p for n, p in profiles.items() if n not in results}

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> tuple[SchedulingResult | None, Exception | None]:
        first = next(iter(results))
        return SchedulingResult(dict(results), first), None


class StubSource(DataSource):
    type_name = "test-source"


class StubExtractor(Extractor):
    type_name = "test-extractor"


@dataclass(slots=True, frozen=True)
class DiscoveryParams:
    path: str = ""


class StubDiscovery(EndpointDiscovery):
    type_name = "test-discovery"
    Params = DiscoveryParams

    async def start(self, notifier: EndpointNotifier) -> None:
        return None


class StubHooks(PreRequest, Admitter, ResponseHeaderProcessor, ResponseBodyProcessor, RequestDone):
    type_name = "test-hooks"

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        return None

    def admit(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> InferenceError | None:
        return None

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        return None

    def response_body(
        self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None, chunk: bytes
    ) -> None:
        return None

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        return None


class StubPreRequest(PreRequest):
    type_name = "test-pre-request"

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        return None


class StubProducerA(DataProducer):
    """Produces A from B: must run after StubProducerB even when declared first."""

    type_name = "test-producer-a"
    produces = frozenset({"A"})
    consumes: ClassVar[frozenset[str]] = frozenset({"B"})

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        return None


class StubProducerB(StubProducerA):
    type_name = "test-producer-b"
    produces = frozenset({"B"})
    consumes: ClassVar[frozenset[str]] = frozenset()


class StubProducerCycle(StubProducerA):
    type_name = "test-producer-cycle"
    produces = frozenset({"B"})
    consumes: ClassVar[frozenset[str]] = frozenset({"A"})


@dataclass(slots=True, frozen=True)
class PrefixParams:
    block_size_tokens: int = 16
    max_prefix_blocks_to_match: int = 256


class StubPrefixConsumer(StubScorer):
    """A scorer consuming the prefix match info; the producer's parameters it accepts are forwarded."""

    type_name = "test-prefix-consumer"
    Params = PrefixParams
    consumes: ClassVar[frozenset[str]] = frozenset({"PrefixCacheMatchInfo"})


class StubPrefixProducer(DataProducer):
    type_name = "approx-prefix-cache-producer"
    Params = PrefixParams
    produces = frozenset({"PrefixCacheMatchInfo"})

    async def produce(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> None:
        return None


@dataclass(slots=True, frozen=True)
class FailingParams:
    mode: str = "value"


class StubFailing(Plugin):
    type_name = "test-failing"
    Params = FailingParams

    def __init__(self, name: str, params: FailingParams, handle: Any = None) -> None:
        super().__init__(name, params, handle)
        if params.mode == "value":
            raise ValueError("boom")
        if params.mode == "relative":
            raise ConfigError("deciders.prefill", "deciders.prefill plugin not found: x")


@dataclass(slots=True, frozen=True)
class RefParams:
    ref: str = ""


class StubNeedsEarlier(Plugin):
    """Resolves ``ref`` through the handle at construction, like the disagg handler's deciders."""

    type_name = "test-needs-earlier"
    Params = RefParams
    seen_endpoints: ClassVar[list[int]] = []

    def __init__(self, name: str, params: RefParams, handle: Any = None) -> None:
        super().__init__(name, params, handle)
        self.resolved = handle.plugin(params.ref)
        if self.resolved is None:
            raise ConfigError("ref", f"plugin not found: {params.ref}")
        StubNeedsEarlier.seen_endpoints.append(len(handle.endpoints()))


class StubPolicy(OrderingPolicy, FairnessPolicy, UsageLimitPolicy):
    type_name = "test-policy"

    def sort_key(self, item: Any) -> tuple[float, ...]:
        return (item.seq,)

    def pick(self, band: Any) -> Any:
        return next(band.flows(), None)

    def compute_limit(self, saturation: float, priorities: Any, ceilings: list[float]) -> None:
        return None


TEST_PLUGINS: tuple[type[Plugin], ...] = (
    StubParser,
    StubFilter,
    StubScorer,
    StubScorerFilter,
    StubPicker,
    StubHandler,
    StubSource,
    StubExtractor,
    StubDiscovery,
    StubHooks,
    StubPreRequest,
    StubProducerA,
    StubProducerB,
    StubProducerCycle,
    StubPrefixConsumer,
    StubFailing,
    StubNeedsEarlier,
    StubPolicy,
)


def _stub(base: type[Plugin], type_name: str, params: type = NoParams) -> type[Plugin]:
    """A registered-name stub for a type another part of the tree provides (used only while missing)."""
    methods: dict[str, Any] = {"type_name": type_name, "Params": params}
    for cls in base.__mro__:
        for attr in getattr(cls, "__abstractmethods__", ()):
            methods.setdefault(attr, lambda self, *a, **k: None)
    return type(f"Stub_{type_name}", (base,), methods)


@dataclass(slots=True, frozen=True)
class DisaggParams:
    deciders: dict[str, str] = field(default_factory=dict)
    profiles: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class DeciderParams:
    non_cached_tokens: int = 0


@dataclass(slots=True, frozen=True)
class DataParallelParams:
    primary_port: int = 8000


@dataclass(slots=True, frozen=True)
class UtilizationParams:
    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8


class _DisaggHandler(StubHandler, PreRequest):
    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        return None


# Types the reference samples use, with a stub standing in while the real plugin is not registered.
EXTERNAL_STUBS: dict[str, type[Plugin]] = {
    "openai-parser": _stub(Parser, "openai-parser"),
    "metrics-data-source": _stub(DataSource, "metrics-data-source"),
    "core-metrics-extractor": _stub(Extractor, "core-metrics-extractor"),
    "decode-filter": _stub(Filter, "decode-filter"),
    "prefill-filter": _stub(Filter, "prefill-filter"),
    "encode-filter": _stub(Filter, "encode-filter"),
    "prefix-cache-scorer": _stub(Scorer, "prefix-cache-scorer"),
    "load-aware-scorer": _stub(Scorer, "load-aware-scorer"),
    "prefix-based-pd-decider": _stub(Plugin, "prefix-based-pd-decider", DeciderParams),
    "always-disagg-multimodal-decider": _stub(Plugin, "always-disagg-multimodal-decider"),
    "disagg-profile-handler": _stub(_DisaggHandler, "disagg-profile-handler", DisaggParams),
    "data-parallel-profile-handler": _stub(StubHandler, "data-parallel-profile-handler", DataParallelParams),
    "probabilistic-admitter": _stub(Admitter, "probabilistic-admitter"),
    "utilization-detector": _stub(Plugin, "utilization-detector", UtilizationParams),
}


def ensure(*type_names: str) -> None:
    for t in type_names:
        if registry.lookup(t) is None:
            registry.register(EXTERNAL_STUBS[t])


@pytest.fixture(autouse=True)
def sandbox() -> Iterator[None]:
    """Register the test plugins (and a parser) for one test; restore the registry afterwards."""
    registry.registered_types()  # import the built-ins before taking the snapshot
    saved, saved_aliases = dict(registry._REGISTRY), dict(registry._ALIASES)
    saved_deprecated, saved_warned = dict(registry._DEPRECATED), set(registry._WARNED)
    for cls in TEST_PLUGINS:
        registry.register(cls)
    ensure("openai-parser")
    try:
        yield
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
        registry._ALIASES.clear()
        registry._ALIASES.update(saved_aliases)
        registry._DEPRECATED.clear()
        registry._DEPRECATED.update(saved_deprecated)
        registry._WARNED.clear()
        registry._WARNED.update(saved_warned)


def profile_summary(cfg: LoadedConfig) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "filters": [f.name for f in p.filters],
            "scorers": [(s.scorer.name, s.weight) for s in p.scorers],
            "picker": p.picker.name if p.picker else None,
        }
        for name, p in cfg.scheduler.profiles.items()
    }


# --- default configuration ------------------------------------------------------------------------


def expected_default_scorers() -> list[tuple[str, float]]:
    """prefix-spread-scorer alone; a build without it gets the reference's default profile."""
    if registry.lookup("prefix-spread-scorer") is not None:
        return [("prefix-spread-scorer", 1.0)]
    out = [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0)]
    if registry.lookup("prefix-cache-scorer") is not None:
        out.append(("prefix-cache-scorer", 3.0))
    return out


@pytest.mark.parametrize("text", [None, "", "  \n", "# only a comment\n"])
def test_default_configuration(text: str | None) -> None:
    cfg = load_config(text, environ=NO_ENV)
    assert profile_summary(cfg) == {
        "default": {"filters": [], "scorers": expected_default_scorers(), "picker": "max-score-picker"}
    }
    assert cfg.scheduler.handler.type_name == "single-profile-handler"
    parsers = cfg.parsers.parsers
    assert [p.type_name for p in parsers] == [
        "openai-parser",
        "anthropic-parser",
        "vllmhttp-parser",
        "passthrough-parser",
    ]
    assert cfg.parsers.fallback is parsers[-1]
    detector = cfg.saturation_detector
    assert detector is cfg.plugins["utilization-detector"]
    assert detector.type_name == "utilization-detector"
    assert encode_params(detector.params) == {
        "queueDepthThreshold": 5,
        "kvCacheUtilThreshold": 0.8,
        "metricsStalenessThreshold": "200ms",
        "headroom": 0.0,
        "stalenessPolicy": "credit",
    }
    assert cfg.feature_gates == frozenset({"haPopulateNonLeaderDatastore"})  # on by default
    assert cfg.discovery is None
    assert cfg.warnings == []
    assert not cfg.needs_response_body


def test_default_configuration_injects_the_metrics_data_layer() -> None:
    ensure("metrics-data-source", "core-metrics-extractor")
    doc = default_document()
    assert {
        "pluginRef": "metrics-data-source",
        "extractors": [{"pluginRef": "core-metrics-extractor"}],
    } in doc["dataLayer"]["sources"]
    cfg = load_config(None, environ=NO_ENV)
    assert [(s.name, [e.name for e in ex]) for s, ex in cfg.data_sources] == [
        ("metrics-data-source", ["core-metrics-extractor"])
    ]


def test_default_document_skips_unregistered_types() -> None:
    registry._REGISTRY.pop("prefix-spread-scorer", None)  # then the reference's profile, less what is missing
    registry._REGISTRY.pop("prefix-cache-scorer", None)
    registry._REGISTRY.pop("metrics-data-source", None)
    doc = default_document()
    types = [p["type"] for p in doc["plugins"]]
    assert "prefix-cache-scorer" not in types
    assert "metrics-data-source" not in types
    assert doc["schedulingProfiles"][0]["plugins"] == [
        {"pluginRef": "queue-scorer", "weight": 2.0},
        {"pluginRef": "kv-cache-utilization-scorer", "weight": 2.0},
    ]


def test_missing_parser_type_is_a_config_error_on_parser_ref() -> None:
    registry._REGISTRY.pop("openai-parser", None)
    with pytest.raises(ConfigError) as info:
        load_config(None, environ=NO_ENV)
    assert info.value.field == "requestHandler.parsers[0].pluginRef"
    assert "the configured parser is not loaded" in info.value.reason
    assert "openai-parser" in info.value.reason


# --- the reference's sample configurations ---------------------------------------------------------

SAMPLES: dict[str, tuple[str, dict[str, dict[str, Any]], str]] = {
    "basic": (
        """
plugins:
- type: decode-filter
- type: prefix-cache-scorer
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: max-score-picker
""",
        {
            "default": {
                "filters": ["decode-filter"],
                "scorers": [("prefix-cache-scorer", 2.0)],
                "picker": "max-score-picker",
            }
        },
        "single-profile-handler",
    ),
    "pd": (
        """
plugins:
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 16}}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: prefix-based-pd-decider}}}
- {type: prefill-filter}
- {type: decode-filter}
- {type: prefix-cache-scorer}
- {type: queue-scorer}
schedulingProfiles:
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: prefix-cache-scorer, weight: 2},
                            {pluginRef: queue-scorer, weight: 1}]}
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 2},
                           {pluginRef: queue-scorer, weight: 1}]}
""",
        {
            "prefill": {
                "filters": ["prefill-filter"],
                "scorers": [("prefix-cache-scorer", 2.0), ("queue-scorer", 1.0)],
                "picker": "max-score-picker",
            },
            "decode": {
                "filters": ["decode-filter"],
                "scorers": [("prefix-cache-scorer", 2.0), ("queue-scorer", 1.0)],
                "picker": "max-score-picker",
            },
        },
        "disagg-profile-handler",
    ),
    "epd": (
        """
plugins:
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 16}}
- {type: always-disagg-multimodal-decider}
- type: disagg-profile-handler
  parameters:
    deciders: {prefill: prefix-based-pd-decider, encode: always-disagg-multimodal-decider}
- {type: encode-filter}
- {type: prefill-filter}
- {type: decode-filter}
- {type: queue-scorer}
schedulingProfiles:
- {name: encode, plugins: [{pluginRef: encode-filter}, {pluginRef: queue-scorer}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}]}
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: queue-scorer}]}
""",
        {
            "encode": {
                "filters": ["encode-filter"],
                "scorers": [("queue-scorer", 1.0)],
                "picker": "max-score-picker",
            },
            "prefill": {
                "filters": ["prefill-filter"],
                "scorers": [("queue-scorer", 1.0)],
                "picker": "max-score-picker",
            },
            "decode": {
                "filters": ["decode-filter"],
                "scorers": [("queue-scorer", 1.0)],
                "picker": "max-score-picker",
            },
        },
        "disagg-profile-handler",
    ),
    "data-parallel": (
        """
plugins:
- {type: data-parallel-profile-handler, parameters: {primaryPort: 8000}}
- {type: queue-scorer}
- {type: kv-cache-utilization-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: max-score-picker}
""",
        {
            "default": {
                "filters": [],
                "scorers": [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0)],
                "picker": "max-score-picker",
            }
        },
        "data-parallel-profile-handler",
    ),
    "estimated-prefix": (
        """
plugins:
- {type: prefix-cache-scorer}
- {type: load-aware-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 1}
  - {pluginRef: load-aware-scorer, weight: 1}
  - {pluginRef: max-score-picker}
""",
        {
            "default": {
                "filters": [],
                "scorers": [("prefix-cache-scorer", 1.0), ("load-aware-scorer", 1.0)],
                "picker": "max-score-picker",
            }
        },
        "single-profile-handler",
    ),
    "admitter": (
        """
plugins:
- {type: probabilistic-admitter}
- {type: utilization-detector, parameters: {queueDepthThreshold: 999999999, kvCacheUtilThreshold: 1.0}}
- {type: queue-scorer}
- {type: kv-cache-utilization-scorer}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
saturationDetector: {pluginRef: utilization-detector}
""",
        {
            "default": {
                "filters": [],
                "scorers": [("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0)],
                "picker": "max-score-picker",
            }
        },
        "single-profile-handler",
    ),
}


def _sample_types(body: str) -> list[str]:
    import yaml

    return [p["type"] for p in yaml.safe_load(body)["plugins"]]


@pytest.mark.parametrize("name", list(SAMPLES))
def test_reference_samples_load(name: str) -> None:
    body, profiles, handler = SAMPLES[name]
    ensure(*(t for t in _sample_types(body) if t in EXTERNAL_STUBS))
    cfg = load(body)
    assert profile_summary(cfg) == profiles
    assert cfg.scheduler.handler.type_name == handler
    if name == "admitter":
        assert [a.type_name for a in cfg.admitters] == ["probabilistic-admitter"]
        assert cfg.saturation_detector is cfg.plugins["utilization-detector"]
        assert encode_params(cfg.saturation_detector.params) == {
            "queueDepthThreshold": 999999999,
            "kvCacheUtilThreshold": 1.0,
            "metricsStalenessThreshold": "200ms",
            "headroom": 0.0,
            "stalenessPolicy": "credit",
        }
    if name in ("pd", "epd"):
        assert "disagg-profile-handler" in [p.name for p in cfg.pre_request]


@pytest.mark.parametrize("name", list(SAMPLES))
def test_effective_yaml_round_trips(name: str) -> None:
    body, _, _ = SAMPLES[name]
    ensure(*(t for t in _sample_types(body) if t in EXTERNAL_STUBS))
    first = load(body)
    effective = first.effective_yaml()
    second = load_config(effective, environ=NO_ENV)
    assert second.effective_yaml() == effective
    assert profile_summary(second) == profile_summary(first)
    assert list(second.plugins) == list(first.plugins)


def test_effective_yaml_of_the_default_round_trips_and_fills_defaults() -> None:
    import yaml

    cfg = load_config(None, environ=NO_ENV)
    effective = cfg.effective_yaml()
    doc = yaml.safe_load(effective)
    names = [p["name"] for p in doc["plugins"]]
    assert {"single-profile-handler", "max-score-picker", "openai-parser"} <= set(names)
    assert doc["schedulingProfiles"][0]["plugins"][-1] == {"pluginRef": "max-score-picker"}
    picker = next(p for p in doc["plugins"] if p["name"] == "max-score-picker")
    assert picker["parameters"] == {"maxNumOfEndpoints": 1}
    assert "parser" not in doc
    assert doc["requestHandler"] == {
        "parsers": [
            {"pluginRef": "openai-parser"},
            {"pluginRef": "anthropic-parser"},
            {"pluginRef": "vllmhttp-parser"},
            {"pluginRef": "passthrough-parser"},
        ],
        "propagatePriority": False,
    }
    assert "saturationDetector" not in doc  # deprecated location
    assert doc["flowControl"] == {"saturationDetector": {"pluginRef": "utilization-detector"}}
    detector = next(p for p in doc["plugins"] if p["name"] == "utilization-detector")
    assert detector == {
        "name": "utilization-detector",
        "type": "utilization-detector",
        "parameters": {
            "queueDepthThreshold": 5,
            "kvCacheUtilThreshold": 0.8,
            "metricsStalenessThreshold": "200ms",
            "headroom": 0.0,
            "stalenessPolicy": "credit",
        },
    }
    assert load_config(effective, environ=NO_ENV).effective_yaml() == effective


def test_effective_yaml_round_trips_with_flow_control_and_data_layer() -> None:
    cfg = load(
        """
featureGates: [flowControl]
plugins:
- {type: test-source}
- {type: test-extractor}
- {type: test-discovery, parameters: {path: /tmp/x}}
- {name: fair, type: test-policy}
dataLayer:
  injectDefaults: false
  sources: [{pluginRef: test-source, extractors: [{pluginRef: test-extractor}]}]
  discovery: {pluginRef: test-discovery}
flowControl:
  maxBytes: 1Gi
  defaultRequestTTL: 30s
  priorityBands:
  - {priority: 10, maxRequests: "100", fairnessPolicyRef: fair}
"""
    )
    effective = cfg.effective_yaml()
    assert "maxBytes: 1Gi" in effective
    assert "maxBytes: '1000000000'" in effective  # the band default, filled in
    assert "path: /tmp/x" in effective
    assert load_config(effective, environ=NO_ENV).effective_yaml() == effective


# --- validation: every error names the exact field -----------------------------------------------

VALIDATION_CASES: list[tuple[str, str, str]] = [
    # structure
    ("foo: 1\n", "foo", 'unknown field "foo"'),
    ("plugins: {type: queue-scorer}\n", "plugins", "expected a list"),
    ("plugins:\n- queue-scorer\n", "plugins[0]", "expected a mapping"),
    ("plugins:\n- {type: queue-scorer, weight: 2}\n", "plugins[0].weight", 'unknown field "weight"'),
    ("plugins:\n- {type: queue-scorer, name: 3}\n", "plugins[0].name", "expected a string"),
    (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- name: a\n"
        "  plugins: [{pluginRef: queue-scorer, w: 1}]\n",
        "schedulingProfiles[0].plugins[0].w",
        'unknown field "w"',
    ),
    (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- name: a\n"
        "  plugins: [{pluginRef: queue-scorer, weight: x}]\n",
        "schedulingProfiles[0].plugins[0].weight",
        "expected a number",
    ),
    (
        "schedulingProfiles:\n- {name: a, filters: []}\n",
        "schedulingProfiles[0].filters",
        'unknown field "filters"',
    ),
    ("dataLayer: {inject: true}\n", "dataLayer.inject", 'unknown field "inject"'),
    ("dataLayer: {injectDefaults: 'no'}\n", "dataLayer.injectDefaults", "expected a boolean"),
    (
        "dataLayer:\n  sources: [{pluginRef: a, extractor: b}]\n",
        "dataLayer.sources[0].extractor",
        "unknown field",
    ),
    (
        "saturationDetector: {pluginRef: x, queueDepthThreshold: 5}\n",
        "saturationDetector.queueDepthThreshold",
        "unknown",
    ),
    ("parser: {ref: x}\n", "parser.ref", 'unknown field "ref"'),
    ("flowControl: {maxQueue: 1}\n", "flowControl.maxQueue", 'unknown field "maxQueue"'),
    ("flowControl: {maxBytes: 1Zi}\n", "flowControl.maxBytes", "invalid quantity '1Zi'"),
    ("flowControl: {defaultRequestTTL: 30}\n", "flowControl.defaultRequestTTL", "expected a duration string"),
    ("flowControl: {defaultRequestTTL: 30x}\n", "flowControl.defaultRequestTTL", "invalid duration '30x'"),
    (
        "flowControl:\n  priorityBands: [{priority: 1, fairness: x}]\n",
        "flowControl.priorityBands[0].fairness",
        'unknown field "fairness"',
    ),
    # feature gates
    (
        "featureGates: [flowControl, bogus]\n",
        "featureGates[1]",
        "feature gate 'bogus' is unknown or unregistered",
    ),
    ("featureGates: flowControl\n", "featureGates", "expected a list"),
    # plugin instantiation
    ("plugins:\n- {type: queue-scorer}\n- {name: x}\n", "plugins[1].type", "plugin 'x' is missing a type"),
    (
        "plugins:\n- {type: queue-scorer}\n- {type: queue-scorer}\n",
        "plugins[1].name",
        "duplicate plugin name 'queue-scorer'",
    ),
    (
        "plugins:\n- {type: queue-scorer}\n- {name: q, type: test-scorer}\n- {type: foo}\n",
        "plugins[2].type",
        "plugin type 'foo' is not registered",
    ),
    (
        "plugins:\n- {type: max-score-picker, parameters: [1]}\n",
        "plugins[0].parameters",
        "parameters must be a mapping",
    ),
    (
        "plugins:\n- {type: max-score-picker, parameters: 3}\n",
        "plugins[0].parameters",
        "parameters must be a mapping",
    ),
    (
        "plugins:\n- {type: queue-scorer}\n"
        "- {type: max-score-picker, parameters: {maxNumOfEndpoints: two}}\n",
        "plugins[1].parameters.maxNumOfEndpoints",
        "expected an integer",
    ),
    (
        "plugins:\n- {type: test-failing}\n",
        "plugins[0]",
        "failed to create plugin 'test-failing' (type: test-failing): boom",
    ),
    (
        "plugins:\n- {name: h, type: test-failing, parameters: {mode: relative}}\n",
        "plugins[0].parameters.deciders.prefill",
        "failed to create plugin 'h' (type: test-failing): deciders.prefill plugin not found: x",
    ),
    (
        "plugins:\n- {type: test-needs-earlier, parameters: {ref: nope}}\n- {type: queue-scorer}\n",
        "plugins[0].parameters.ref",
        "plugin not found: nope",
    ),
    # profiles
    (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- plugins: []\n",
        "schedulingProfiles[0].name",
        "schedulingProfiles[0] is missing a name",
    ),
    (
        "plugins: [{type: test-handler}]\nschedulingProfiles:\n- {name: a}\n- {name: a}\n",
        "schedulingProfiles[1].name",
        "schedulingProfiles[1] has duplicate name 'a'",
    ),
    (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- name: p\n"
        "  plugins: [{pluginRef: queue-scorer}, {weight: 2}]\n",
        "schedulingProfiles[0].plugins[1].pluginRef",
        "schedulingProfiles[p].plugins[1] is missing a 'pluginRef'",
    ),
    (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- name: p\n"
        "  plugins: [{pluginRef: queue-scorer}, {pluginRef: y}]\n",
        "schedulingProfiles[0].plugins[1].pluginRef",
        "schedulingProfiles[p] references undefined plugin 'y'",
    ),
    (
        "plugins: [{type: max-score-picker}, {type: random-picker}]\n"
        "schedulingProfiles:\n- name: p\n"
        "  plugins: [{pluginRef: max-score-picker}, {pluginRef: random-picker}]\n",
        "schedulingProfiles[0].plugins[1].pluginRef",
        "failed to add plugin 'random-picker' to profile 'p': failed to set 'random-picker' as picker, "
        "already have a registered picker plugin 'max-score-picker'",
    ),
    (
        "plugins: [{type: max-score-picker}, {type: random-picker}]\n",
        "plugins[1]",
        "failed to set 'random-picker' as picker, already have a registered picker plugin 'max-score-picker'",
    ),
    (
        "plugins: [{type: single-profile-handler}, {name: h2, type: test-handler}]\n",
        "plugins[1]",
        "multiple profile handlers found ('single-profile-handler', 'h2'); only one is allowed",
    ),
    (
        "plugins: [{type: queue-scorer}, {type: single-profile-handler}]\nschedulingProfiles:\n"
        "- {name: a}\n- {name: b}\n",
        "plugins[1]",
        "SingleProfileHandler cannot support multiple scheduling profiles",
    ),
    (
        "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- {name: a}\n- {name: b}\n",
        "schedulingProfiles",
        "no profile handler configured",
    ),
    # parser and saturation detector
    ("parser: {pluginRef: nope}\n", "parser.pluginRef", "the configured parser is not loaded"),
    (
        "plugins: [{type: queue-scorer}]\nparser: {pluginRef: queue-scorer}\n",
        "parser.pluginRef",
        "the plugin 'queue-scorer' is not a parser plugin",
    ),
    (
        "saturationDetector: {pluginRef: nope}\n",
        "saturationDetector.pluginRef",
        "saturation detector references undefined plugin 'nope'",
    ),
    (
        "plugins: [{type: queue-scorer}]\nsaturationDetector: {pluginRef: queue-scorer}\n",
        "saturationDetector.pluginRef",
        "plugin 'queue-scorer' is not a fwkfc.SaturationDetector",
    ),
    # data layer
    (
        "plugins: [{type: queue-scorer}]\ndataLayer:\n  sources: [{pluginRef: queue-scorer}]\n",
        "dataLayer.sources[0].pluginRef",
        "the plugin queue-scorer is not a fwkdl.DataSource",
    ),
    (
        "plugins: [{type: test-source}, {type: queue-scorer}]\n"
        "dataLayer:\n  sources: [{pluginRef: test-source, extractors: [{pluginRef: queue-scorer}]}]\n",
        "dataLayer.sources[0].extractors[0].pluginRef",
        "the plugin queue-scorer is not a fwkdl.ExtractorBase",
    ),
    (
        "dataLayer:\n  sources: [{pluginRef: ghost}]\n",
        "dataLayer.sources[0].pluginRef",
        "references undefined plugin 'ghost'",
    ),
    (
        "dataLayer:\n  discovery: {pluginRef: nope}\n",
        "dataLayer.discovery.pluginRef",
        'no plugin found with name "nope"',
    ),
    (
        "plugins: [{type: queue-scorer}]\ndataLayer:\n  discovery: {pluginRef: queue-scorer}\n",
        "dataLayer.discovery.pluginRef",
        'plugin "queue-scorer" does not implement EndpointDiscovery',
    ),
    # flow control (checked when the gate is on)
    (
        "featureGates: [flowControl]\nflowControl: {maxBytes: '-1'}\n",
        "flowControl.maxBytes",
        "maxBytes must be non-negative, got -1",
    ),
    (
        "featureGates: [flowControl]\nflowControl: {defaultRequestTTL: -5s}\n",
        "flowControl.defaultRequestTTL",
        "DefaultRequestTTL cannot be negative, but got -5s",
    ),
    (
        "featureGates: [flowControl]\nflowControl:\n  priorityBands: [{priority: 10}, {priority: 10}]\n",
        "flowControl.priorityBands[1].priority",
        "duplicate priority level 10",
    ),
    (
        "featureGates: [flowControl]\nflowControl:\n  priorityBands: [{priority: 1, maxRequests: '-3'}]\n",
        "flowControl.priorityBands[0].maxRequests",
        "maxRequests must be non-negative, got -3",
    ),
    (
        "featureGates: [flowControl]\nflowControl:\n"
        "  priorityBands: [{priority: 1, orderingPolicyRef: edf}]\n",
        "flowControl.priorityBands[0].orderingPolicyRef",
        'no ordering policy registered for name "edf"',
    ),
    (
        "featureGates: [flowControl]\nflowControl:\n  defaultPriorityBand: {fairnessPolicyRef: rr}\n",
        "flowControl.defaultPriorityBand.fairnessPolicyRef",
        'no fairness policy registered for name "rr"',
    ),
    (
        "featureGates: [flowControl]\nflowControl: {usageLimitPolicyPluginRef: lim}\n",
        "flowControl.usageLimitPolicyPluginRef",
        "usage limit policy plugin 'lim' not found",
    ),
]


@pytest.mark.parametrize(
    ("body", "field_path", "reason"), VALIDATION_CASES, ids=[c[1] for c in VALIDATION_CASES]
)
def test_validation_error_names_the_field(body: str, field_path: str, reason: str) -> None:
    err = load_error(body)
    assert err.field == field_path
    assert reason in err.reason


@pytest.mark.parametrize(
    ("text", "field_path", "reason"),
    [
        ("kind: EndpointPickerConfig\n", "apiVersion", "apiVersion missing (expected 'llm-d.ai/v1' or"),
        ("apiVersion: v1\nkind: EndpointPickerConfig\n", "apiVersion", "unknown apiVersion 'v1'"),
        ("apiVersion: llm-d.ai/v1alpha1\n", "kind", "unknown kind missing"),
        ("apiVersion: llm-d.ai/v1alpha1\nkind: Pod\n", "kind", "unknown kind 'Pod'"),
        ("- 1\n- 2\n", "", "expected a mapping at the top level, got list"),
    ],
)
def test_document_header_errors(text: str, field_path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text, environ=NO_ENV)
    assert info.value.field == field_path
    assert reason in info.value.reason


def test_unknown_parameter_key_is_rejected_naming_the_key() -> None:
    err = load_error(
        "plugins:\n- {type: queue-scorer}\n- {type: max-score-picker, parameters: {maxEndpoints: 2}}\n"
    )
    assert err.field == "plugins[1].parameters.maxEndpoints"
    assert "unknown parameter" in err.reason
    assert "maxNumOfEndpoints" in err.reason  # lists the known keys


def test_parameter_keys_that_are_not_strings_are_a_config_error() -> None:
    """A YAML key such as ``1:`` among the parameters is reported, not a crash of the loader."""
    err = load_error(
        "plugins:\n- {type: queue-scorer}\n- {type: max-score-picker, parameters: {1: 2, x: 3}}\n"
    )
    assert err.field == "plugins[1].parameters"
    assert err.reason == "field names must be strings, got 1"


def test_flow_control_values_are_not_checked_with_the_gate_off() -> None:
    cfg = load("flowControl: {maxBytes: '-1', defaultRequestTTL: -5s}\n")
    assert "flowControl" not in cfg.feature_gates


def test_legacy_metrics_gate_rejects_core_metrics_extractor() -> None:
    ensure("core-metrics-extractor")
    err = load_error("featureGates: [enableLegacyMetrics]\nplugins: [{type: core-metrics-extractor}]\n")
    assert err.field == "plugins[0].type"
    assert "enableLegacyMetrics" in err.reason


# --- YAML syntax ------------------------------------------------------------------------------------


def test_yaml_syntax_error_names_line_and_column() -> None:
    text = HEADER + "plugins:\n- type: queue-scorer\n  name: [unclosed\n"
    with pytest.raises(ConfigSyntaxError) as info:
        load_config(text, source="cfg.yaml", environ=NO_ENV)
    err = info.value
    assert isinstance(err, ConfigError)
    assert (err.line, err.column) == (6, 1)
    assert "line 6, column 1" in str(err)
    assert err.source == "cfg.yaml"


def test_bad_indentation_reports_its_line() -> None:
    text = HEADER + "plugins:\n- type: queue-scorer\n   name: x\n"
    with pytest.raises(ConfigSyntaxError) as info:
        load_config(text, environ=NO_ENV)
    assert info.value.line == 5
    assert "line 5, column" in info.value.reason


def test_duplicate_key_is_a_syntax_error_with_position() -> None:
    text = HEADER + "plugins: []\nplugins: []\n"
    with pytest.raises(ConfigSyntaxError) as info:
        load_config(text, environ=NO_ENV)
    assert (info.value.line, info.value.column) == (4, 1)
    assert 'duplicate key "plugins"' in info.value.reason


def test_load_config_file_uses_the_path_as_source(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(HEADER + "plugins: [\n")
    with pytest.raises(ConfigSyntaxError) as info:
        load_config_file(str(path), environ=NO_ENV)
    assert info.value.source == str(path)
    with pytest.raises(ConfigError) as missing:
        load_config_file(str(tmp_path / "missing.yaml"))
    assert missing.value.reason == f"config file {tmp_path / 'missing.yaml'} does not exist"  # no [Errno 2]
    with pytest.raises(ConfigError, match=r"cannot read config file .*: Is a directory"):
        load_config_file(str(tmp_path))


# --- defaults and assembly --------------------------------------------------------------------------


def test_deprecated_api_version_is_accepted_with_a_warning() -> None:
    cfg = load_config(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n", environ=NO_ENV
    )
    (line,) = [w for w in cfg.warnings if "apiVersion" in w]
    assert "'inference.networking.x-k8s.io/v1alpha1' is deprecated; use 'llm-d.ai/v1'" in line
    assert cfg.effective_yaml().startswith("apiVersion: llm-d.ai/v1\n")
    assert cfg.effective_yaml("llm-d.ai/v1alpha1").startswith("apiVersion: llm-d.ai/v1alpha1\n")


def test_no_profiles_builds_a_default_profile_with_every_filter_scorer_and_picker() -> None:
    cfg = load(
        """
plugins:
- {type: test-filter}
- {type: test-hooks}
- {type: test-scorer}
- {type: test-scorer-filter}
- {type: random-picker}
"""
    )
    assert profile_summary(cfg) == {
        "default": {
            "filters": ["test-filter", "test-scorer-filter"],
            "scorers": [("test-scorer", 1.0), ("test-scorer-filter", 1.0)],
            "picker": "random-picker",
        }
    }
    assert cfg.scheduler.handler.type_name == "single-profile-handler"
    assert "max-score-picker" not in cfg.plugins  # the existing picker is used


def test_scorer_that_is_also_a_filter_fills_both_slots_in_a_profile() -> None:
    cfg = load(
        "plugins: [{type: test-scorer-filter}]\n"
        "schedulingProfiles:\n- name: p\n  plugins: [{pluginRef: test-scorer-filter, weight: 4}]\n"
    )
    profile = cfg.scheduler.profiles["p"]
    assert [f.name for f in profile.filters] == ["test-scorer-filter"]
    assert [(s.scorer.name, s.weight) for s in profile.scorers] == [("test-scorer-filter", 4.0)]


def test_existing_picker_is_appended_to_profiles_without_one() -> None:
    cfg = load(
        """
plugins:
- {type: test-handler}
- {type: queue-scorer}
- {type: test-picker}
- {type: random-picker}
schedulingProfiles:
- {name: a, plugins: [{pluginRef: queue-scorer}]}
- {name: b, plugins: [{pluginRef: random-picker}]}
"""
    )
    assert cfg.scheduler.profiles["a"].picker is cfg.plugins["test-picker"]
    assert cfg.scheduler.profiles["b"].picker is cfg.plugins["random-picker"]
    assert cfg.scheduler.handler is cfg.plugins["test-handler"]


def test_non_scheduling_plugin_in_a_profile_is_ignored_with_warnings() -> None:
    cfg = load(
        "plugins: [{type: test-hooks}, {type: queue-scorer}]\n"
        "schedulingProfiles:\n- name: p\n"
        "  plugins: [{pluginRef: test-hooks, weight: 3}, {pluginRef: queue-scorer}]\n"
    )
    assert profile_summary(cfg)["p"]["scorers"] == [("queue-scorer", 1.0)]
    assert any(w.startswith("schedulingProfiles[0].plugins[0].pluginRef:") for w in cfg.warnings)
    assert any(w.startswith("schedulingProfiles[0].plugins[0].weight:") for w in cfg.warnings)


def test_hooks_are_collected_in_plugins_order() -> None:
    cfg = load(
        """
plugins:
- {name: h2, type: test-hooks}
- {name: p1, type: test-pre-request}
- {name: h1, type: test-hooks}
- {type: random-picker}
"""
    )
    assert [p.name for p in cfg.pre_request] == ["h2", "p1", "h1"]
    assert [p.name for p in cfg.admitters] == ["h2", "h1"]
    assert [p.name for p in cfg.response_header] == ["h2", "h1"]
    assert [p.name for p in cfg.response_body] == ["h2", "h1"]
    assert [p.name for p in cfg.request_done] == ["h2", "h1"]
    assert cfg.needs_response_body


def test_plugins_dict_keeps_declaration_order_with_defaults_appended() -> None:
    cfg = load("plugins: [{name: z, type: queue-scorer}, {name: a, type: test-filter}]\n")
    names = list(cfg.plugins)
    assert names[:2] == ["z", "a"]
    assert {"single-profile-handler", "max-score-picker", "openai-parser"} <= set(names[2:])


def test_handle_resolves_earlier_plugins_and_endpoints() -> None:
    StubNeedsEarlier.seen_endpoints.clear()
    eps = [
        endpoint("a", "10.0.0.1"),
        endpoint("b", "10.0.0.2"),
    ]
    cfg = load(
        "plugins:\n- {type: queue-scorer}\n- {type: test-needs-earlier, parameters: {ref: queue-scorer}}\n",
        endpoints=lambda: eps,
    )
    plugin = cfg.plugins["test-needs-earlier"]
    assert isinstance(plugin, StubNeedsEarlier)
    assert plugin.resolved is cfg.plugins["queue-scorer"]
    assert StubNeedsEarlier.seen_endpoints == [2]


def test_multi_endpoint_picker_warns_about_original_dst() -> None:
    cfg = load("plugins:\n- {type: max-score-picker, parameters: {maxNumOfEndpoints: 3}}\n")
    assert any("ORIGINAL_DST" in w and "plugins[0].parameters.maxNumOfEndpoints" in w for w in cfg.warnings)
    assert not [w for w in load("plugins:\n- {type: max-score-picker}\n").warnings if "apiVersion" not in w]


def test_feature_gates_and_deprecated_environment_switch() -> None:
    cfg = load("featureGates: [dataLayer]\n", environ={"ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER": "true"})
    assert cfg.feature_gates == frozenset({"dataLayer", "flowControl", "haPopulateNonLeaderDatastore"})
    assert cfg.flow_control_enabled
    assert any("ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER" in w for w in cfg.warnings)
    assert any("'dataLayer' is deprecated" in w for w in cfg.warnings)
    assert not load("", environ={"ENABLE_EXPERIMENTAL_FLOW_CONTROL_LAYER": "false"}).flow_control_enabled


def test_parser_and_discovery_are_resolved() -> None:
    cfg = load(
        """
plugins:
- {name: p, type: test-parser}
- {name: files, type: test-discovery, parameters: {path: /etc/epp/endpoints.yaml}}
parser: {pluginRef: p}
dataLayer:
  discovery: {pluginRef: files}
"""
    )
    assert cfg.parsers.parsers == (cfg.plugins["p"],)
    assert cfg.parsers.fallback is cfg.plugins["p"]
    assert any("top-level parser is deprecated" in w for w in cfg.warnings)
    assert cfg.discovery is cfg.plugins["files"]
    assert "openai-parser" not in cfg.plugins


# --- data layer ---------------------------------------------------------------------------------------


def test_data_layer_defaults_are_injected_unless_disabled_or_present() -> None:
    ensure("metrics-data-source", "core-metrics-extractor")
    injected = load("plugins: [{type: test-source}]\ndataLayer:\n  sources: [{pluginRef: test-source}]\n")
    assert [s.name for s, _ in injected.data_sources] == ["test-source", "metrics-data-source"]
    assert [e.name for e in injected.data_sources[1][1]] == ["core-metrics-extractor"]

    disabled = load(
        "plugins: [{type: test-source}]\ndataLayer:\n  injectDefaults: false\n"
        "  sources: [{pluginRef: test-source}]\n"
    )
    assert [s.name for s, _ in disabled.data_sources] == ["test-source"]
    assert "metrics-data-source" not in disabled.plugins

    renamed = load(
        "plugins: [{name: m, type: metrics-data-source}]\ndataLayer:\n  sources: [{pluginRef: m}]\n"
    )
    assert [s.name for s, _ in renamed.data_sources] == ["m"]

    legacy = load("featureGates: [enableLegacyMetrics]\n")
    assert legacy.data_sources == []
    assert "metrics-data-source" not in legacy.plugins


# --- data producers -----------------------------------------------------------------------------------


def test_missing_producer_is_created_with_forwarded_parameters() -> None:
    if registry.lookup("approx-prefix-cache-producer") is None:
        registry.register(StubPrefixProducer)
    cfg = load("plugins:\n- {type: test-prefix-consumer, parameters: {blockSizeTokens: 32}}\n")
    producer = cfg.plugins["approx-prefix-cache-producer"]
    assert producer in cfg.producers
    assert encode_params(producer.params)["blockSizeTokens"] == 32
    again = load_config(cfg.effective_yaml(), environ=NO_ENV)
    assert [p.name for p in again.producers] == ["approx-prefix-cache-producer"]


def test_missing_producer_type_only_warns() -> None:
    registry._REGISTRY.pop("approx-prefix-cache-producer", None)
    cfg = load("plugins:\n- {type: test-prefix-consumer}\n")
    assert cfg.producers == []
    assert any("approx-prefix-cache-producer" in w for w in cfg.warnings)


def test_producers_run_after_the_producers_they_consume_from() -> None:
    cfg = load("plugins:\n- {type: test-producer-a}\n- {type: test-producer-b}\n- {type: random-picker}\n")
    assert [p.name for p in cfg.producers] == ["test-producer-b", "test-producer-a"]


def test_producer_cycle_is_an_error() -> None:
    err = load_error("plugins:\n- {type: test-producer-a}\n- {type: test-producer-cycle}\n")
    assert err.field == "plugins[0]"
    assert err.reason == "cycle detected: graph is not a DAG"


# --- flow control ----------------------------------------------------------------------------------


def test_flow_control_section_is_decoded_and_defaults_filled() -> None:
    cfg = load(
        """
featureGates: [flowControl]
plugins: [{name: ord, type: test-policy}]
flowControl:
  maxBytes: 1Gi
  maxRequests: 1k
  defaultRequestTTL: 1m30s
  priorityBands:
  - {priority: 10, maxBytes: 500M, orderingPolicyRef: ord}
  - {priority: -1}
"""
    )
    fc = cfg.document.flow_control
    assert fc is not None
    assert fc.max_bytes is not None and fc.max_bytes.value == 2**30
    assert fc.max_requests is not None and fc.max_requests.value == 1000
    assert fc.default_request_ttl is not None and fc.default_request_ttl.seconds == 90.0
    first, second = fc.priority_bands
    assert first.max_bytes is not None and first.max_bytes.value == 500_000_000
    assert first.ordering_policy_ref == "ord"
    assert second.max_bytes is not None and second.max_bytes.value == 1_000_000_000
    assert second.max_requests is not None and second.max_requests.value == 5000
    assert fc.enable_eviction is False


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", 2**30),
        ("1k", 1000),
        ("500M", 500_000_000),
        ("1.5Ki", 1536),
        ("1e3", 1000),
        (42, 42),
        ("500m", 1),
    ],
)
def test_quantities(text: Any, value: int) -> None:
    q = parse_quantity(text, "x")
    assert q is not None and q.value == value


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("1h30m", 5400.0), ("200ms", 0.2), ("0", 0.0), ("-5s", -5.0)]
)
def test_durations(text: str, seconds: float) -> None:
    d = parse_duration(text, "x")
    assert d is not None and d.seconds == pytest.approx(seconds)


def test_a_config_without_any_scheduling_gets_the_default_profile() -> None:
    """Only data-layer plugins: the default scheduling, not a random pick (differs from the reference)."""
    cfg = load("plugins: [{type: metrics-data-source}]\n")
    summary = profile_summary(cfg)["default"]
    assert summary["scorers"] == [("prefix-spread-scorer", 1.0)]
    assert [p.type_name for p in cfg.producers] == ["approx-prefix-cache-producer"]


def test_a_config_with_its_own_scorer_but_no_profiles_keeps_the_reference_behaviour() -> None:
    cfg = load("plugins: [{type: kv-cache-utilization-scorer}]\n")
    assert profile_summary(cfg)["default"]["scorers"] == [("kv-cache-utilization-scorer", 1.0)]
