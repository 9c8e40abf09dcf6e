"""``metrics-data-source``: polls a model server's Prometheus metrics page over HTTP(S)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.framework import register
from epp.framework.interfaces import Handle
from epp.framework.params import OMIT_UNSET
from epp.plugins.scraping.http_source import HttpDataSource, HttpError, HttpPoller, validate_http_params

__all__ = ["HttpError", "HttpPoller", "MetricsDataSource", "MetricsDataSourceParams", "MetricsPoller"]

MetricsPoller = HttpPoller


@dataclass(slots=True, frozen=True)
class MetricsDataSourceParams:
    scheme: str = "http"
    path: str = "/metrics"
    # None: the endpoint's metrics host and port (--model-server-metrics-port or the pool's)
    port: int | None = field(default=None, metadata=OMIT_UNSET)
    insecure_skip_verify: bool = True
    ca_cert_path: str = ""
    client_cert_path: str = ""
    client_key_path: str = ""
    interval: str = field(default="", metadata=OMIT_UNSET)  # "" = every --refresh-metrics-interval tick

    def validate(self) -> str | None:
        return validate_http_params(self)


@register
class MetricsDataSource(HttpDataSource):
    type_name = "metrics-data-source"
    Params = MetricsDataSourceParams

    def __init__(self, name: str, params: MetricsDataSourceParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.params: MetricsDataSourceParams = params
