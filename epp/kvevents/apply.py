"""Applying decoded KV events of one endpoint to the KV-block index (the reference's pool logic).

BlockStored: request keys recomputed from ``token_ids`` at the index's block size, chained from
the parent's request key (resolved through the endpoint's engine-key map; an unknown parent skips
the event), namespaced by ``lora_name`` (which vLLM also lists first in every block's
``extra_keys``: dropped there, the namespace carries it), tainted by the per-block extras and by
SGLang's ``cache_salt`` on the first block of a chain; a store without tokens only adds a tier to
blocks already held. A re-store of a block already held is no second copy. BlockRemoved: by engine
key and tier. AllBlocksCleared: the endpoint is cleared. A store labelled with a ``session_id``
(and indexed) is remembered in the session residency, which removals and clears keep current.
Hybrid-attention groups whose kind cannot serve a prefix match are skipped (counted); a group
whose kind was never announced (vLLM 0.20 and 0.21 send ``group_idx`` alone) is a full-attention
group while the endpoint announced no kind.
"""

from __future__ import annotations

from epp.kvcache.block_keys import BlockKeyer, realign_extras, token_bytes
from epp.kvcache.index import KVBlockIndex
from epp.kvcache.sessions import SessionResidency
from epp.kvevents import metrics
from epp.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, EventBatch

__all__ = ["EventApplier"]

_FULL = "full_attention"
_INDEXABLE = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_KINDS = _INDEXABLE | {
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "chunked_local_attention",
    "encoder_only_attention",
    "cross_attention",
}


metrics.seed_skipped(sorted(_INDEXABLE), sorted(_KINDS - _INDEXABLE))


def _kind_label(kind: str | None) -> str:
    """A bounded ``cache_kind`` label value (an engine's unknown kind is ``unknown``)."""
    return kind if kind in _KINDS else "unknown"


_MAX_LORAS = 4096


class EventApplier:
    """Turns an endpoint's event batches into index updates (called on the ingestion thread)."""

    def __init__(
        self, index: KVBlockIndex, keyer: BlockKeyer, sessions: SessionResidency | None = None
    ) -> None:
        self.index = index
        self.keyer = keyer
        self.sessions = sessions  # which endpoints hold a session's blocks (None: not kept)
        self.loras: set[str] = set()  # adapter names seen in events (request-side namespaces)
        self._groups: dict[str, dict[int, str]] = {}  # pod -> group -> cache kind

    def forget(self, pod: str) -> None:
        self._groups.pop(pod, None)
        if self.sessions is not None:
            self.sessions.forget_pod(pod)

    def apply(self, pod: str, batch: EventBatch) -> int:
        """Apply ``batch``; the number of blocks it announced. ``DecodeError`` for bad token ids
        (events before it were applied)."""
        blocks = 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                blocks += len(ev.block_hashes)
                self._stored(pod, ev)
            elif isinstance(ev, BlockRemoved):
                blocks += len(ev.block_hashes)
                self._removed(pod, ev)
            elif isinstance(ev, AllBlocksCleared):
                self.index.clear_pod(pod)
                if self.sessions is not None:
                    self.sessions.forget_pod(pod)
        return blocks

    def _group_kind(self, pod: str, group: int, announced: str | None) -> str | None:
        """The cache kind of an endpoint's group: as announced now or before; a full-attention
        group when the endpoint never announced a kind; None for an unknown group otherwise."""
        groups = self._groups.get(pod)
        if announced:
            if groups is None:
                groups = self._groups[pod] = {}
            groups[group] = announced
            return announced
        if not groups:
            return _FULL
        return groups.get(group)

    def _stored(self, pod: str, ev: BlockStored) -> None:
        if ev.group_idx is not None:
            kind = self._group_kind(pod, ev.group_idx, ev.spec_kind) or ""
            reason = self._undigestible(ev, kind)
            if reason:
                metrics.STORES_SKIPPED.labels(_kind_label(kind), reason).inc()
                return
        index = self.index
        tier = index.tier(ev.medium)
        if not ev.token_ids:
            index.store_tier(pod, ev.block_hashes, tier)
            self._session(pod, ev, tier)
            return
        parent: int | None = None
        if ev.parent is not None:
            parent = index.request_key(pod, ev.parent)
            if parent is None:
                metrics.STORES_SKIPPED.labels(_kind_label(ev.spec_kind), "unknown_parent").inc()
                return
        namespace = ""
        if ev.lora_name:
            namespace = ev.lora_name
            if namespace not in self.loras and len(self.loras) < _MAX_LORAS:
                self.loras.add(namespace)
        elif ev.lora_id is not None:
            namespace = f"\x00lora-id:{ev.lora_id}"  # no name: keep it apart, requests cannot name it
        try:
            data = token_bytes(ev.token_ids)
        except TypeError:
            raise DecodeError("BlockStored: token_ids must be integers") from None
        extras = _event_extras(ev)
        if extras:
            n = len(data) // (4 * self.keyer.block_size)
            extras = realign_extras(extras, n) if n else None
        keys = self.keyer.keys(data, namespace=namespace, parent=parent, extras=extras)
        if keys:
            index.store(pod, ev.block_hashes, keys, tier)
            self._session(pod, ev, tier)

    def _session(self, pod: str, ev: BlockStored, tier: int) -> None:
        """A labelled store of the first tier (the engine's own cache) joins its session's blocks."""
        if ev.session_id and tier == 0 and self.sessions is not None:
            self.sessions.stored(pod, ev.session_id, ev.block_hashes)

    @staticmethod
    def _undigestible(ev: BlockStored, kind: str) -> str:
        if kind not in _INDEXABLE:
            return "unsupported_cache_kind"
        if not ev.token_ids:
            return ""
        if ev.block_size <= 0:
            return "invalid_block_size"
        n = len(ev.token_ids)
        if n % ev.block_size or n // ev.block_size != len(ev.block_hashes):
            return "non_dense_block_span"
        return ""

    def _removed(self, pod: str, ev: BlockRemoved) -> None:
        if ev.group_idx is not None:
            kind = self._group_kind(pod, ev.group_idx, None)
            if kind is None or kind not in _INDEXABLE:
                metrics.REMOVALS_SKIPPED.labels(
                    _kind_label(kind), "unknown_group" if kind is None else "unsupported_cache_kind"
                ).inc()
                return
        tier = self.index.tier(ev.medium)
        forwarded = self.index.remove(pod, ev.block_hashes, tier)
        if tier == 0 and self.sessions is not None:
            self.sessions.removed(pod, ev.block_hashes)
        if forwarded:
            metrics.DEDUP_FORWARDED.inc(forwarded)


def _event_extras(ev: BlockStored) -> list[list[str] | None] | None:
    """Per engine block, the extras that taint its key: vLLM's ``extra_keys`` without the leading
    adapter name (the namespace), and SGLang's ``cache_salt`` on the first block of a chain."""
    extras = ev.extra_keys
    lora = ev.lora_name
    if extras and lora:
        extras = [(e[1:] or None) if e and e[0] == lora else e for e in extras]
    salt = ev.cache_salt
    if salt and ev.parent is None and ev.block_hashes:
        if not extras:
            extras = [None] * len(ev.block_hashes)
        first = extras[0]
        if first is None:
            extras[0] = [salt]
        elif salt not in first:
            extras[0] = [*first, salt]
    return extras if extras and any(extras) else None
