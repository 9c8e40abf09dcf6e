"""Every EndpointPickerConfig of the reference (the corpus under ../shared, see tests/llm_d_corpus.py)
does in epp what tests/data/llm_d_configs/EXPECTED.yaml says: it loads, loads only with experimental
plugins allowed, is rejected naming a field, or waits for a plugin type epp does not have yet.

The reference's own loader tests register mock plugin types (``test-plugin``, ``test-scorer``...)
and a ``test-feature-gate``; the ``*-with-mocks`` classes are loaded with equivalents registered
here, so those configurations load, or are rejected, for the reason the reference tests.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config import ConfigError, LoadedConfig, load_config, load_config_file
from epp.config.schema import FEATURE_GATES
from epp.framework import registry
from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import (
    DataSource,
    Extractor,
    Filter,
    Handle,
    Picker,
    Plugin,
    Profile,
    ProfileHandler,
    Scorer,
    Stability,
)
from epp.framework.request import LLMRequest
from epp.framework.results import (
    CycleState,
    ProfileRunResult,
    SchedulingOutcome,
    ScoredEndpoint,
)
from tests.llm_d_corpus import EXPECTED, EXPECTED_FILE, config_path, corpus_keys, needs_corpus

pytestmark = needs_corpus
NO_ENV: dict[str, str] = {}
FLAG = "--allow-experimental-plugins"
SOURCE_LINE = "# source: llm-d/llm-d-router "

CLASSES = (
    "load",
    "experimental",
    "load-with-mocks",
    "experimental-with-mocks",
    "reject",
    "reject-with-mocks",
    "needs-type",
    "conversion-pair-with-mocks",
)


def _class_of(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    keys = [k for k in entry if k in CLASSES]
    assert len(keys) == 1, entry
    return keys[0]


def _names(cls: str) -> list[str]:
    return sorted(name for name, entry in EXPECTED.items() if _class_of(entry) == cls)


def _path(name: str) -> str:
    return str(config_path(name))


# --- the reference's test-mock plugin types -----------------------------------------------------------


class _MockPlugin(Plugin):
    """``test-plugin``: a plugin of no particular kind (it sits in a profile without a role)."""

    type_name = "test-plugin"

    @dataclass(slots=True, frozen=True)
    class Params:
        threshold: int = 0


class _MockScorer(Scorer):
    type_name = "test-scorer"

    @dataclass(slots=True, frozen=True)
    class Params:
        block_size: int = 0

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        return [0.0] * len(endpoints)


class _MockPicker(Picker):
    type_name = "test-picker"

    def pick(self, cycle: CycleState, request: LLMRequest, scored: list[ScoredEndpoint]) -> ProfileRunResult:
        raise AssertionError("never scheduled")


class _MockOrderFilter(Filter):
    type_name = "test-order-filter"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return endpoints


class _MockHandler(ProfileHandler):
    type_name = "test-profile-handler"

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, Profile],
        results: Any,
    ) -> Mapping[str, Profile]:
        return {}

    def process_results(
        self, cycle: CycleState, request: LLMRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingOutcome:
        raise AssertionError("never scheduled")


def _require(handle: Handle | None, name: str) -> Plugin:
    dependency = handle.plugin(name) if handle is not None else None
    if dependency is None:
        raise ValueError(f"failed to find dependency {name}")
    return dependency


class _MockWithDependencies(_MockHandler):
    """A profile handler whose parameters name other plugins; it fetches them while being created."""

    type_name = "test-with-dependencies"

    @dataclass(slots=True, frozen=True)
    class Params:
        dependency: str = ""
        pointed_to: str | None = None

    def __init__(self, name: str, params: Any, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.dependencies = [_require(handle, params.dependency)]
        if params.pointed_to is not None:
            self.dependencies.append(_require(handle, params.pointed_to))


@dataclass(slots=True, frozen=True)
class _Nested:
    dependency: str = ""


class _MockWithNestedDependencies(_MockHandler):
    type_name = "test-with-nested-dependencies"

    @dataclass(slots=True, frozen=True)
    class Params:
        nested: _Nested = field(default_factory=_Nested)
        nested_ptr: _Nested | None = None
        extras: tuple[str, ...] = ()
        pointed_to: str | None = None

    def __init__(self, name: str, params: Any, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        names = [params.nested.dependency, *params.extras]
        if params.nested_ptr is not None:
            names.append(params.nested_ptr.dependency)
        if params.pointed_to is not None:
            names.append(params.pointed_to)
        self.dependencies = [_require(handle, n) for n in names]


class _MockSource(DataSource):
    type_name = "test-source"


class _MockExtractor(Extractor):
    type_name = "test-extractor"


class _MockMetricsSource(DataSource):
    """``mock-metrics-source``: the metrics data source the reference's integration harness injects."""

    type_name = "mock-metrics-source"


