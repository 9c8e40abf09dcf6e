"""Which response phases the Envoy exchange needs, derived from a loaded EPP configuration.

Every ext_proc message pair costs EPP CPU, so the generated bootstraps send the response body only
when a loaded plugin reads it (a ResponseBodyProcessor, e.g. the predicted-latency producer). The
response headers are always sent: their status is how a failure that reaches the client (an
engine's error, Envoy's reply to a reset or a timeout) counts in the EPP's error metrics and its
size in the response-size histogram (``epp envoy-config --response-header-mode SKIP`` opts out).
The response end (in-flight accounting) needs neither: ``response_trailer_mode: SEND`` keeps the
stream open to the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epp.config.loader import LoadedConfig, load_config, load_config_file, load_document


@dataclass(frozen=True, slots=True)
class ResponseModes:
    """The ext_proc filter's ``response_header_mode`` and ``response_body_mode``."""

    header: str = "SEND"
    body: str = "NONE"


# One message per response chunk, answered with an empty reply (no echo as in FULL_DUPLEX_STREAMED).
RESPONSE_BODY_MODE = "STREAMED"


def response_modes(loaded: LoadedConfig) -> ResponseModes:
    """SEND the headers (the error metrics read their status), STREAMED bodies for body plugins."""
    if loaded.needs_response_body:
        return ResponseModes("SEND", RESPONSE_BODY_MODE)
    return ResponseModes()


def modes_for_document(document: dict[str, Any] | None) -> ResponseModes:
    """:func:`response_modes` of an EndpointPickerConfig mapping (``None``: the default config)."""
    return response_modes(load_config(None) if document is None else load_document(document))


def modes_for_file(path: str | None) -> ResponseModes:
    """:func:`response_modes` of a config file (``None``: the default config)."""
    return response_modes(load_config(None) if path is None else load_config_file(path))
