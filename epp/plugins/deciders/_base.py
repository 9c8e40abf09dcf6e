"""The decider contract shared by ``disagg-profile-handler`` and ``pd-profile-handler``.

A decider answers one question after the decode endpoint was picked: should the request also go
through a disaggregated stage (remote prefill, remote encode)? It receives the cycle state so that
it can read per-endpoint data produced for this request (e.g. ``PrefixCacheMatchInfo``). Deciders
run on the scheduling hot path: they must be cheap and must not raise (answer ``False`` instead).
"""

from __future__ import annotations

import abc
from typing import Protocol, runtime_checkable

from epp.framework import CycleState, Endpoint, LLMRequest, Plugin


@runtime_checkable
class SupportsDisaggregate(Protocol):
    """What a handler needs from a decider plugin (checked when the handler is constructed)."""

    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool: ...


class Decider(Plugin, abc.ABC):
    """Base class of the built-in deciders."""

    @abc.abstractmethod
    def disaggregate(self, cycle: CycleState, request: LLMRequest, decode_endpoint: Endpoint) -> bool:
        """True when the stage this decider guards should run for ``request``."""
