"""``dcgm-data-source`` (alpha): polls an NVIDIA DCGM exporter's Prometheus page for GPU metrics.

The exporter runs as a sidecar (the pod's address) or a DaemonSet (the node's address,
``useNodeAddress``), always on its own ``port``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.framework import Stability, register
from epp.framework.interfaces import Handle
from epp.framework.params import OMIT_UNSET
from epp.plugins.scraping.http_source import HttpDataSource, validate_http_params

DEFAULT_DCGM_PORT = 9400


@dataclass(slots=True, frozen=True)
class DcgmDataSourceParams:
    scheme: str = "http"
    path: str = "/metrics"
    port: int = DEFAULT_DCGM_PORT
    insecure_skip_verify: bool = True
    use_node_address: bool = False
    interval: str = field(default="", metadata=OMIT_UNSET)  # "" = every --refresh-metrics-interval tick

    def validate(self) -> str | None:
        return validate_http_params(self)


@register
class DcgmDataSource(HttpDataSource):
    type_name = "dcgm-data-source"
    Params = DcgmDataSourceParams
    stability = Stability.ALPHA

    def __init__(self, name: str, params: DcgmDataSourceParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.params: DcgmDataSourceParams = params
