"""``multicluster-metrics-data-source`` (alpha): polls a peer cluster's EPP metrics page.

``metrics-data-source`` across a cluster trust boundary: ``https`` by default, and the peer's
certificate is verified unless ``insecureSkipVerify`` (``caCertPath`` for a private CA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.framework import Stability, register
from epp.framework.interfaces import Handle
from epp.framework.params import OMIT_UNSET
from epp.plugins.scraping.http_source import HttpDataSource, validate_http_params

__all__ = ["MultiClusterMetricsDataSource", "MultiClusterMetricsDataSourceParams"]


@dataclass(slots=True, frozen=True)
class MultiClusterMetricsDataSourceParams:
    scheme: str = "https"
    path: str = "/metrics"
    # None: the endpoint's metrics host and port (--model-server-metrics-port or the pool's)
    port: int | None = field(default=None, metadata=OMIT_UNSET)
    insecure_skip_verify: bool = False
    ca_cert_path: str = ""
    client_cert_path: str = ""
    client_key_path: str = ""
    interval: str = field(default="", metadata=OMIT_UNSET)  # "" = every --refresh-metrics-interval tick

    def validate(self) -> str | None:
        return validate_http_params(self)


@register
class MultiClusterMetricsDataSource(HttpDataSource):
    type_name = "multicluster-metrics-data-source"
    stability = Stability.ALPHA
    Params = MultiClusterMetricsDataSourceParams

    def __init__(
        self, name: str, params: MultiClusterMetricsDataSourceParams, handle: Handle | None = None
    ) -> None:
        super().__init__(name, params, handle)
        self.params: MultiClusterMetricsDataSourceParams = params
