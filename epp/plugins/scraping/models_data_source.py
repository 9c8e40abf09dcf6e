"""``models-data-source``: polls each endpoint's OpenAI ``/v1/models`` list over HTTP(S)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from epp.framework import register
from epp.framework.endpoint_attributes import ModelData
from epp.framework.interfaces import Handle
from epp.framework.params import OMIT_UNSET
from epp.plugins.scraping.http_source import HttpDataSource, HttpError, validate_http_params

MODELS_PAYLOAD = "models"


@dataclass(slots=True, frozen=True)
class ModelsDataSourceParams:
    scheme: str = "http"
    path: str = "/v1/models"
    insecure_skip_verify: bool = True
    ca_cert_path: str = ""
    client_cert_path: str = ""
    client_key_path: str = ""
    interval: str = field(default="", metadata=OMIT_UNSET)  # "" = every --refresh-metrics-interval tick

    def validate(self) -> str | None:
        return validate_http_params(self)


@register
class ModelsDataSource(HttpDataSource):
    """Each poll yields the ``data`` entries as ``ModelData``; an answer that is not a JSON object
    with a ``data`` list of objects carrying a string ``id`` fails the poll."""

    type_name = "models-data-source"
    Params = ModelsDataSourceParams
    payload = MODELS_PAYLOAD
    accept = "application/json"

    def __init__(self, name: str, params: ModelsDataSourceParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self.params: ModelsDataSourceParams = params

    def parse(self, body: bytes) -> tuple[ModelData, ...]:
        return parse_models(body)


def parse_models(body: bytes) -> tuple[ModelData, ...]:
    """The models of an OpenAI list answer; raises ``HttpError`` (malformed_response) otherwise."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(f"invalid JSON in the models answer: {e}") from e
    if not isinstance(doc, dict):
        raise HttpError("the models answer is not a JSON object")
    data = doc.get("data")
    if data is None:
        return ()
    if not isinstance(data, list):
        raise HttpError("'data' of the models answer is not a list")
    return tuple(_model(i, entry) for i, entry in enumerate(data))


def _model(i: int, entry: Any) -> ModelData:
    if not isinstance(entry, dict):
        raise HttpError(f"data[{i}] of the models answer is not an object")
    fields: dict[str, Any] = {}
    for key, attr, kind in (
        ("id", "id", str),
        ("object", "object", str),
        ("created", "created", int),
        ("owned_by", "owned_by", str),
        ("parent", "parent", str),
    ):
        value = entry.get(key)
        if value is None:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            raise HttpError(f"data[{i}].{key} of the models answer has the wrong type")
        fields[attr] = value
    if "id" not in fields:
        fields["id"] = ""
    return ModelData(**fields)