class _MockAlpha(Plugin):
    """``alpha-test-plugin``: an alpha type, refused without --allow-experimental-plugins."""

    type_name = "alpha-test-plugin"
    stability = Stability.ALPHA


class _MockAlphaAllowed(_MockAlpha):
    type_name = "alpha-test-plugin-allowed"


class _MockSyncer(Plugin):
    """``local-syncer``: the in-process cross-replica syncer of the reference's conversion test (one
    replica alone: it shares nothing, as ``CrossReplicaSyncer`` allows)."""

    type_name = "local-syncer"
    replica_id = "local"

    def bind(self, pool: str, publish_timeout: float) -> None:
        pass

    def skip(self, reason: str, n: int = 1) -> None:
        pass

    def set(self, key: str, endpoint: str, value: Any) -> None:
        pass

    def delete(self, key: str, endpoint: str) -> None:
        pass

    def get(self, key: str, endpoint: str, aggregate: Any, *, include_self: bool = True) -> Any:
        return None

    def peer_values(self, key: str) -> dict[str, list[Any]]:
        return {}

    def append(self, key: str, records: list[Any]) -> None:
        pass

    def subscribe(self, key: str) -> None:
        pass

    def take_records(self, key: str) -> list[Any]:
        return []

    def peers(self) -> frozenset[str]:
        return frozenset()

    async def sync(self) -> None:
        pass

    async def close(self) -> None:
        pass


class _MockOne(Plugin):
    """``test-one`` and ``test-two``: plain plugins of the reference's config-loader test file."""

    type_name = "test-one"

    @dataclass(slots=True, frozen=True)
    class Params:
        threshold: int = 0


class _MockTwo(_MockScorer):
    type_name = "test-two"


MOCKS: tuple[type[Plugin], ...] = (
    _MockPlugin,
    _MockScorer,
    _MockPicker,
    _MockOrderFilter,
    _MockHandler,
    _MockWithDependencies,
    _MockWithNestedDependencies,
    _MockSource,
    _MockExtractor,
    _MockMetricsSource,
    _MockAlpha,
    _MockAlphaAllowed,
    _MockSyncer,
    _MockOne,
    _MockTwo,
)
TEST_GATE = "test-feature-gate"


@pytest.fixture
def mocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The reference loader tests' mock types and gate, registered for one test only."""
    for cls in MOCKS:
        assert registry.lookup(cls.type_name) is None, f"{cls.type_name} is a real type now"
    monkeypatch.setitem(FEATURE_GATES, TEST_GATE, True)  # registered on by default, as there
    for cls in MOCKS:
        registry.register(cls)
    try:
        yield
    finally:
        for cls in MOCKS:
            registry._REGISTRY.pop(cls.type_name, None)


# --- the corpus -------------------------------------------------------------------------------------


def test_every_config_has_exactly_one_expectation() -> None:
    files = corpus_keys()
    assert files == sorted(EXPECTED)
    text = EXPECTED_FILE.read_text()
    keys = [line.split(":", 1)[0] for line in text.splitlines() if line and not line.startswith(("#", " "))]
    assert len(keys) == len(set(keys)), "a config is listed twice"
    for name in files:
        if name.startswith("project-corpus/"):
            assert Path(_path(name)).read_text().startswith(SOURCE_LINE), name
        _class_of(EXPECTED[name])


