"""Decoding of engine KV-event payloads (msgpack ``EventBatch``) into plain event objects.

The batch is ``[ts, events, rank]`` (array, trailing None omitted) or its map form. An event is a
tagged array ``["BlockStored", ...]`` (vLLM <= 0.23, SGLang <= 0.5.19; older versions shorter)
or a map with ``"type"`` (vLLM >= 0.24, SGLang >= 0.5.20), read by field name. Positional
``BlockStored``: vLLM's ``lora_name, extra_keys, group_idx, kv_cache_spec_kind`` follow ``medium``,
where SGLang has its metadata map (``cache_salt``); both engines' layouts decode whatever
``engine`` says. ``session_id`` (vLLM and SGLang: the session of the request behind a store) is
read from the map form and SGLang's metadata map. Block hashes are ints (taken as uint64) or bytes
(the last 8 bytes, big-endian).
Bad input raises ``DecodeError``; unknown event tags are skipped (counted in ``EventBatch.unknown``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "Event",
    "EventBatch",
    "decode_batch",
    "hash_key",
]

_U64 = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder()
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_EMBEDS = "\x00embeds:"  # a prompt-embeddings digest: no request can name it


class DecodeError(ValueError):
    """A payload that is not a valid event batch."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    spec_kind: str | None = None
    cache_salt: str | None = None  # SGLang: the salt of the request that stored the blocks
    session_id: str | None = None  # the session of the request that stored (or reused) the blocks


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    medium: str | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None
    unknown: int = 0  # events with a tag this decoder does not know (skipped)


def hash_key(raw: Any) -> int:
    """An engine block hash as a uint64: ints masked to 64 bits, bytes by their last 8 bytes."""
    if type(raw) is int:
        return raw & _U64
    if isinstance(raw, bytes | bytearray):
        if not raw:
            raise DecodeError("empty hash bytes")
        return int.from_bytes(raw[-8:], "big")
    raise DecodeError(f"block hash must be an integer or bytes, got {type(raw).__name__}")


def _hashes(raw: Any, what: str) -> list[int]:
    if not isinstance(raw, list):
        raise DecodeError(f"{what}: block_hashes must be an array, got {type(raw).__name__}")
    out = []
    for h in raw:
        if type(h) is int:
            out.append(h & _U64)
        else:
            out.append(hash_key(h))
    return out


def _opt_int(raw: Any, name: str) -> int | None:
    if raw is None:
        return None
    if type(raw) is not int:
        raise DecodeError(f"{name} must be an integer, got {type(raw).__name__}")
    return raw


