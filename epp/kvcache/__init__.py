"""Precise prefix-cache bookkeeping: request block keys (``block_keys``) and the KV-block index
(``index``) that KV events fill and requests are matched against, and which endpoints hold a
session's blocks (``sessions``)."""

from epp.kvcache.block_keys import (
    HASH_ALGORITHMS,
    BlockKeyer,
    PrefixKeyCache,
    block_extras,
    realign_extras,
    token_bytes,
)
from epp.kvcache.index import (
    DEFAULT_POD_CACHE_SIZE,
    DEFAULT_SIZE,
    OTHER_TIER,
    SPECULATIVE_TIER,
    IndexStats,
    KVBlockIndex,
    PodMatch,
)
from epp.kvcache.sessions import SessionResidency

__all__ = [
    "DEFAULT_POD_CACHE_SIZE",
    "DEFAULT_SIZE",
    "HASH_ALGORITHMS",
    "OTHER_TIER",
    "SPECULATIVE_TIER",
    "BlockKeyer",
    "IndexStats",
    "KVBlockIndex",
    "PodMatch",
    "PrefixKeyCache",
    "SessionResidency",
    "block_extras",
    "realign_extras",
    "token_bytes",
]
