"""``models-data-extractor``: stores an endpoint's ``/v1/models`` entries in its attributes."""

from __future__ import annotations

from typing import Any

from epp.framework import Endpoint, Extractor, register
from epp.framework.endpoint_attributes import MODELS_KEY, ModelData
from epp.plugins.scraping.models_data_source import MODELS_PAYLOAD


@register
class ModelsDataExtractor(Extractor):
    """Writes ``Endpoint.attributes[MODELS_KEY]`` (``/v1/models/models-data-extractor``): the tuple of
    ``ModelData`` the server listed, replacing the previous one on every successful poll."""

    type_name = "models-data-extractor"
    accepts = MODELS_PAYLOAD

    def extract_attributes(self, endpoint: Endpoint, payload: Any) -> tuple[str, ...]:
        if not isinstance(payload, tuple) or not all(isinstance(m, ModelData) for m in payload):
            return (f"expected the models of a models-data-source, got {type(payload).__name__}",)
        if endpoint.attributes.get(MODELS_KEY) != payload:
            endpoint.attributes[MODELS_KEY] = payload
        return ()
