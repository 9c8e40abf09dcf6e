"""Per-request endpoint attributes exchanged between data producers and scorers.

A producer writes ``cycle[KEY] = {endpoint: value}``; a consumer reads ``cycle.get(KEY, {}).get(endpoint)``.
Plugins declare the keys they ``produces``/``consumes``, so the loader can create missing producers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from epp.framework.sparse import SparseLabels

PREFIX_CACHE_MATCH_INFO_KEY = "PrefixCacheMatchInfoKey"
INFLIGHT_LOAD_KEY = "InFlightLoadKey"
LATENCY_PREDICTION_INFO_KEY = "LatencyPredictionInfoKey"
TOKENIZED_PROMPT_KEY = "TokenizedPrompt"
"""Request data (``LLMRequest.body.tokenized``) written by a ``token-producer``: the prompt's token ids."""
MM_EMBEDDINGS_MATCH_INFO_KEY = "MultiModalEncoderCacheMatchInfoKey"
"""Per endpoint: an ``EncoderCacheMatchInfo`` (``mm-embeddings-cache-producer``)."""
OUTLEN_BUCKET_KEY = "outlen-bucket"
"""Request attribute (``LLMRequest.state``): the predicted output length, ``"LONG"``, ``"SHORT"`` or
``"UNKNOWN"`` (``outlen-bucket``); the in-flight load estimates ``OUTLEN_OUTPUT_TOKENS`` from it."""
OUTLEN_OUTPUT_TOKENS: dict[str, int] = {"LONG": 4096, "SHORT": 100, "UNKNOWN": 1000}
SESSION_STATE_KEY = "SessionStateDataKey"
"""Request attribute (``LLMRequest.state``, under ``SessionStateDataKey/<producer name>``): a
``SessionState``."""
AGENT_IDENTITY_KEY = "agent-identity"
"""Request attribute (``LLMRequest.state``): the agent session identity of a request (a string)."""


@dataclass(slots=True, frozen=True)
class PrefixCacheMatchInfo:
    """How many leading prompt blocks an endpoint is believed to hold in its KV cache."""

    match_blocks: int
    total_blocks: int
    block_size_tokens: int

    @property
    def ratio(self) -> float:
        return self.match_blocks / self.total_blocks if self.total_blocks > 0 else 0.0


@dataclass(slots=True, frozen=True)
class TokenizedPrompt:
    """A request's prompt as token ids, as the model server will see it.

    ``exact``: the ids come from the model's real tokenizer (a local tokenizer file or the model
    server's render endpoint); False for the estimate backend, whose ids are only stable
    stand-ins (equal text prefixes give equal id prefixes) and never match an engine's blocks.
    ``mm_hashes``: per multimodal item, its content hash and placeholder (offset, length) in ids.
    """

    token_ids: Sequence[int]
    exact: bool = True
    mm_hashes: tuple[tuple[str, int, int], ...] = ()


@dataclass(slots=True, frozen=True)
class MMItem:
    """One unique multimodal item of a request: its content hash and modality (image, video, ...)."""

    hash: str
    modality: str


@dataclass(slots=True, frozen=True)
class EncoderCacheMatchInfo:
    """A request's unique multimodal items and those an endpoint likely holds embeddings of."""

    matched: tuple[MMItem, ...]
    items: tuple[MMItem, ...]

    @property
    def ratio(self) -> float:
        return len(self.matched) / len(self.items) if self.items else 0.0


@dataclass(slots=True, frozen=True)
class SessionState:
    """A session's history before the current request (``session-state-producer``): turns
    dispatched, seconds since the session was first seen, and when (``time.time()``) the previous
    request was seen (the current request's time for a new session)."""

    turns_taken: int
    duration: float
    last_seen_at: float


@dataclass(slots=True, frozen=True)
class InFlightLoad:
    """Requests and estimated tokens this EPP has routed to an endpoint and not yet seen finish."""

    tokens: int
    requests: int


@dataclass(slots=True, frozen=True)
class LatencyPredictionInfo:
    """An endpoint's predicted latency for one request, against the request's SLOs (milliseconds).

    ``ttft_headroom = SLO - ttft`` (negative: the prediction misses the SLO; with no SLO the SLO is
    0, so headroom is ``-ttft``); likewise for TPOT against the buffered TPOT SLO. ``tpot_valid`` is
    True and ``tpot_headroom`` 0 when TPOT does not apply (non-streaming mode, prefill endpoints).
    ``dispatched_request_count``: requests the producer has routed there and not seen finish.
    ``source``: which model predicted, ``"endpoint"`` (its own) or ``"pool"`` (the pool-wide one,
    while the endpoint's own model warms up).
    """

    ttft_valid: bool
    tpot_valid: bool
    ttft_headroom: float
    tpot_headroom: float
    ttft: float
    tpot: float
    dispatched_request_count: int
    source: str = "endpoint"

    @property
    def valid(self) -> bool:
        return self.ttft_valid and self.tpot_valid