def _same_shape(cfg: LoadedConfig, allow_experimental: bool) -> None:
    """The effective document loads again into the same plugins and profiles."""
    again = load_config(cfg.effective_yaml(), environ=NO_ENV, allow_experimental=allow_experimental)
    assert list(again.plugins) == list(cfg.plugins)
    assert {n: type(p) for n, p in again.plugins.items()} == {n: type(p) for n, p in cfg.plugins.items()}
    assert list(again.scheduler.profiles) == list(cfg.scheduler.profiles)
    assert again.feature_gates == cfg.feature_gates


def _parsers(*names: str) -> Callable[[LoadedConfig], None]:
    def check(cfg: LoadedConfig) -> None:
        assert [p.name for p in cfg.parsers.parsers] == list(names)

    return check


def _default_handler(cfg: LoadedConfig) -> None:
    assert cfg.scheduler.handler.type_name == "single-profile-handler"
    assert cfg.scheduler.handler is cfg.plugins["single-profile-handler"]


def _defaults_injected(cfg: LoadedConfig) -> None:
    sources = [(s.name, [e.name for e in x]) for s, x in cfg.data_sources]
    assert sources == [("metrics-data-source", ["core-metrics-extractor"])]
    # no parser configured: the three defaults, then the passthrough fallback
    _parsers("openai-parser", "anthropic-parser", "vllmhttp-parser", "passthrough-parser")(cfg)
    assert cfg.parsers.fallback is cfg.plugins["passthrough-parser"]


def _all_defaults(cfg: LoadedConfig) -> None:
    _default_handler(cfg)
    _defaults_injected(cfg)


# What the reference's own loader tests check of these configurations (no mocks needed).
LOAD_CHECKS: dict[str, Callable[[LoadedConfig], None]] = {
    "project-corpus/testdata_test-successParserConfigText": _parsers("openai-parser"),
    "project-corpus/testdata_test-successParserWithNameConfigText": _parsers("openaiParser"),
    "project-corpus/testdata_test-successMultipleParsersConfigText": _parsers(
        "openai-parser", "secondParser"
    ),
    "project-corpus/testdata_test-successExplicitPassthroughConfigText": _parsers(
        "openai-parser", "myFallback"
    ),
    "project-corpus/testdata_test-successDeprecatedTopLevelParserText": _parsers("openai-parser"),
    # also the reference's successWithNoParserConfigText and successDataLayerAutoDefaultText (same text)
    "project-corpus/testdata_test-successWithNoProfileHandlersText": _all_defaults,
    "project-corpus/testdata_test-successDataLayerNoSourcesText": _defaults_injected,
}


@pytest.mark.parametrize("name", _names("load"))
def test_config_loads(name: str) -> None:
    cfg = load_config_file(_path(name), environ=NO_ENV, allow_experimental=False)
    _same_shape(cfg, allow_experimental=False)
    check = LOAD_CHECKS.get(name)
    if check is not None:
        check(cfg)


def _profile(cfg: LoadedConfig, index: int = 0) -> list[tuple[str, float | None]]:
    profile = yaml.safe_load(cfg.effective_yaml())["schedulingProfiles"][index]
    return [(p["pluginRef"], p.get("weight")) for p in profile["plugins"]]


def _full_config(cfg: LoadedConfig) -> None:
    assert _profile(cfg) == [("test1", None), ("test-scorer", 50.0), ("testPicker", None)]
    assert {TEST_GATE, "flowControl"} <= cfg.feature_gates
    assert cfg.scheduler.handler is cfg.plugins["profileHandler"]


def _deprecated_group(cfg: LoadedConfig) -> None:
    _full_config(cfg)
    old = "apiVersion 'inference.networking.x-k8s.io/v1alpha1' is deprecated"
    assert any(w.startswith(old) for w in cfg.warnings)


def _no_profiles(cfg: LoadedConfig) -> None:
    assert TEST_GATE not in cfg.feature_gates and "flowControl" not in cfg.feature_gates
    assert f"{TEST_GATE}=false" in yaml.safe_load(cfg.effective_yaml())["featureGates"]


