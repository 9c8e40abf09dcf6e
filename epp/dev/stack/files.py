"""What the local stack writes for the EPP: the file-discovery endpoints file and its config (with
``epp run --replicas`` the ``redis-syncer`` the replicas share their routing state through)."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

DISCOVERY_PLUGIN_NAME = "epp-run-files"
SYNCER_PLUGIN_NAME = "epp-run-redis"
SYNCER_TYPES = ("redis-syncer", "redis-state-store")
SYNC_INTERVAL = "100ms"
# The reference's default profile's weights (max-score-picker last, unweighted).
DEFAULT_WEIGHTS: Mapping[str, float | None] = {
    "queue-scorer": 2,
    "kv-cache-utilization-scorer": 2,
    "prefix-cache-scorer": 3,
    "max-score-picker": None,
}
# What the stack's private redis-server does not have: dropped from a user's syncer parameters.
_SYNCER_CONNECTION_PARAMS = (
    "address",
    "username",
    "passwordEnv",
    "passwordFile",
    "db",
    "tls",
    "caCertPath",
    "insecureSkipVerify",
)


def endpoints_document(
    ports: Sequence[int],
    *,
    host: str = "127.0.0.1",
    prefix: str = "sim",
    names: Sequence[str] | None = None,
    labels: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """The file-discovery endpoints document for sims on ``ports``.

    Endpoint ``i`` is named ``names[i]`` (default ``{prefix}-{i}``); ``labels`` maps a name to its labels.
    """
    names = names if names is not None else [f"{prefix}-{i}" for i in range(len(ports))]
    labels = labels or {}
    return {
        "endpoints": [
            {
                "name": name,
                "namespace": "default",
                "address": host,
                "port": str(port),
                "labels": dict(labels.get(name, {})),
            }
            for name, port in zip(names, ports, strict=True)
        ]
    }


def given_endpoints(addresses: Sequence[str]) -> dict[str, Any]:
    """The endpoints document for engines already running at ``host:port`` addresses
    (``epp run --endpoints``): ``engine-<i>``."""
    endpoints = []
    for i, address in enumerate(addresses):
        host, _, port = address.rpartition(":")
        endpoints.append(
            {"name": f"engine-{i}", "namespace": "default", "address": host, "port": port, "labels": {}}
        )
    return {"endpoints": endpoints}


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by renaming a temporary file over it (watchers never see half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_endpoints(
    path: Path,
    ports: Sequence[int],
    *,
    host: str = "127.0.0.1",
    names: Sequence[str] | None = None,
    labels: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Write the endpoints document (see :func:`endpoints_document`) atomically."""
    document = endpoints_document(ports, host=host, names=names, labels=labels)
    write_atomic(path, yaml.safe_dump(document, sort_keys=False))


