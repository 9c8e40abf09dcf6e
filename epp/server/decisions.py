"""Explained decisions: the last N scheduling decisions in a bounded ring (``/debug/decisions``), a
sampled structured log line per decision, and the Envoy dynamic metadata / optional response header
that carry one request's decision. No prompt text: endpoints, scores, the request id and the model.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass
from typing import Any

import structlog

from epp.scheduling.decision import Decision, Recorded

log = structlog.get_logger("epp.decisions")

# In the routing reply's ``envoy.lb`` dynamic metadata (the namespace every gateway already accepts
# from the EPP): %DYNAMIC_METADATA(envoy.lb:epp.decision:summary)% in Envoy's access log.
METADATA_KEY = "epp.decision"
RESPONSE_HEADER = "x-epp-decision"  # only with --decision-response-header


@dataclass(slots=True)
class Entry:
    """One request's decision (every profile that ran), built when first shown."""

    time: float  # wall clock
    request_id: str
    model: str
    recorded: list[Recorded]

    @property
    def decisions(self) -> list[Decision]:
        return [r.decision() for r in self.recorded]

    @property
    def picked(self) -> str:
        for d in self.decisions:
            for r in d.rows:
                if r.picked:
                    return r.address
        return ""

    def summary(self) -> str:
        return "; ".join(d.summary() for d in self.decisions)

    def metadata(self) -> dict[str, Any]:
        """The ``epp.decision`` key of the routing reply's ``envoy.lb`` dynamic metadata."""
        first = self.recorded[0].decision()
        return {
            "request_id": self.request_id,
            "profile": first.profile,
            "picked": self.picked,
            "summary": self.summary(),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": round(self.time, 3),
            "request_id": self.request_id,
            "model": self.model,
            "picked": self.picked,
            "profiles": [d.to_dict() for d in self.decisions],
        }


class DecisionLog:
    """The last ``size`` decisions (0: none kept) and a log line for a ``sample_rate`` share of them."""

    def __init__(self, size: int = 100, sample_rate: float = 0.01, rng: random.Random | None = None) -> None:
        self.size = size
        self.sample_rate = sample_rate
        self._ring: collections.deque[Entry] = collections.deque(maxlen=max(size, 1))
        self._random = (rng or random.Random()).random

    def record(self, request_id: str, model: str, recorded: list[Recorded]) -> Entry:
        entry = Entry(time.time(), request_id, model, recorded)
        if self.size:
            self._ring.append(entry)
        if self.sample_rate > 0.0 and (self.sample_rate >= 1.0 or self._random() < self.sample_rate):
            log.info("request.decision", **entry.to_dict())
        return entry

    def recent(self, limit: int | None = None) -> list[Entry]:
        """The kept decisions, newest first."""
        entries = list(self._ring) if self.size else []  # copied in one step under the GIL
        entries.reverse()
        return entries[:limit] if limit is not None else entries
