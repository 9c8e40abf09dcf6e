"""Rendezvous-hash ranks of endpoints for a seed: the same seed orders the same endpoints the same
way on every EPP replica (tie-breaks of the spreading scorers)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from epp.framework import Endpoint


def hash_rank(seed: bytes, endpoints: Sequence[Endpoint]) -> list[float]:
    """Per endpoint, its rendezvous-hash rank for ``seed`` scaled to [0, 1) (0 = preferred)."""
    n = len(endpoints)
    weights = [
        int.from_bytes(hashlib.blake2b(seed + e.metadata.key.encode(), digest_size=8).digest(), "big")
        for e in endpoints
    ]
    rank = [0.0] * n
    for r, i in enumerate(sorted(range(n), key=weights.__getitem__, reverse=True)):
        rank[i] = r / n
    return rank