def _scheduler_config(cfg: LoadedConfig) -> None:
    assert _profile(cfg) == [("testScorer", 50.0), ("maxScorePicker", None)]  # no second picker
    assert cfg.saturation_detector is not None  # defaulted


def _no_weight(cfg: LoadedConfig) -> None:
    assert _profile(cfg) == [("testScorer", 1.0), ("max-score-picker", None)]


def _picker_first(cfg: LoadedConfig) -> None:
    assert _profile(cfg) == [("test-picker", None), ("test-scorer", 1.0)]


def _filter_order(cfg: LoadedConfig) -> None:
    refs = [ref for ref, _ in _profile(cfg)]
    assert refs == ["filter-A", "filter-B", "filter-C", "scorer-X", "scorer-Y", "maxScorePicker"]


def _explicit_data_layer(cfg: LoadedConfig) -> None:
    sources = [(s.name, [e.name for e in x]) for s, x in cfg.data_sources]
    assert sources == [("testSource", ["testExtractor"]), ("metrics-data-source", ["core-metrics-extractor"])]


def _needs(name: str, *deps: str) -> Callable[[LoadedConfig], None]:
    def check(cfg: LoadedConfig) -> None:
        plugin = cfg.plugins[name]
        assert isinstance(plugin, _MockWithDependencies | _MockWithNestedDependencies)
        assert [id(p) for p in plugin.dependencies] == [
            id(cfg.plugins[d]) for d in deps
        ]  # the very instances declared

    return check


# What the reference's own tests check of these configurations.
MOCK_CHECKS: dict[str, Callable[[LoadedConfig], None]] = {
    "project-corpus/testdata_test-successConfigText": _full_config,
    "project-corpus/testdata_test-successDeprecatedText": _deprecated_group,
    "project-corpus/testdata_test-successNoProfilesText": _no_profiles,
    "project-corpus/testdata_test-successSchedulerConfigText": _scheduler_config,
    "project-corpus/testdata_test-successWithNoWeightText": _no_weight,
    "project-corpus/testdata_test-successPickerBeforeScorerText": _picker_first,
    "project-corpus/testdata_test-successFilterOrderConfigText": _filter_order,
    "project-corpus/testdata_test-successDataLayerExplicitConfigText": _explicit_data_layer,
    "project-corpus/testdata_test-pluginsInOrderText": _needs("test-with-dependencies", "test1"),
    "project-corpus/testdata_test-pluginsOutOfOrderText": _needs("test-with-dependencies", "test1"),
    "project-corpus/testdata_test-pluginsRefedByPointerText": _needs(
        "test-with-dependencies", "test1", "test2"
    ),
    "project-corpus/testdata_test-pluginsRefedInNestedingText": _needs(
        "test-with-nested-dependencies", "test1", "test4", "test3", "test2", "test2"
    ),
}


@pytest.mark.parametrize("name", _names("load-with-mocks"))
def test_config_loads_with_the_reference_test_mocks(name: str, mocks: None) -> None:
    cfg = load_config_file(_path(name), environ=NO_ENV, allow_experimental=False)
    _same_shape(cfg, allow_experimental=False)
    check = MOCK_CHECKS.get(name)
    if check is not None:
        check(cfg)


def test_every_check_names_a_config_of_its_class() -> None:
    assert set(LOAD_CHECKS) <= set(_names("load"))
    assert set(MOCK_CHECKS) <= set(_names("load-with-mocks"))


@pytest.mark.parametrize("name", _names("experimental-with-mocks"))
def test_experimental_config_loads_with_the_mocks_only_when_allowed(name: str, mocks: None) -> None:
    _experimental(name)


def test_the_with_mocks_classes_need_the_mocks() -> None:
    for name in [*_names("load-with-mocks"), *_names("experimental-with-mocks")]:
        with pytest.raises(ConfigError) as info:
            load_config_file(_path(name), environ=NO_ENV)
        missing = [m.type_name for m in MOCKS if f"plugin type '{m.type_name}' is not" in info.value.reason]
        assert missing or f"'{TEST_GATE}' is unknown" in info.value.reason, (name, info.value)


