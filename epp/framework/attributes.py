"""Per-request endpoint attributes exchanged between data producers and scorers.

A producer writes ``cycle[KEY] = {endpoint: value}``; a consumer reads ``cycle.get(KEY, {}).get(endpoint)``.
Plugins declare the keys they ``produces``/``consumes``, so the loader can create missing producers.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX_CACHE_MATCH_INFO_KEY = "PrefixCacheMatchInfoKey"
INFLIGHT_LOAD_KEY = "InFlightLoadKey"
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
class InFlightLoad:
    """Requests and estimated tokens this EPP has routed to an endpoint and not yet seen finish."""

    tokens: int
    requests: int


# data key -> the producer type created when some plugin consumes the key and none produces it
DEFAULT_PRODUCERS: dict[str, str] = {
    PREFIX_CACHE_MATCH_INFO_KEY: "approx-prefix-cache-producer",
    INFLIGHT_LOAD_KEY: "inflight-load-producer",
}
