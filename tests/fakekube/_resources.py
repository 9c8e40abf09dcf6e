"""The resource types the fake serves, and how their REST paths and discovery documents look."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Field selector labels every resource supports.
COMMON_FIELD_LABELS = frozenset({"metadata.name", "metadata.namespace"})

#: Verbs advertised in discovery for every resource (the fake serves them all).
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class ResourceType:
    """One namespaced REST resource: ``kind`` at ``/{base}/namespaces/{ns}/{plural}``."""

    group: str
    version: str
    kind: str
    plural: str
    short_names: tuple[str, ...] = ()
    #: Field selector labels beyond ``metadata.name``/``metadata.namespace`` (dotted object paths).
    extra_field_labels: frozenset[str] = field(default_factory=frozenset)
    #: Built-in types accept updates without ``metadata.resourceVersion``; custom resources do not.
    builtin: bool = False
    #: With a ``status`` subresource, writes to the main resource keep the stored ``status``.
    has_status: bool = True
    #: DELETE answers with the deleted object (pods, custom resources) or a success ``Status``.
    delete_returns_object: bool = True

    @property
    def api_version(self) -> str:
        """``v1`` for the core group, else ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        """The kind of a list of these objects, e.g. ``PodList``."""
        return f"{self.kind}List"

    @property
    def singular(self) -> str:
        """The singular resource name, e.g. ``pod``."""
        return self.kind.lower()

    @property
    def base_path(self) -> str:
        """``/api/v1`` or ``/apis/{group}/{version}``."""
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    @property
    def qualified_resource(self) -> str:
        """How error messages name the resource: ``pods``, ``leases.coordination.k8s.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def field_labels(self) -> frozenset[str]:
        """Every field selector label this resource supports."""
        return COMMON_FIELD_LABELS | self.extra_field_labels

    def discovery_entries(self) -> list[dict[str, Any]]:
        """The ``APIResource`` entries of this resource and its ``status`` subresource."""
        main = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": True,
            "kind": self.kind,
            "verbs": VERBS,
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if not self.has_status:
            return [main]
        status = {
            "name": f"{self.plural}/status",
            "singularName": "",
            "namespaced": True,
            "kind": self.kind,
            "verbs": ["get", "patch", "update"],
        }
        return [main, status]


POD = ResourceType(
    group="",
    version="v1",
    kind="Pod",
    plural="pods",
    short_names=("po",),
    extra_field_labels=frozenset(
        {
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        }
    ),
    builtin=True,
)
LEASE = ResourceType(
    group="coordination.k8s.io",
    version="v1",
    kind="Lease",
    plural="leases",
    builtin=True,
    has_status=False,
    delete_returns_object=False,
)
CONFIG_MAP = ResourceType(
    group="",
    version="v1",
    kind="ConfigMap",
    plural="configmaps",
    short_names=("cm",),
    builtin=True,
    has_status=False,
)
INFERENCE_POOL = ResourceType(
    group="inference.networking.k8s.io", version="v1", kind="InferencePool", plural="inferencepools"
)
INFERENCE_POOL_V1ALPHA2 = ResourceType(
    group="inference.networking.x-k8s.io", version="v1alpha2", kind="InferencePool", plural="inferencepools"
)
INFERENCE_OBJECTIVE = ResourceType(
    group="llm-d.ai",
    version="v1alpha2",
    kind="InferenceObjective",
    plural="inferenceobjectives",
)
INFERENCE_MODEL_REWRITE = ResourceType(
    group="llm-d.ai",
    version="v1alpha2",
    kind="InferenceModelRewrite",
    plural="inferencemodelrewrites",
)
LEGACY_INFERENCE_OBJECTIVE = ResourceType(
    group="inference.networking.x-k8s.io",
    version="v1alpha2",
    kind="InferenceObjective",
    plural="inferenceobjectives",
)
LEGACY_INFERENCE_MODEL_REWRITE = ResourceType(
    group="inference.networking.x-k8s.io",
    version="v1alpha2",
    kind="InferenceModelRewrite",
    plural="inferencemodelrewrites",
)

#: Every resource type the fake serves.
RESOURCES: tuple[ResourceType, ...] = (
    POD,
    LEASE,
    CONFIG_MAP,
    INFERENCE_POOL,
    INFERENCE_POOL_V1ALPHA2,
    INFERENCE_OBJECTIVE,
    INFERENCE_MODEL_REWRITE,
    LEGACY_INFERENCE_OBJECTIVE,
    LEGACY_INFERENCE_MODEL_REWRITE,
)


class Registry:
    """Look-ups of :data:`RESOURCES` by ``(apiVersion, kind)`` and by ``(group, version, plural)``."""

    def __init__(self, resources: tuple[ResourceType, ...] = RESOURCES) -> None:
        self.resources = resources
        self._by_kind = {(r.api_version, r.kind): r for r in resources}
        self._by_path = {(r.group, r.version, r.plural): r for r in resources}

    def by_kind(self, api_version: str, kind: str) -> ResourceType:
        """The resource of ``kind`` in ``api_version``; ``ValueError`` if the fake does not serve it."""
        try:
            return self._by_kind[(api_version, kind)]
        except KeyError:
            raise ValueError(f"fakekube does not serve {kind} in {api_version}") from None

    def by_path(self, group: str, version: str, plural: str) -> ResourceType | None:
        """The resource served at ``{group}/{version}/{plural}``, if any."""
        return self._by_path.get((group, version, plural))

    def groups(self) -> dict[str, list[str]]:
        """Every non-core API group with its versions, in registration order."""
        out: dict[str, list[str]] = {}
        for r in self.resources:
            if r.group and r.version not in out.setdefault(r.group, []):
                out[r.group].append(r.version)
        return out

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        """The resources of one ``group/version`` (``""`` is the core group)."""
        return [r for r in self.resources if r.group == group and r.version == version]
