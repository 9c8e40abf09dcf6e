"""Per-request endpoint attributes exchanged between data producers and scorers.

A producer writes ``cycle[KEY] = {endpoint: value}``; a consumer reads ``cycle.get(KEY, {}).get(endpoint)``.
Plugins declare the keys they ``produces``/``consumes``, so the loader can create missing producers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
