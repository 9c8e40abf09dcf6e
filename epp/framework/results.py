"""Scheduling results and the per-cycle state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from epp.framework.attributes import SCOPED_DATA_KEYS
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


class ScopeCheck(Protocol):
    """The data scope of the plugin running now: the keys it declared it reads and writes."""

    reads: frozenset[str]
    writes: frozenset[str]

    def violation(self, access: str, key: str) -> None: ...


class CycleState(dict[str, Any]):
    """Key/value store shared by all plugins of one request's scheduling cycle.

    Created once per request by the director (so it also serves producers and PreRequest plugins,
    the reference's PluginState), dropped with the request. ``read`` raises ``KeyError``.
    While the framework runs a filter, scorer or data producer, ``scope`` is that plugin's: a read
    (``get``, ``[]``) or write (``[]=``) of a ``SCOPED_DATA_KEYS`` key it did not declare is reported
    to it (one set lookup per access; the access itself proceeds).
    """

    __slots__ = ("scope",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scope: ScopeCheck | None = None

    def get(self, key: str, default: Any = None) -> Any:
        scope = self.scope
        if scope is not None and key in SCOPED_DATA_KEYS and key not in scope.reads:
            scope.violation("read", key)
        return dict.get(self, key, default)

    def __getitem__(self, key: str) -> Any:
        scope = self.scope
        if scope is not None and key in SCOPED_DATA_KEYS and key not in scope.reads:
            scope.violation("read", key)
        return dict.__getitem__(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        scope = self.scope
        if scope is not None and key in SCOPED_DATA_KEYS and key not in scope.writes:
            scope.violation("write", key)
        dict.__setitem__(self, key, value)

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
