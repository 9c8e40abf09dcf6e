"""Pods → endpoints: each Ready pod of the pool becomes one endpoint per target port (a rank)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from epp.framework import EndpointMetadata, EndpointNotifier

log = structlog.get_logger("epp.k8s.pods")

ACTIVE_PORTS_ANNOTATIONS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")
MAX_TARGET_PORTS = 8


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What selects the pool's pods and where they serve (from an InferencePool or the CLI)."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]
    app_protocol: str = ""  # the InferencePool's appProtocol; "" (unset) constrains no parser
    label_selector: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "label_selector", ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))
        )

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector.items())


def parse_target_ports(values: list[Any]) -> tuple[int, ...]:
    """1..8 distinct ports in 1..65535; ``ValueError`` naming the bad value otherwise."""
    if not 1 <= len(values) <= MAX_TARGET_PORTS:
        raise ValueError(f"targetPorts must have 1 to {MAX_TARGET_PORTS} entries, got {len(values)}")
    ports: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
            raise ValueError(f"invalid port number {v!r}")
        if v in ports:
            raise ValueError(f"duplicate port number {v}")
        ports.append(v)
    return tuple(ports)


def is_ready(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _active_ports(annotations: Mapping[str, str]) -> frozenset[int] | None:
    for key in ACTIVE_PORTS_ANNOTATIONS:
        raw = annotations.get(key)
        if raw is not None:
            ports = set()
            for part in raw.split(","):
                part = part.strip()
                if part.isdigit():
                    ports.add(int(part))
                elif part:
                    log.warning(
                        "ignoring a bad port in the active-ports annotation", annotation=key, value=part
                    )
            return frozenset(ports)
    return None


class PodEndpoints:
    """A reflector handler for the pool's pods, writing rank endpoints to the endpoint store.

    A pod is Ready when its ``Ready`` condition is ``True``, it has no ``deletionTimestamp`` and it has
    an IP; otherwise (or once its labels no longer match) all its endpoints go at once. Target port
    ``i`` gives ``{namespace}/{pod}-rank-{i}`` at ``podIP:targetPorts[i]`` (always suffixed), labelled
    with the pod's labels and scraped there, or at ``metrics_port`` with exactly one target port. The
    annotation ``llm-d.ai/active-ports`` (legacy ``inference.networking.k8s.io/active-ports``), a
    comma-separated port list, restricts which ranks are live. A change of target ports re-derives
    every pod's endpoints.
    """

    def __init__(
        self,
        notifier: EndpointNotifier,
        namespace: str,
        *,
        metrics_port: int | None = None,
        on_synced: Callable[[], None] | None = None,
    ) -> None:
        self.notifier = notifier
        self.namespace = namespace
        self.metrics_port = metrics_port
        self.spec: PoolSpec | None = None
        self._on_synced = on_synced
        self._pods: dict[str, dict[str, Any]] = {}
        self._keys: dict[str, frozenset[str]] = {}  # pod name -> its endpoint keys in the store

    def set_spec(self, spec: PoolSpec | None) -> None:
        """A new selector or ports: re-derive every known pod's endpoints."""
        self.spec = spec
        for name in list(self._keys.keys() | self._pods.keys()):
            self._apply(name, self._pods.get(name))

    def clear(self) -> None:
        """The pool is gone: every endpoint leaves the store."""
        self._pods.clear()
        for name in list(self._keys):
            self._apply(name, None)

    @property
    def endpoint_count(self) -> int:
        return sum(len(keys) for keys in self._keys.values())

    # --- ReflectorHandler ----------------------------------------------------------------------

    def on_upsert(self, obj: dict[str, Any]) -> None:
        name = str(obj["metadata"]["name"])
        self._pods[name] = obj
        self._apply(name, obj)

    def on_delete(self, obj: dict[str, Any]) -> None:
        name = str(obj["metadata"]["name"])
        self._pods.pop(name, None)
        self._apply(name, None)

    def on_synced(self) -> None:
        if self._on_synced is not None:
            self._on_synced()

    # --- derivation ------------------------------------------------------------------------------

    def endpoints(self, pod: Mapping[str, Any]) -> list[EndpointMetadata]:
        spec = self.spec
        if spec is None or not is_ready(pod):
            return []
        meta = pod.get("metadata") or {}
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        if not spec.matches(labels):
            return []
        name = str(meta["name"])
        ip = str(pod["status"]["podIP"])
        active = _active_ports(meta.get("annotations") or {})
        single = len(spec.target_ports) == 1
        out = []
        for rank, port in enumerate(spec.target_ports):
            if active is not None and port not in active:
                continue
            metrics_host = ""
            if single and self.metrics_port:
                metrics_host = f"[{ip}]:{self.metrics_port}" if ":" in ip else f"{ip}:{self.metrics_port}"
            out.append(
                EndpointMetadata(
                    name=f"{name}-rank-{rank}",
                    address=ip,
                    port=port,
                    namespace=str(meta.get("namespace") or self.namespace),
                    pod_name=name,
                    labels=labels,
                    metrics_host=metrics_host,
                    node_address=str(pod["status"].get("hostIP") or ""),
                    rank=rank,
                )
            )
        return out

    def _apply(self, name: str, pod: Mapping[str, Any] | None) -> None:
        desired = {m.key: m for m in self.endpoints(pod)} if pod is not None else {}
        for key in self._keys.get(name, frozenset()) - desired.keys():
            self.notifier.delete(key)
        for metadata in desired.values():
            self.notifier.upsert(metadata)
        if desired:
            self._keys[name] = frozenset(desired)
        else:
            self._keys.pop(name, None)