SCOPED_DATA_KEYS = frozenset(
    {
        PREFIX_CACHE_MATCH_INFO_KEY,
        INFLIGHT_LOAD_KEY,
        LATENCY_PREDICTION_INFO_KEY,
        MM_EMBEDDINGS_MATCH_INFO_KEY,
    }
)
"""Per-request data keys confined to the plugins that declare them (``consumes``/``produces``): the
framework counts an access by a filter, scorer or data producer that did not declare the key."""

# data key -> the producer type created when some plugin consumes the key and none produces it
DEFAULT_PRODUCERS: dict[str, str] = {
    PREFIX_CACHE_MATCH_INFO_KEY: "approx-prefix-cache-producer",
    INFLIGHT_LOAD_KEY: "inflight-load-producer",
    TOKENIZED_PROMPT_KEY: "token-producer",
    LATENCY_PREDICTION_INFO_KEY: "predicted-latency-producer",
}


Groups = Sequence[tuple[int, "str | frozenset[str]"]]
"""Holder groups of a prefix match: ``(count, holders)`` deepest first, nested (a pair's holders
include the deeper pairs'); a key's count is that of the deepest pair holding it."""


def _has(holders: str | frozenset[str], key: str) -> bool:
    return holders == key if isinstance(holders, str) else key in holders


def _within(holders: str | frozenset[str], keys: frozenset[str] | set[str]) -> Iterable[str]:
    """The holders that are in ``keys`` (iterating the smaller side)."""
    if isinstance(holders, str):
        return (holders,) if holders in keys else ()
    return holders & keys


def group_count(groups: Groups, key: str) -> int:
    """``key``'s matched block count in ``groups`` (0: none)."""
    for count, holders in groups:
        if _has(holders, key):
            return count
    return 0


def group_counts(groups: Groups) -> dict[str, int]:
    """Every holder's matched block count (what ``PrefixIndex.match`` returns)."""
    counts: dict[str, int] = {}
    for count, holders in reversed(groups):  # shallow first: the deeper pairs overwrite
        counts.update(dict.fromkeys((holders,) if isinstance(holders, str) else holders, count))
    return counts


def _size(holders: str | frozenset[str]) -> int:
    return 1 if isinstance(holders, str) else len(holders)