def epp_config(endpoints_file: Path, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An EndpointPickerConfig with the file-discovery plugin for ``endpoints_file`` injected.

    ``base`` (e.g. a user's scheduling config) is kept; an existing ``file-discovery`` plugin is
    pointed at ``endpoints_file``, otherwise one is added, and ``dataLayer.discovery`` refers to it.
    """
    cfg: dict[str, Any] = dict(base or {})
    cfg.setdefault("apiVersion", "llm-d.ai/v1")
    cfg.setdefault("kind", "EndpointPickerConfig")
    plugins = [dict(p) for p in cfg.get("plugins") or []]
    discovery = next((p for p in plugins if p.get("type") == "file-discovery"), None)
    if discovery is None:
        discovery = {"name": DISCOVERY_PLUGIN_NAME, "type": "file-discovery"}
        plugins.insert(0, discovery)
    discovery["parameters"] = {
        **(discovery.get("parameters") or {}),
        "path": str(endpoints_file),
        "watchFile": True,
    }
    cfg["plugins"] = plugins
    data_layer = dict(cfg.get("dataLayer") or {})
    ref = {"pluginRef": discovery.get("name") or discovery["type"]}
    if cfg["apiVersion"] == "llm-d.ai/v1":
        data_layer["discovery"] = {**(data_layer.get("discovery") or {}), "endpoints": ref}
    else:
        data_layer["discovery"] = ref
    cfg["dataLayer"] = data_layer
    return cfg


def one_profile_config(
    plugins: Sequence[Mapping[str, Any]], refs: Mapping[str, float | None]
) -> dict[str, Any]:
    """An ``llm-d.ai/v1`` config declaring ``plugins``, with one scheduling profile, ``default``, that
    names each plugin of ``refs`` in order with its weight (``None``: no weight, as for a filter or
    a picker)."""
    return {
        "apiVersion": "llm-d.ai/v1",
        "kind": "EndpointPickerConfig",
        "plugins": [dict(p) for p in plugins],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": n} if w is None else {"pluginRef": n, "weight": w} for n, w in refs.items()
                ],
            }
        ],
    }


def precise_config(block_size: int = 16) -> dict[str, Any]:
    """The scheduling of ``epp run --kv-events`` without ``--config-file``: the default scorers, with
    the prefix scorer fed by the simulators' KV events (``precise-prefix-cache-producer``) and their
    own tokenizer (``epp-bpe-8k``) in place of the approximate index."""
    precise = "precise-prefix-cache-producer"
    return one_profile_config(
        [
            {"type": "token-producer", "parameters": {"local": {"path": "epp-bpe-8k"}}},
            {"type": precise, "parameters": {"tokenProcessorConfig": {"blockSizeTokens": block_size}}},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": precise}},
            {"type": "max-score-picker"},
        ],
        DEFAULT_WEIGHTS,
    )


def vllm_engines_config(tokenizer: str, block_size: int) -> dict[str, Any]:
    """The scheduling of ``epp run --engine vllm``: :func:`precise_config` on the engines' KV events
    with their model's own tokenizer (``tokenizer``, a directory) and block size."""
    config = precise_config(block_size)
    config["plugins"][0] = {"type": "token-producer", "parameters": {"local": {"path": tokenizer}}}
    return config


def uses_kv_events(config: dict[str, Any]) -> bool:
    """Whether a config reads the engines' KV events (it has a ``precise-prefix-cache-producer``)."""
    plugins = config.get("plugins") or []
    return any(isinstance(p, dict) and p.get("type") == "precise-prefix-cache-producer" for p in plugins)


def with_redis_syncer(config: dict[str, Any] | None, address: str) -> dict[str, Any]:
    """``config`` (None: the default scheduling) with its replicas sharing state through the Redis at
    ``address``.

    A ``redis-syncer`` (or ``redis-state-store``) plugin of ``config`` is pointed at ``address`` (its
    other connection parameters dropped: the stack's Redis has no password or TLS; ``stateTTL``,
    ``keyPrefix`` and the like kept), otherwise one named ``epp-run-redis`` is added. It becomes the
    cross-replica syncer (v1: ``dataLayer.crossReplica.syncerPluginRef``, the older layout:
    ``crossReplicaSyncerPluginRef``; the user's interval and timeout kept, default 100ms) and the
    peer store (``dataLayer.discovery.peers`` / ``peerDiscovery``). ``config`` is not modified.
    """
    cfg: dict[str, Any] = copy.deepcopy(dict(config or {}))
    cfg.setdefault("apiVersion", "llm-d.ai/v1")
    cfg.setdefault("kind", "EndpointPickerConfig")
    plugins = [dict(p) for p in cfg.get("plugins") or []]
    syncer = next((p for p in plugins if p.get("type") in SYNCER_TYPES), None)
    if syncer is None:
        syncer = {"name": SYNCER_PLUGIN_NAME, "type": "redis-syncer"}
        plugins.append(syncer)
    params = {k: v for k, v in (syncer.get("parameters") or {}).items() if k not in _SYNCER_CONNECTION_PARAMS}
    syncer["parameters"] = {"address": address, **params}
    cfg["plugins"] = plugins
    name = syncer.get("name") or syncer["type"]
    data_layer = dict(cfg.get("dataLayer") or {})
    if cfg["apiVersion"] == "llm-d.ai/v1":
        cross = dict(data_layer.get("crossReplica") or {})
        cross["syncerPluginRef"] = name
        cross.setdefault("syncInterval", SYNC_INTERVAL)
        data_layer["crossReplica"] = cross
        discovery = dict(data_layer.get("discovery") or {})
        discovery["peers"] = {"pluginRef": name}
        data_layer["discovery"] = discovery
    else:
        data_layer["crossReplicaSyncerPluginRef"] = name
        data_layer.setdefault("crossReplicaSyncInterval", SYNC_INTERVAL)
        data_layer["peerDiscovery"] = {"pluginRef": name}
    cfg["dataLayer"] = data_layer
    return cfg
