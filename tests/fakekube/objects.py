"""Builders for the objects the EPP reads, as Kubernetes serialises them (shared by the tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

POOL_GROUP = "inference.networking.k8s.io"
POOL_API = f"{POOL_GROUP}/v1"
ALPHA_API = "inference.networking.x-k8s.io/v1alpha2"
POLICY_API = "llm-d.ai/v1alpha2"  # InferenceObjective, InferenceModelRewrite (ALPHA_API: deprecated)

Obj = dict[str, Any]


def inference_pool(
    namespace: str,
    ports: Sequence[int] = (8000,),
    *,
    name: str = "pool",
    selector: Mapping[str, str] | None = None,
) -> Obj:
    return {
        "apiVersion": POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(selector or {"app": "vllm"})},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }


def pod(
    namespace: str, name: str, ip: str, *, ready: bool = True, labels: Mapping[str, str] | None = None
) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {"app": "vllm"})},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def readiness_patch(ready: bool) -> Obj:
    """A merge patch flipping a pod's Ready condition."""
    return {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def objective(
    namespace: str, name: str, priority: int, *, pool: str = "pool", api_version: str = POLICY_API
) -> Obj:
    return {
        "apiVersion": api_version,
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"priority": priority, "poolRef": {"name": pool, "group": POOL_GROUP}},
    }


def model_rewrite(
    namespace: str,
    name: str,
    model: str,
    targets: Mapping[str, int],
    *,
    pool: str = "pool",
    api_version: str = POLICY_API,
) -> Obj:
    """One rule: requests for exactly ``model`` go to the ``targets`` (model -> weight)."""
    return {
        "apiVersion": api_version,
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "poolRef": {"name": pool, "group": POOL_GROUP},
            "rules": [
                {
                    "matches": [{"model": {"type": "Exact", "value": model}}],
                    "targets": [{"modelRewrite": t, "weight": w} for t, w in targets.items()],
                }
            ],
        },
    }
