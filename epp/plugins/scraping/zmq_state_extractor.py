"""``zmq-state-extractor``: decodes pushed load messages (SGLang's msgpack ``LoadStat``).

``LoadStat`` is a tagged array ``["LoadStat", running, waiting, num_tokens, max_total_num_tokens,
dp_rank]`` (fields may be appended; ``dp_rank`` may be null or absent); its map form, read by
field name, is accepted too. Counts must be non-negative integers.
"""

from __future__ import annotations

from typing import Any

import msgspec

from epp.framework import Extractor, register
from epp.framework.interfaces import LoadReport
from epp.plugins.scraping.zmq_metrics_data_source import LOAD_PAYLOAD

_TAG = "LoadStat"
_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_tokens", "max_total_num_tokens")
_decoder = msgspec.msgpack.Decoder()


def decode_load_stat(payload: bytes) -> LoadReport | None:
    """The report in ``payload``; None for a message of another tag; ``ValueError`` if malformed."""
    if not payload:
        raise ValueError("empty message")
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        if raw.get("type", _TAG) != _TAG:
            return None
        values = [raw.get(name) for name in _FIELDS]
        rank = raw.get("dp_rank", raw.get("attn_dp_rank"))
    elif isinstance(raw, list):
        if not raw or raw[0] != _TAG:
            if raw and isinstance(raw[0], str):
                return None
            raise ValueError("not a tagged LoadStat array")
        if len(raw) < 1 + len(_FIELDS):
            raise ValueError(f"LoadStat has {len(raw) - 1} fields, expected at least {len(_FIELDS)}")
        values = raw[1 : 1 + len(_FIELDS)]
        rank = raw[1 + len(_FIELDS)] if len(raw) > 1 + len(_FIELDS) else None
    else:
        raise ValueError(f"expected a LoadStat array or map, got {type(raw).__name__}")
    counts = [_count(name, v) for name, v in zip(_FIELDS, values, strict=True)]
    if rank is not None and (type(rank) is not int or rank < 0):
        raise ValueError(f"dp_rank: expected a non-negative integer or null, got {rank!r}")
    return LoadReport(counts[0], counts[1], counts[2], counts[3], rank)


def _count(name: str, value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    return value


@register
class ZmqStateExtractor(Extractor):
    """Turns a pushed message into a ``LoadReport`` (the data layer merges it into the metrics)."""

    type_name = "zmq-state-extractor"
    accepts = LOAD_PAYLOAD

    def extract_load(self, payload: bytes) -> LoadReport | None:
        return decode_load_stat(payload)
