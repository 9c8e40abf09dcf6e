"""``epp check-config`` prints the values each plugin uses: every registered type, built with its
defaults, renders effective parameters without a null or empty value that stands for another
default (keys kept only to migrate older configurations are left out while unset), and the rendered
parameters load again into the same effective parameters."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import epp.plugins  # noqa: F401 - registers the built-in types
from epp.config import load_config
from epp.config.effective import effective_params
from epp.framework import registry
from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import Plugin
from epp.framework.params import decode_params

NO_ENV: dict[str, str] = {}


def _required(tmp: Path) -> dict[str, dict[str, Any]]:
    """The least a type needs to be built (it has required parameters)."""
    endpoints = tmp / "endpoints.yaml"
    endpoints.write_text("endpoints: []\n")
    return {
        "by-label": {"label": "role", "allowsNoLabel": True},
        "disaggregatedset-rollout-screener": {
            "scope": {"labelSelector": "app=x"},
            "revisionGating": {"mode": "disabled"},
        },
        "endpoint-attribute-filter": {
            "attribute": "a",
            "algorithm": {"type": "threshold", "threshold": {"operator": "LessThanOrEqual", "value": 1}},
        },
        "endpoint-attribute-scorer": {"attributeKey": "a", "algorithm": {"type": "linear_lower_is_better"}},
        "file-discovery": {"path": str(endpoints)},
        "multicluster-file-discovery": {"path": str(endpoints)},
        "header-label-affinity-scorer": {"headerName": "x-h", "labelKey": "k"},
        "k8s-notification-source": {"version": "v1", "kind": "ConfigMap"},
        "priority-holdback-policy": {"minCeiling": 0.5},
        "request-attribute-reporter": {
            "attributes": [{"key": {"namespace": "n", "name": "k"}, "expression": "usage.total_tokens"}]
        },
        "session-id-producer": {"headerName": "x-session"},
        "utilization-filter": {"conditions": [{"metric": "waiting-queue", "maxValue": 5}]},
    }


# An empty value that is the value used: (type or "*", dotted key path) -> what it means.
EMPTY_MEANS_NONE: dict[tuple[str, str], str] = {
    ("*", "caCertPath"): "no CA file: the system roots",
    ("*", "clientCertPath"): "no client certificate",
    ("*", "clientKeyPath"): "no client key",
    ("*", "profileName"): "no profile named: the primary profile",
    ("k8s-notification-source", "group"): "the core API group",
    ("request-attribute-reporter", "attributes[0].condition"): "no condition: always reported",
    ("disagg-profile-handler", "deciders.prefill"): "no prefill decider: the stage never runs",
    ("disagg-profile-handler", "deciders.encode"): "no encode decider: the stage never runs",
    ("inflight-load-producer", "maxEstimatedOutputTokens"): "no cap",
    ("precise-prefix-cache-producer", "tokenProcessorConfig.hashSeed"): "no seed, as vLLM's default",
    ("precise-prefix-cache-producer", "kvEventsConfig.zmqEndpoint"): "no central socket: one per endpoint",
    ("predicted-latency-producer", "endpointRoleLabel"): "no role label: no endpoint is a prefill one",
    ("redis-syncer", "username"): "no user",
    ("redis-syncer", "passwordEnv"): "no password",
    ("redis-syncer", "passwordFile"): "no password",
}


def _empty_means_none(type_name: str, path: str) -> bool:
    if path.endswith(("ProducerName", "producerName")):
        return True  # no producer named: whichever produces the data key (created when missing)
    return (type_name, path) in EMPTY_MEANS_NONE or ("*", path.rsplit(".", 1)[-1]) in EMPTY_MEANS_NONE


class _Handle:
    """A factory handle whose plugins are types built with their defaults."""

    def plugin(self, name: str) -> Plugin | None:
        cls = registry.lookup(name)
        return None if cls is None else cls(name, decode_params(cls.Params, {}, name), self)

    def endpoints(self) -> Sequence[Endpoint]:
        return ()


def _types() -> list[str]:
    return [t for t in registry.registered_types() if registry.lookup(t).type_name == t]  # type: ignore[union-attr]


def _build(type_name: str, tmp: Path, raw: dict[str, Any] | None = None) -> Plugin:
    cls = registry.lookup(type_name)
    assert cls is not None
    given = _required(tmp).get(type_name, {}) if raw is None else raw
    return cls(type_name, decode_params(cls.Params, given, "parameters"), _Handle())


def _empties(value: Any, path: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _empties(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _empties(v, f"{path}[{i}]")
    elif value is None or value == "":
        yield path


@pytest.mark.parametrize("type_name", _types())
def test_effective_parameters_print_the_defaults_used(type_name: str, tmp_path: Path) -> None:
    params = effective_params(_build(type_name, tmp_path).params)
    bad = [p for p in _empties(params) if not _empty_means_none(type_name, p)]
    assert not bad, f"{type_name} prints null or '' for {bad}: print the default used or omit the key"


@pytest.mark.parametrize("type_name", _types())
def test_effective_parameters_load_again_unchanged(type_name: str, tmp_path: Path) -> None:
    params = effective_params(_build(type_name, tmp_path).params)
    again = effective_params(_build(type_name, tmp_path, params).params)
    assert again == params


def _effective_plugin(text: str, name: str) -> dict[str, Any]:
    import yaml

    doc = yaml.safe_load(load_config(text, environ=NO_ENV).effective_yaml())
    (entry,) = [p for p in doc["plugins"] if p["name"] == name]
    return entry.get("parameters", {})


HEAD = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"


def test_the_default_prefix_scorer_prints_no_producer_keys() -> None:
    params = _effective_plugin(HEAD, "prefix-spread-scorer")  # the default profile's prefix consumer
    assert "blockSizeTokens" not in params and "autoTune" not in params and None not in params.values()
    assert params["loadBound"] == 1.25 and params["loadBoundMin"] == 8
    params = _effective_plugin(HEAD + "plugins:\n- type: prefix-cache-scorer\n", "prefix-cache-scorer")
    assert "blockSizeTokens" not in params and "autoTune" not in params and None not in params.values()
    producer = _effective_plugin(HEAD, "approx-prefix-cache-producer")
    assert producer["blockSizeTokens"] == 16 and producer["lruCapacityPerServer"] == 31250
    assert "blockSize" not in producer


def test_producer_keys_given_on_the_prefix_scorer_are_printed() -> None:
    text = HEAD + "plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: 32}\n"
    assert _effective_plugin(text, "prefix-cache-scorer")["blockSizeTokens"] == 32


def test_precise_producer_prints_its_hash_algorithm_block_size_and_ttl() -> None:
    text = HEAD + (
        "plugins:\n- type: precise-prefix-cache-producer\n  parameters:\n"
        "    tokenProcessorConfig: {hashAlgorithm: ''}\n    speculativeTTL: 0s\n"
    )
    params = _effective_plugin(text, "precise-prefix-cache-producer")
    assert params["tokenProcessorConfig"]["hashAlgorithm"] == "cbor-fnv"
    assert params["tokenProcessorConfig"]["blockSizeTokens"] == 16
    assert params["speculativeTTL"] == "2s"
    assert "redisConfig" not in params["indexerConfig"]["kvBlockIndexConfig"]


def test_metrics_source_leaves_out_what_comes_from_the_command_line() -> None:
    params = _effective_plugin(HEAD, "metrics-data-source")
    assert "interval" not in params and "port" not in params
    text = HEAD + "plugins:\n- type: metrics-data-source\n  parameters: {interval: 2s, port: 9100}\n"
    params = _effective_plugin(text, "metrics-data-source")
    assert params["interval"] == "2s" and params["port"] == 9100


def test_token_producer_prints_its_backend_only() -> None:
    text = HEAD + "plugins:\n- type: token-producer\n  parameters: {modelName: m}\n"
    params = _effective_plugin(text, "token-producer")
    assert params == {
        "modelName": "m",
        "vllm": {"url": "http://localhost:8000", "timeout": "5s", "mmTimeout": "30s"},
    }


def test_token_producer_estimate_prints_its_built_in_defaults() -> None:
    text = HEAD + "plugins:\n- type: token-producer\n  parameters: {estimate: {image: {mode: static}}}\n"
    estimate = _effective_plugin(text, "token-producer")["estimate"]
    assert estimate["image"] == {
        "mode": "static",
        "defaultResolution": {"width": 640, "height": 360},
        "static": {"staticToken": 1},
    }
    assert estimate["video"]["tokensPerFrame"] == {"mode": "dynamic", "dynamic": {"factor": 1024}}
    assert estimate["video"]["frames"]["sampled"] == {"sampleFPS": 2.0, "temporalPatchSize": 0}


def test_the_printed_estimate_estimates_as_the_default_does() -> None:
    from epp.plugins.producers._token_estimate import (
        EstimateParams,
        ImageEstimator,
        VideoEstimator,
        VideoMeta,
    )

    printed = decode_params(EstimateParams, effective_params(EstimateParams()), "estimate")
    image, image_again = ImageEstimator(None), ImageEstimator(printed.image)
    for size in (None, (1280, 720), (10, 10)):
        assert image.count(size) == image_again.count(size)
    video, video_again = VideoEstimator(None), VideoEstimator(printed.video)
    for meta in (VideoMeta(), VideoMeta(duration=3.0, fps=30.0, width=320, height=240)):
        assert video.count(meta) == video_again.count(meta)