def _opt_str(raw: Any, name: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise DecodeError(f"{name} must be a string, got {type(raw).__name__}")
    return raw


def _extra_keys(raw: Any) -> list[list[str] | None] | None:
    """Per block, its string identifiers (bare strings: the LoRA name, the cache salt; the first
    item of a multimodal ``[hash, offset]``; a prompt-embeddings digest (bytes) as a marker that
    no request produces)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise DecodeError(f"extra_keys must be an array, got {type(raw).__name__}")
    out: list[list[str] | None] = []
    for i, block in enumerate(raw):
        if block is None:
            out.append(None)
            continue
        if not isinstance(block, list):
            raise DecodeError(f"extra_keys[{i}] must be an array or null, got {type(block).__name__}")
        ids: list[str] = []
        for entry in block:
            if isinstance(entry, str):
                ids.append(entry)
            elif isinstance(entry, list) and entry and isinstance(entry[0], str):
                ids.append(entry[0])
            elif isinstance(entry, bytes):
                ids.append(_EMBEDS + entry.hex())
        out.append(ids or None)
    return out


def _at(fields: list[Any], i: int) -> Any:
    return fields[i] if i < len(fields) else None


def _stored(fields: list[Any], sglang: bool = False) -> BlockStored:
    if len(fields) < 5:
        raise DecodeError(f"BlockStored: need at least 5 fields, got {len(fields)}")
    tokens = fields[3]
    if not isinstance(tokens, list):
        raise DecodeError(f"BlockStored: token_ids must be an array, got {type(tokens).__name__}")
    parent = fields[2]
    block_size = fields[4]
    if type(block_size) is not int:
        raise DecodeError("BlockStored: block_size must be an integer")
    group = None if sglang else _opt_int(_at(fields, 9), "BlockStored: group_idx")
    if group is not None and group < 0:
        raise DecodeError(f"BlockStored: group_idx: negative value {group}")
    eighth = _at(fields, 7)
    salt = session = None
    if isinstance(eighth, dict):  # SGLang 0.5.18-0.5.19: BlockStoredMetadata
        salt = _opt_str(eighth.get("cache_salt"), "BlockStored: metadata.cache_salt")
        session = _opt_str(eighth.get("session_id"), "BlockStored: metadata.session_id")
        eighth = None
    return BlockStored(
        block_hashes=_hashes(fields[1], "BlockStored"),
        parent=None if parent is None else hash_key(parent),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(_at(fields, 5), "BlockStored: lora_id"),
        medium=_opt_str(_at(fields, 6), "BlockStored: medium"),
        lora_name=_opt_str(eighth, "BlockStored: lora_name"),
        extra_keys=_extra_keys(_at(fields, 8)),
        group_idx=group,
        spec_kind=None if sglang else _opt_str(_at(fields, 10), "BlockStored: kv_cache_spec_kind"),
        cache_salt=salt,
        session_id=session,
    )


def _stored_map(ev: dict[str, Any]) -> BlockStored:
    stored = _stored(["BlockStored", *(ev.get(n) for n in _STORED_FIELDS)])
    stored.cache_salt = _opt_str(ev.get("cache_salt"), "BlockStored: cache_salt")
    stored.session_id = _opt_str(ev.get("session_id"), "BlockStored: session_id")
    return stored


def _removed(fields: list[Any], sglang: bool = False) -> BlockRemoved:
    if len(fields) < 2:
        raise DecodeError(f"BlockRemoved: need at least 2 fields, got {len(fields)}")
    group = None if sglang else _opt_int(_at(fields, 3), "BlockRemoved: group_idx")
    if group is not None and group < 0:
        raise DecodeError(f"BlockRemoved: group_idx: negative value {group}")
    return BlockRemoved(
        block_hashes=_hashes(fields[1], "BlockRemoved"),
        medium=_opt_str(_at(fields, 2), "BlockRemoved: medium"),
        group_idx=group,
    )


def decode_batch(payload: bytes, engine: str = "vllm") -> EventBatch:
    """Decode one payload; ``DecodeError`` when malformed. Every layout of both engines decodes
    under either ``engine`` (``vllm`` or ``sglang``); with ``sglang`` a positional event's fields
    past SGLang's own (vLLM's hybrid-attention group) are ignored."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as e:
        raise DecodeError(f"not msgpack: {e}") from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise DecodeError(f"event batch: need at least 2 fields, got {len(raw)}")
        ts, events, rank = raw[0], raw[1], _at(raw, 2)
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise DecodeError(f"event batch must be an array or a map, got {type(raw).__name__}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise DecodeError("event batch: ts must be a number")
    if not isinstance(events, list):
        raise DecodeError("event batch: events must be an array")
    batch = EventBatch(float(ts), [], _opt_int(rank, "event batch: data_parallel_rank"))
    sglang = engine == "sglang"
    out = batch.events
    for ev in events:
        if isinstance(ev, list):
            if not ev or not isinstance(ev[0], str):
                raise DecodeError("event without a string tag")
            tag = ev[0]
            if tag == "BlockStored":
                out.append(_stored(ev, sglang))
            elif tag == "BlockRemoved":
                out.append(_removed(ev, sglang))
            elif tag == "AllBlocksCleared":
                out.append(AllBlocksCleared(_opt_str(_at(ev, 1), "AllBlocksCleared: medium")))
            else:
                batch.unknown += 1
        elif isinstance(ev, dict):
            kind = ev.get("type")
            if not isinstance(kind, str):
                raise DecodeError('map-encoded event without a string "type"')
            if kind == "BlockStored":
                out.append(_stored_map(ev))
            elif kind == "BlockRemoved":
                out.append(_removed([kind, *(ev.get(n) for n in _REMOVED_FIELDS)]))
            elif kind == "AllBlocksCleared":
                out.append(AllBlocksCleared(_opt_str(ev.get("medium"), "AllBlocksCleared: medium")))
            else:
                batch.unknown += 1
        else:
            raise DecodeError(f"event must be an array or a map, got {type(ev).__name__}")
    return batch
