"""The built-in default configuration and the type names of system defaults.

The reference default document (scheduling.md §3.3) is::

    plugins: queue-scorer, kv-cache-utilization-scorer, prefix-cache-scorer,
             metrics-data-source, core-metrics-extractor
    schedulingProfiles: default = queue-scorer w2 + kv-cache-utilization-scorer w2 + prefix-cache-scorer w3
    dataLayer.sources: metrics-data-source with core-metrics-extractor

``default_document()`` builds it from the types registered *now*: a type that is not registered in
this build (``prefix-cache-scorer`` and its ``approx-prefix-cache-producer``, the data-layer plugins,
while they are being written) is left out instead of making the default configuration unloadable.
The same rule applies to the other system defaults (flow-control policies, the
``utilization-detector`` saturation detector): the loader instantiates a default only when its type
is registered. The parser is the exception: a working EPP needs one, so a missing ``openai-parser``
is a configuration error on ``parser.pluginRef``.

The saturation detector is not part of this document: without a ``saturationDetector`` section the
loader uses the ``utilization-detector`` instance declared under ``plugins`` or creates one with the
defaults (queue 5, KV 0.8, staleness 200ms), for legacy admission only (it is no filter there).
"""

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
PREFIX_CACHE_SCORER = "prefix-cache-scorer"
APPROX_PREFIX_PRODUCER = "approx-prefix-cache-producer"

DEFAULT_FAIRNESS_POLICY = "global-strict-fairness-policy"
DEFAULT_ORDERING_POLICY = "fcfs-ordering-policy"
DEFAULT_USAGE_LIMIT_POLICY = "static-usage-limit-policy"
# Instantiated (when registered) even with flow control off, as in the reference.
FLOW_CONTROL_DEFAULTS = (DEFAULT_ORDERING_POLICY, DEFAULT_FAIRNESS_POLICY, DEFAULT_USAGE_LIMIT_POLICY)
# Band defaults (scheduling.md §3.1): 1 GB per band, unlimited requests.
DEFAULT_BAND_MAX_BYTES = 1_000_000_000
DEFAULT_BAND_MAX_REQUESTS = 0

# Data key -> producer type auto-created when some plugin consumes the key and none produces it
# (scheduling.md §1.8). Both the reference's key-constant names and the attribute names are listed.
AUTO_PRODUCERS: dict[str, str] = {
    "PrefixCacheMatchInfoKey": APPROX_PREFIX_PRODUCER,
    "PrefixCacheMatchInfo": APPROX_PREFIX_PRODUCER,
    "InFlightLoadKey": "inflight-load-producer",
    "InFlightLoad": "inflight-load-producer",
    "LatencyPredictionInfoKey": "predicted-latency-producer",
    "LatencyPredictionInfo": "predicted-latency-producer",
}

# (type, weight) of the default profile's scorers.
_DEFAULT_SCORERS: tuple[tuple[str, float], ...] = (
    ("queue-scorer", 2.0),
    ("kv-cache-utilization-scorer", 2.0),
    (PREFIX_CACHE_SCORER, 3.0),
)


def _registered(type_name: str) -> bool:
    return registry.lookup(type_name) is not None


def default_document() -> dict[str, Any]:
    """The default ``EndpointPickerConfig`` as a raw document, limited to registered types.

    ``prefix-cache-scorer`` is included only once it is registered; its producer
    (``approx-prefix-cache-producer``) is then listed explicitly when registered, which is what the
    reference's automatic producer creation yields.
    """
    scorers = [(t, w) for t, w in _DEFAULT_SCORERS if _registered(t)]
    plugins: list[dict[str, Any]] = [{"type": t} for t, _ in scorers]
    if any(t == PREFIX_CACHE_SCORER for t, _ in scorers) and _registered(APPROX_PREFIX_PRODUCER):
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
