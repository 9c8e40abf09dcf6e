"""Scheduling results and the per-cycle state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from epp.framework.endpoint import Endpoint


@dataclass(slots=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


@dataclass(slots=True)
class ProfileRunResult:
    """The endpoints a profile's picker chose, best first (several = fallbacks).

    ``scores``: each target endpoint's weighted score, when the profile records them
    (``epp serve --emit-endpoint-scores``).
    """

    target_endpoints: list[Endpoint]
    scores: list[float] | None = None


@dataclass(slots=True)
class SchedulingResult:
    """Per-profile results (``None`` = the profile failed or was skipped) and the primary profile.

    The primary profile's endpoints become the destination; other results (prefill, encode) are read
    by PreRequest plugins.
    """

    profile_results: dict[str, ProfileRunResult | None]
    primary_profile_name: str

    @property
    def primary(self) -> ProfileRunResult | None:
        return self.profile_results.get(self.primary_profile_name)


class SchedulingOutcome(NamedTuple):
    """A profile handler's decision: serve the request with ``result``, or fail it with ``error``.

    Exactly one of the two is set. It is a pair, so ``result, error = outcome`` works.
    """

    result: SchedulingResult | None
    error: Exception | None

    @classmethod
    def serve(cls, result: SchedulingResult) -> SchedulingOutcome:
        return cls(result, None)

    @classmethod
    def fail(cls, error: Exception) -> SchedulingOutcome:
        return cls(None, error)


class CycleState(dict[str, Any]):
    """Key/value store shared by all plugins of one request's scheduling cycle.

    Created once per request by the director (so it also serves producers and PreRequest plugins,
    the reference's PluginState), dropped with the request. ``read`` raises ``KeyError``.
    """

    __slots__ = ()

    def read(self, key: str) -> Any:
        return self[key]

    def write(self, key: str, value: Any) -> None:
        self[key] = value


@dataclass(slots=True)
class ResponseInfo:
    """What response-path plugins see: the upstream status and headers, and usage once known.

    ``usage`` is the response's token usage merged over the body seen so far (``prompt_tokens``,
    ``completion_tokens``, ``total_tokens``, optionally ``prompt_tokens_details``). A response-body
    plugin may put Envoy dynamic metadata (``{namespace: {key: value}}``) into ``dynamic_metadata``
    on the end-of-stream call; it rides on the reply that ends the response.
    """

    headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    end_of_stream: bool = False
    usage: dict[str, Any] | None = None
    dynamic_metadata: dict[str, dict[str, Any]] | None = None
