"""KV-event encoders of real engines for tests: msgspec structs declared as vLLM's
``vllm/distributed/kv_events.py`` and SGLang's ``sglang/srt/disaggregation/kv_events.py`` declare
them at each change of their layout (field order, defaults, struct options), so msgspec writes the
bytes those engines write. Written from the engines' field lists; each layout is named after the
first version that has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_REQ = object()  # a field without a default


@dataclass(frozen=True, slots=True)
class EngineLayout:
    name: str
    engine: str  # "vllm" | "sglang"
    events_array: bool  # array_like events (else tagged maps)
    stored: tuple[tuple[str, object], ...]  # (field, default or _REQ)
    removed: tuple[tuple[str, object], ...]
    rank_field: str
    event_omit_defaults: bool = True
    batch_omit_defaults: bool = True
    salt_metadata: bool = False  # SGLang 0.5.18-0.5.19: BlockStoredWithMetadata

    @property
    def fields(self) -> set[str]:
        return {n for n, _ in self.stored}

    @property
    def names_adapter(self) -> bool:
        return "lora_name" in self.fields

    @property
    def carries_salt(self) -> bool:
        return bool({"extra_keys", "cache_salt"} & self.fields) or self.salt_metadata

    @property
    def has_medium(self) -> bool:
        return "medium" in self.fields


def _vllm(
    n_stored: int, n_removed: int
) -> tuple[tuple[tuple[str, object], ...], tuple[tuple[str, object], ...]]:
    stored = (
        ("block_hashes", _REQ),
        ("parent_block_hash", _REQ),
        ("token_ids", _REQ),
        ("block_size", _REQ),
        ("lora_id", _REQ),
        ("medium", _REQ),
        ("lora_name", _REQ),
        ("extra_keys", None),
        ("group_idx", None),
        ("kv_cache_spec_kind", None),
        ("kv_cache_spec_sliding_window", None),
        ("locality", None),
        ("ownership", None),
        ("session_id", None),
        ("lookahead_token_ids", None),
    )
    removed = (
        ("block_hashes", _REQ),
        ("medium", _REQ),
        ("group_idx", None),
        ("locality", None),
        ("ownership", None),
    )
    return stored[:n_stored], removed[:n_removed]


def _sglang(
    n_stored: int, n_removed: int
) -> tuple[tuple[tuple[str, object], ...], tuple[tuple[str, object], ...]]:
    stored = (
        ("block_hashes", _REQ),
        ("parent_block_hash", _REQ),
        ("token_ids", _REQ),
        ("block_size", _REQ),
        ("lora_id", _REQ),
        ("medium", None),
        ("cache_salt", None),
        ("session_id", None),
        ("lora_name", None),
    )
    return stored[:n_stored], (("block_hashes", _REQ), ("medium", None))[:n_removed]


def _v(name: str, array: bool, n_stored: int, n_removed: int) -> EngineLayout:
    stored, removed = _vllm(n_stored, n_removed)
    return EngineLayout(name, "vllm", array, stored, removed, "data_parallel_rank")


def _s(name: str, array: bool, n_stored: int, n_removed: int, **kw: Any) -> EngineLayout:
    stored, removed = _sglang(n_stored, n_removed)
    return EngineLayout(name, "sglang", array, stored, removed, "attn_dp_rank", **kw)


LAYOUTS = [
    _v("vllm-0.10", True, 5, 1),  # 0.10: lora_id, no medium
    _v("vllm-0.11", True, 6, 2),  # 0.11-0.13: + medium, hashes int or bytes
    _v("vllm-0.14", True, 7, 2),  # 0.14-0.16: + lora_name
    _v("vllm-0.17", True, 8, 2),  # 0.17-0.19: + extra_keys
    _v("vllm-0.20", True, 9, 3),  # 0.20-0.21: + group_idx
    _v("vllm-0.22", True, 11, 3),  # 0.22-0.23: + kv_cache_spec_kind, kv_cache_spec_sliding_window
    _v("vllm-0.24", False, 11, 3),  # 0.24-0.26: events as maps
    _v("vllm-0.27", False, 12, 4),  # 0.27-0.28: + locality
    _v("vllm-0.29", False, 13, 5),  # 0.29: + ownership
    _v("vllm-0.30", False, 14, 5),  # 0.30-0.32: + session_id
    _v("vllm-0.33", False, 15, 5),  # 0.33-0.34: + lookahead_token_ids
    _s("sglang-0.5.1", True, 5, 1),  # 0.5.1-0.5.8
    _s("sglang-0.5.9", True, 6, 2),  # 0.5.9-0.5.17: + medium
    _s("sglang-0.5.18", True, 6, 2, event_omit_defaults=False, salt_metadata=True),  # 0.5.18-0.5.19
    _s("sglang-0.5.20", False, 8, 2, batch_omit_defaults=False),  # 0.5.20-0.5.21: maps, + salt, session
    _s("sglang-0.5.22", False, 9, 2, batch_omit_defaults=False),  # 0.5.22-0.5.23: + lora_name
]


def _spec(fields: tuple[tuple[str, object], ...]) -> list[tuple[str, Any] | tuple[str, Any, Any]]:
    return [(n, Any) if d is _REQ else (n, Any, d) for n, d in fields]


class Encoder:
    """One layout's structs; ``stored``/``removed``/``cleared`` build events, ``batch`` encodes."""

    def __init__(self, layout: EngineLayout) -> None:
        self.layout = layout
        opts: dict[str, Any] = {"tag": True, "gc": False, "omit_defaults": layout.event_omit_defaults}
        if layout.events_array:
            opts["array_like"] = True
        base = msgspec.defstruct("KVCacheEvent", [], **opts)
        self._stored = msgspec.defstruct("BlockStored", _spec(layout.stored), bases=(base,))
        self._removed = msgspec.defstruct("BlockRemoved", _spec(layout.removed), bases=(base,))
        self._cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(base,))
        self._with_meta: Any = None
        if layout.salt_metadata:
            meta = msgspec.defstruct("BlockStoredMetadata", [("cache_salt", str)], omit_defaults=True)
            self._meta = meta
            self._with_meta = msgspec.defstruct(
                "BlockStoredWithMetadata",
                [("metadata", meta)],
                bases=(self._stored,),
                tag="BlockStored",
                kw_only=True,
            )
        self._batch = msgspec.defstruct(
            "EventBatch",
            [("ts", float), ("events", list), (layout.rank_field, Any, None)],
            array_like=True,
            omit_defaults=layout.batch_omit_defaults,
            gc=False,
        )

    def stored(self, **values: Any) -> Any:
        """A BlockStored from every field an engine may know; the layout keeps its own."""
        kept = {n: values.get(n) for n, _ in self.layout.stored}
        salt = values.get("cache_salt")
        if self._with_meta is not None and salt:
            return self._with_meta(**kept, metadata=self._meta(cache_salt=salt))
        return self._stored(**kept)

    def removed(self, **values: Any) -> Any:
        return self._removed(**{n: values.get(n) for n, _ in self.layout.removed})

    def cleared(self) -> Any:
        return self._cleared()

    def batch(self, events: list[Any], ts: float = 1.0, rank: int | None = 0) -> bytes:
        return msgspec.msgpack.encode(self._batch(ts, events, rank))
