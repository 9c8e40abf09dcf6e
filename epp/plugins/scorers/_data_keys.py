"""Keys of data produced by other plugins: named producers, and endpoint attributes.

Per-request data is keyed by its type in the cycle state (one producer per type and request), so a
``...ProducerName`` parameter is checked at load: the named plugin must be declared earlier and
produce that type. Endpoint attributes (``Endpoint.attributes``, written by data-layer extractors)
are keyed ``"<attribute>/<producer>"``, e.g. ``GPUUtilization/dcgm-extractor``.
"""

from __future__ import annotations

from epp.framework import ConfigError, DataProducer, Endpoint, Handle
from epp.framework.attributes import (
    INFLIGHT_LOAD_KEY,
    LATENCY_PREDICTION_INFO_KEY,
    PREFIX_CACHE_MATCH_INFO_KEY,
)
from epp.framework.endpoint_attributes import CORE_METRICS_EXTRACTOR, data_key

__all__ = [
    "as_number",
    "check_producer",
    "check_producers",
    "endpoint_key_or_error",
    "read_scalar",
    "resolve_attribute_key",
]


def check_producer(handle: Handle | None, field: str, name: str, data_key: str) -> None:
    """ConfigError at ``field`` unless ``name`` is empty or names a plugin declared earlier that
    produces ``data_key``."""
    if not name or handle is None:
        return
    plugin = handle.plugin(name)
    if plugin is None:
        raise ConfigError(
            field, f"producer plugin '{name}' not found (it must be declared before this plugin)"
        )
    produces = plugin.produces if isinstance(plugin, DataProducer) else frozenset()
    if data_key not in produces:
        raise ConfigError(field, f"plugin '{name}' ({plugin.type_name}) does not produce {data_key}")


# (Params attribute, parameter name, the data key the named producer must produce)
_PRODUCER_FIELDS = (
    ("prefix_match_info_producer_name", "prefixMatchInfoProducerName", PREFIX_CACHE_MATCH_INFO_KEY),
    ("in_flight_load_producer_name", "inFlightLoadProducerName", INFLIGHT_LOAD_KEY),
    (
        "latency_prediction_info_producer_name",
        "latencyPredictionInfoProducerName",
        LATENCY_PREDICTION_INFO_KEY,
    ),
)


def check_producers(handle: Handle | None, params: object) -> None:
    """``check_producer`` for every ``...ProducerName`` parameter that ``params`` has."""
    for attr, field, key in _PRODUCER_FIELDS:
        name = getattr(params, attr, None)
        if isinstance(name, str):
            check_producer(handle, field, name, key)


def endpoint_key_or_error(attribute: str, producer: str | None) -> str | None:
    """A reason when the attribute cannot be addressed, else None (see ``resolve_attribute_key``)."""
    if producer is None and "/" in attribute:
        head, _, tail = attribute.rpartition("/")
        return (
            f'attribute "{attribute}" contains "/" but no producer is set: the attribute and its '
            f'producer are separate parameters (attribute: "{head}", producer: "{tail}"); if the '
            'name itself contains "/", set producer explicitly'
        )
    return None


def resolve_attribute_key(attribute: str, producer: str | None) -> str:
    """The key read for ``attribute``: omitted producer = the core metrics extractor."""
    return data_key(attribute, CORE_METRICS_EXTRACTOR if producer is None else producer)


def as_number(value: object) -> float | None:
    """``value`` as a float when it is an int or a float (not a bool), else None."""
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    return None


def read_scalar(endpoint: Endpoint, key: str) -> float | None:
    """The endpoint's numeric attribute ``key``, None when absent or not a number."""
    return as_number(endpoint.attributes.get(key))