@pytest.mark.parametrize("name", _names("experimental"))
def test_experimental_config_loads_only_when_allowed(name: str) -> None:
    _experimental(name)


def _experimental(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_file(_path(name), environ=NO_ENV, allow_experimental=False)
    assert FLAG in info.value.reason and "Alpha stability level" in info.value.reason
    cfg = load_config_file(_path(name), environ=NO_ENV, allow_experimental=True)
    _same_shape(cfg, allow_experimental=True)


def _check_rejected(name: str) -> None:
    entry = EXPECTED[name]
    cls = _class_of(entry)
    with pytest.raises(ConfigError) as info:
        load_config_file(_path(name), environ=NO_ENV, allow_experimental=True)
    assert info.value.field == entry[cls], info.value
    assert entry["reason"] in info.value.reason, info.value
    for mock in MOCKS:  # rejected for its own reason, not for a missing mock type
        assert f"plugin type '{mock.type_name}' is not registered" not in info.value.reason


@pytest.mark.parametrize("name", _names("reject"))
def test_invalid_config_is_rejected_naming_the_field(name: str) -> None:
    _check_rejected(name)


@pytest.mark.parametrize("name", _names("reject-with-mocks"))
def test_reference_error_config_is_rejected_for_its_reason(name: str, mocks: None) -> None:
    _check_rejected(name)


@pytest.mark.parametrize("name", _names("needs-type"))
def test_config_waits_for_a_missing_plugin_type(name: str, request: pytest.FixtureRequest) -> None:
    """When the type is implemented this fails: move the file to ``load`` (or ``experimental``)."""
    entry = EXPECTED[name]
    assert entry["for"], name
    if entry.get("mocks"):
        request.getfixturevalue("mocks")
    with pytest.raises(ConfigError) as info:
        load_config_file(_path(name), environ=NO_ENV, allow_experimental=True)
    assert f"plugin type '{entry['needs-type']}' is not registered" in info.value.reason, info.value


def test_check_config_command_loads_an_experimental_config_when_allowed() -> None:
    path = _path(_names("experimental")[0])
    run = [sys.executable, "-m", "epp", "check-config"]
    refused = subprocess.run([*run, path], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and FLAG in refused.stderr
    allowed = subprocess.run([*run, FLAG, path], capture_output=True, text=True, timeout=60)
    assert allowed.returncode == 0, allowed.stderr
    assert yaml.safe_load(allowed.stdout)["kind"] == "EndpointPickerConfig"


def test_the_mocks_are_gone_after_a_test() -> None:
    assert all(registry.lookup(cls.type_name) is None for cls in MOCKS)
    assert TEST_GATE not in FEATURE_GATES


@pytest.mark.parametrize("name", _names("conversion-pair-with-mocks"))
def test_a_v1alpha1_file_and_its_v1_twin_give_one_effective_config(
    name: str, mocks: None, tmp_path: Path
) -> None:
    twin = EXPECTED[name]["conversion-pair-with-mocks"]
    assert EXPECTED[twin]["conversion-pair-with-mocks"] == name
    loaded = {}
    for key in (name, twin):
        raw = yaml.safe_load(Path(_path(key)).read_text())
        for plugin in raw["plugins"]:
            if plugin["type"] == "file-discovery":  # created here, unlike in the reference's test
                plugin["parameters"] = {"path": str(tmp_path / "endpoints.yaml")}
        (tmp_path / "endpoints.yaml").write_text("endpoints: []\n")
        loaded[raw["apiVersion"]] = load_config(yaml.safe_dump(raw), environ=NO_ENV)
    old, new = loaded["llm-d.ai/v1alpha1"], loaded["llm-d.ai/v1"]
    assert old.effective_yaml() == new.effective_yaml()
    assert old.effective_yaml("llm-d.ai/v1alpha1") == new.effective_yaml("llm-d.ai/v1alpha1")
    effective = yaml.safe_load(new.effective_yaml())
    assert effective["dataLayer"]["crossReplica"] == {
        "syncerPluginRef": "syncer",
        "syncInterval": "500ms",
        "publishTimeout": "2s",
    }
    assert effective["dataLayer"]["discovery"] == {"endpoints": {"pluginRef": "my-disc"}}
    assert effective["requestHandler"]["propagatePriority"] is True
    assert new.discovery is new.plugins["my-disc"] and old.discovery is old.plugins["my-disc"]
    assert [w for w in old.warnings if "deprecated" in w] == [
        "apiVersion 'llm-d.ai/v1alpha1' is deprecated; use 'llm-d.ai/v1' "
        "(`epp check-config` prints this configuration converted to it)"
    ]
    assert not [w for w in new.warnings if "deprecated" in w]


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    """Deprecated type names warn once per process: this test sees them afresh."""
    saved = set(registry._WARNED)
    registry._WARNED.clear()
    try:
        yield
    finally:
        registry._WARNED.clear()
        registry._WARNED.update(saved)


def _loads_for_v011(name: str) -> ConfigError | None:
    try:
        load_config_file(_path(name), environ=NO_ENV, allow_experimental=True, compat_version="v0.11")
    except ConfigError as e:
        return e
    return None


@pytest.mark.parametrize("name", [*_names("load"), *_names("experimental")])
def test_a_loading_config_is_refused_for_v011_only_for_what_v011_removed(
    name: str, fresh_warnings: None
) -> None:
    """``--compat-version v0.11`` refuses a file that loads only for what v0.11 removed (naming the
    replacement), and the default load warned about exactly that field."""
    refused = _loads_for_v011(name)
    if refused is None:
        return
    assert "removed in router v0.11.0; use " in refused.reason or "was replaced by" in refused.reason, refused
    cfg = load_config_file(_path(name), environ=NO_ENV, allow_experimental=True)
    field_path = refused.field.rsplit(".parameters.", 1)[0].removesuffix(".type")
    assert any(w.startswith(field_path + ".") for w in cfg.warnings), (refused, cfg.warnings)


def test_the_e2e_precise_configs_load_and_check_config_refuses_them_for_v011() -> None:
    precise = [
        name
        for name in _names("load")
        if name.startswith("snapshot/test__e2e__")
        and "type: precise-prefix-cache-scorer" in Path(_path(name)).read_text()
    ]
    assert len(precise) == 2, precise  # the two configs of the reference's e2e suite
    run = [sys.executable, "-m", "epp", "check-config"]
    for name in precise:
        ok = subprocess.run([*run, _path(name)], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        warned = [line for line in ok.stderr.splitlines() if "'precise-prefix-cache-scorer'" in line]
        assert len(warned) == 1 and "removed in router v0.11.0" in warned[0], ok.stderr
        refused = subprocess.run(
            [*run, "--compat-version", "v0.11", _path(name)], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2
        assert "plugin type 'precise-prefix-cache-scorer' is not registered (removed in router v0.11.0" in (
            refused.stderr
        )


LOADING_CLASSES = {"load", "experimental", "load-with-mocks", "experimental-with-mocks"}


def _index_notes() -> dict[str, str]:
    """head/INDEX.tsv: the EXPECTED key of each file and the collector's note on it."""
    index = config_path("head/INDEX").with_suffix(".tsv")
    rows = [line.split("\t") for line in index.read_text().splitlines()[1:] if line]
    return {f"head/{row[0].removesuffix('.yaml')}": row[2] for row in rows if row[0].endswith(".yaml")}


def test_what_the_reference_loads_epp_loads_and_what_it_rejects_epp_rejects() -> None:
    """The head/ index notes which files the reference loads ("valid...", "in-tree types") and which
    its tests expect the loader to reject; EXPECTED.yaml agrees with each."""
    notes = _index_notes()
    assert notes and set(notes) <= set(EXPECTED)
    loads = [k for k, note in notes.items() if note.startswith(("valid", "in-tree types"))]
    rejects = [k for k, note in notes.items() if note.startswith("reference test expects")]
    assert len(loads) >= 35 and len(rejects) >= 25
    assert [k for k in loads if _class_of(EXPECTED[k]) not in LOADING_CLASSES] == []
    assert [k for k in rejects if not _class_of(EXPECTED[k]).startswith("reject")] == []