class PrefixMatches(dict[Any, PrefixCacheMatchInfo]):
    """``{endpoint: PrefixCacheMatchInfo}`` over a producer's candidates, built from the few matched.

    A prefix producer writes this instead of a full dict: ``get``, ``[]`` and ``in`` answer from the
    matched keys and the candidate set at once; anything that walks or changes the mapping fills it
    with every candidate first, so it reads as the plain dict it replaces. ``labels`` gives the
    bulk path. ``endpoints`` and ``keys`` (their ``metadata.key``) must not change afterwards.
    The matches are per-key ``counts``, or holder ``groups`` (``Groups``, with the candidates'
    ``key_positions`` and ``key_set``: then ``labels`` answers with ``SparseLabels``, whose cost follows the
    endpoints that differ from the most common count rather than the candidates).
    """

    __slots__ = (
        "_block_size",
        "_counts",
        "_filled",
        "_groups",
        "_infos",
        "_key_positions",
        "_key_set",
        "_keys",
        "_members",
        "_order",
        "_total",
        "_zero",
    )

    def __init__(
        self,
        endpoints: Sequence[Any],
        members: frozenset[Any],
        keys: Sequence[str],
        counts: Mapping[str, int] | None,
        total_blocks: int,
        block_size_tokens: int,
        groups: Groups = (),
        key_positions: Mapping[str, int] | None = None,
        key_set: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self._order = endpoints
        self._members = members
        self._keys = keys
        self._counts = counts
        self._groups = groups
        self._key_positions = key_positions
        self._key_set = key_set
        self._zero = PrefixCacheMatchInfo(0, total_blocks, block_size_tokens)
        self._total = total_blocks
        self._block_size = block_size_tokens
        self._infos: dict[int, PrefixCacheMatchInfo] = {}  # one shared info per count, made on demand
        self._filled = False

    @property
    def counts(self) -> Mapping[str, int]:
        """Matched block count per endpoint key (matched keys only)."""
        c = self._counts
        if c is None:
            c = self._counts = group_counts(self._groups)
        return c

    def _fill(self) -> None:
        if not self._filled:
            self._filled = True
            get, info = self.counts.get, self.info
            for e in self._order:
                dict.__setitem__(self, e, info(get(e.metadata.key)))

    def info(self, count: int | None) -> PrefixCacheMatchInfo:
        """The (shared) info of a matched block count; None: no match."""
        if count is None:
            return self._zero
        info = self._infos.get(count)
        if info is None:
            info = self._infos[count] = PrefixCacheMatchInfo(count, self._total, self._block_size)
        return info

    def labels(self, endpoints: list[Any]) -> Iterable[int | None] | SparseLabels | None:
        """The bulk path when ``endpoints`` are the producer's candidates, in order: each one's
        matched block count (None: no match; ``info`` turns a count into its info), as an iterator
        or as ``SparseLabels``. None for another list."""
        if self._filled or endpoints != self._order:
            return None
        positions = self._key_positions
        if self._groups and positions is not None:
            return self._sparse(positions)
        counts = self.counts
        if not counts:
            return repeat(None, len(endpoints))
        return map(counts.get, self._keys)

    def _sparse(self, positions: Mapping[str, int]) -> SparseLabels:
        """The most common count (by the group sizes) as the default; the others by position.
        C-level set operations, and Python steps only for the endpoints that differ."""
        n = len(self._keys)
        groups = self._groups
        if not groups:
            return SparseLabels(n, None, {})
        sizes = [_size(h) for _, h in groups]
        best, most = len(groups), n - sizes[-1]  # the unmatched
        for m, size in enumerate(sizes):
            exact = size - (sizes[m - 1] if m else 0)
            if exact > most:
                best, most = m, exact
        keyset = self._key_set
        found: dict[str, int | None] = {}
        for k in range(best - 1, -1, -1):  # the deeper groups; the deepest overwrite
            found.update(dict.fromkeys(_within(groups[k][1], keyset), groups[k][0]))
        if best < len(groups):
            dominant = groups[best][1]
            rest = keyset - ({dominant} if isinstance(dominant, str) else dominant)
            if rest:
                shallower: dict[str, int | None] = dict.fromkeys(rest)
                for k in range(len(groups) - 1, best, -1):
                    shallower.update(dict.fromkeys(_within(groups[k][1], rest), groups[k][0]))
                found.update(shallower)
        default = groups[best][0] if best < len(groups) else None
        return SparseLabels(
            n, default, dict(zip(map(positions.__getitem__, found), found.values(), strict=True))
        )

    def get(self, endpoint: Any, default: Any = None) -> Any:
        if self._filled:
            return dict.get(self, endpoint, default)
        if endpoint not in self._members:
            return default
        return self.info(self.counts.get(endpoint.metadata.key))

    def __getitem__(self, endpoint: Any) -> PrefixCacheMatchInfo:
        info = self.get(endpoint, None)
        if info is None:
            raise KeyError(endpoint)
        return info

    def __contains__(self, endpoint: object) -> bool:
        return dict.__contains__(self, endpoint) if self._filled else endpoint in self._members

    def __len__(self) -> int:
        return dict.__len__(self) if self._filled else len(self._members)

    def __iter__(self) -> Iterator[Any]:
        self._fill()
        return dict.__iter__(self)

    def __reversed__(self) -> Iterator[Any]:
        self._fill()
        return dict.__reversed__(self)

    def __repr__(self) -> str:
        self._fill()
        return dict.__repr__(self)

    def __eq__(self, other: object) -> bool:
        self._fill()
        if isinstance(other, PrefixMatches):
            other._fill()
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None

    def __setitem__(self, endpoint: Any, info: PrefixCacheMatchInfo) -> None:
        self._fill()
        dict.__setitem__(self, endpoint, info)

    def __delitem__(self, endpoint: Any) -> None:
        self._fill()
        dict.__delitem__(self, endpoint)

    def __or__(self, other: Any) -> Any:
        self._fill()
        return dict(self) | other

    def __ior__(self, other: Any) -> Any:
        self._fill()
        dict.update(self, other)
        return self

    def keys(self) -> Any:
        self._fill()
        return dict.keys(self)

    def values(self) -> Any:
        self._fill()
        return dict.values(self)

    def items(self) -> Any:
        self._fill()
        return dict.items(self)

    def copy(self) -> dict[Any, PrefixCacheMatchInfo]:
        self._fill()
        return dict(dict.items(self))

    def pop(self, *args: Any) -> Any:
        self._fill()
        return dict.pop(self, *args)

    def popitem(self) -> tuple[Any, PrefixCacheMatchInfo]:
        self._fill()
        return dict.popitem(self)

    def setdefault(self, *args: Any) -> Any:
        self._fill()
        return dict.setdefault(self, *args)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._fill()
        dict.update(self, *args, **kwargs)

    def clear(self) -> None:
        self._filled = True
        dict.clear(self)

    def __reduce__(self) -> Any:
        self._fill()
        return (dict, (dict(dict.items(self)),))
