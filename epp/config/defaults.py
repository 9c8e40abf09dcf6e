"""The built-in default configuration and the type names of system defaults."""

from __future__ import annotations

from typing import Any

from epp.config.schema import API_VERSION, KIND
from epp.framework import registry

DEFAULT_PROFILE_NAME = "default"
SINGLE_PROFILE_HANDLER = "single-profile-handler"
DEFAULT_PICKER = "max-score-picker"
DEFAULT_PARSER = "openai-parser"
DEFAULT_SATURATION_DETECTOR = "utilization-detector"  # epp.plugins.saturation.utilization_detector
METRICS_DATA_SOURCE = "metrics-data-source"
CORE_METRICS_EXTRACTOR = "core-metrics-extractor"
MODELS_DATA_SOURCE = "models-data-source"
MODELS_DATA_EXTRACTOR = "models-data-extractor"
PREFIX_CACHE_SCORER = "prefix-cache-scorer"
PREFIX_SPREAD_SCORER = "prefix-spread-scorer"
APPROX_PREFIX_PRODUCER = "approx-prefix-cache-producer"
# Added to every configuration that declares none (epp.config.request_control.apply_health_default).
ENDPOINT_HEALTH_FILTER = "endpoint-health-filter"

DEFAULT_FAIRNESS_POLICY = "global-strict-fairness-policy"
DEFAULT_ORDERING_POLICY = "fcfs-ordering-policy"
DEFAULT_USAGE_LIMIT_POLICY = "static-usage-limit-policy"
# Instantiated (when registered) even with flow control off, as in the reference.
FLOW_CONTROL_DEFAULTS = (DEFAULT_ORDERING_POLICY, DEFAULT_FAIRNESS_POLICY, DEFAULT_USAGE_LIMIT_POLICY)
# Band defaults (also for "0"): 1 GB and 5000 requests per band.
DEFAULT_BAND_MAX_BYTES = 1_000_000_000
DEFAULT_BAND_MAX_REQUESTS = 5000
# Queue-wait budget while the pool has endpoints; the no-endpoint budget follows it when unset.
DEFAULT_REQUEST_TTL = "60s"

# Data key -> producer type auto-created when some plugin consumes the key and none produces it.
# Both the reference's key-constant names and the attribute names are listed.
AUTO_PRODUCERS: dict[str, str] = {
    "PrefixCacheMatchInfoKey": APPROX_PREFIX_PRODUCER,
    "PrefixCacheMatchInfo": APPROX_PREFIX_PRODUCER,
    "InFlightLoadKey": "inflight-load-producer",
    "InFlightLoad": "inflight-load-producer",
    "LatencyPredictionInfoKey": "predicted-latency-producer",
    "LatencyPredictionInfo": "predicted-latency-producer",
    "TokenizedPrompt": "token-producer",
    "MultiModalEncoderCacheMatchInfoKey": "mm-embeddings-cache-producer",
}

# (type, weight) of the default profile's scorers: prefix affinity under a bounded load, new prompts
# spread (the configuration that won every workload of `make bench-routing`, docs/plugins.md).
_DEFAULT_SCORERS: tuple[tuple[str, float], ...] = ((PREFIX_SPREAD_SCORER, 1.0),)
# The reference's default profile, used by a build without prefix-spread-scorer.
REFERENCE_DEFAULT_SCORERS: tuple[tuple[str, float], ...] = (
    ("queue-scorer", 2.0),
    ("kv-cache-utilization-scorer", 2.0),
    (PREFIX_CACHE_SCORER, 3.0),
)
_PREFIX_CONSUMERS = (PREFIX_CACHE_SCORER, PREFIX_SPREAD_SCORER)


def _registered(type_name: str) -> bool:
    return registry.lookup(type_name) is not None


def default_document() -> dict[str, Any]:
    """The default ``EndpointPickerConfig`` as a raw document, limited to registered types.

    ``prefix-spread-scorer`` (weight 1) in profile ``default`` (without it in this build, the
    reference's: queue and KV-cache scorers, weight 2, and ``prefix-cache-scorer``, weight 3), and
    ``metrics-data-source`` with ``core-metrics-extractor``. A type not registered in this build is
    left out instead of making the default unloadable. The prefix producer is listed explicitly,
    which is what automatic producer creation would yield.
    """
    scorers = [(t, w) for t, w in _DEFAULT_SCORERS if _registered(t)]
    if not scorers:
        scorers = [(t, w) for t, w in REFERENCE_DEFAULT_SCORERS if _registered(t)]
    plugins: list[dict[str, Any]] = [{"type": t} for t, _ in scorers]
    if any(t in _PREFIX_CONSUMERS for t, _ in scorers) and _registered(APPROX_PREFIX_PRODUCER):
        plugins.append({"type": APPROX_PREFIX_PRODUCER})
    data_layer: dict[str, Any] = {"sources": []}
    if _registered(METRICS_DATA_SOURCE):
        plugins.append({"type": METRICS_DATA_SOURCE})
        source: dict[str, Any] = {"pluginRef": METRICS_DATA_SOURCE, "extractors": []}
        if _registered(CORE_METRICS_EXTRACTOR):
            plugins.append({"type": CORE_METRICS_EXTRACTOR})
            source["extractors"].append({"pluginRef": CORE_METRICS_EXTRACTOR})
        data_layer["sources"].append(source)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "featureGates": [],
        "plugins": plugins,
        "schedulingProfiles": [
            {
                "name": DEFAULT_PROFILE_NAME,
                "plugins": [{"pluginRef": t, "weight": w} for t, w in scorers],
            }
        ],
        "dataLayer": data_layer,
    }


CROSS_REPLICA_SYNC_INTERVAL = 0.1  # seconds: dataLayer.crossReplicaSyncInterval when unset
