"""What a profile decided and why: the picked endpoints, the best runners-up and each scorer's
weighted score of each of them, taken from the scores the profile computed to pick (nothing is
scored again). A profile records one ``Recorded`` per run in the cycle state under ``DECISION_KEY``:
references to its scores, turned into a ``Decision`` only when something shows it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.framework.endpoint import Endpoint

DECISION_KEY = "epp.scheduling.decision"  # cycle state: list[Recorded], one per profile run
RUNNERS_UP = 2  # the best endpoints not picked, shown beside the picked ones


@dataclass(slots=True)
class Row:
    """One endpoint of a decision: its weighted score per scorer (in ``Decision.scorers`` order)."""

    name: str
    address: str
    picked: bool
    total: float
    scores: tuple[float, ...]


@dataclass(slots=True)
class Decision:
    profile: str
    candidates: int  # endpoints scored (after the filters)
    scorers: tuple[tuple[str, float], ...]  # (scorer name, weight)
    rows: tuple[Row, ...]  # the picked endpoints (in pick order), then the runners-up (best first)

    def to_dict(self) -> dict[str, Any]:
        names = [s for s, _ in self.scorers]
        return {
            "profile": self.profile,
            "candidates": self.candidates,
            "weights": dict(self.scorers),
            "endpoints": [
                {
                    "name": r.name,
                    "address": r.address,
                    "picked": r.picked,
                    "total": round(r.total, 4),
                    "scores": {n: round(v, 4) for n, v in zip(names, r.scores, strict=True)},
                }
                for r in self.rows
            ],
        }

    def summary(self) -> str:
        """One line: ``profile: *addr=total(scorer=s,...) addr=total(...)`` (``*`` marks a pick)."""
        names = [s for s, _ in self.scorers]
        parts = []
        for r in self.rows:
            detail = ",".join(f"{n}={v:.3f}" for n, v in zip(names, r.scores, strict=True))
            parts.append(f"{'*' if r.picked else ''}{r.address}={r.total:.3f}({detail})")
        return f"{self.profile}: " + " ".join(parts)


class Recorded:
    """A profile run's scores as they were; ``decision()`` builds the ``Decision`` on first use (from
    any thread: the metrics port reads recorded decisions too)."""

    __slots__ = ("_args", "_decision")

    def __init__(
        self,
        profile: str,
        scorers: Sequence[Any],
        raw: Sequence[Sequence[float] | None],
        endpoints: Sequence[Endpoint],
        totals: Sequence[float],
        picked: Sequence[Endpoint],
    ) -> None:
        """``scorers``: the profile's weighted scorers (``.scorer.name``, ``.weight``)."""
        self._decision: Decision | None = None
        self._args: tuple[Any, ...] | None = (profile, scorers, raw, endpoints, totals, picked)

    @classmethod
    def built(cls, decision: Decision) -> Recorded:
        """A recording of a decision already built."""
        recorded = cls.__new__(cls)
        recorded._decision, recorded._args = decision, None
        return recorded

    def decision(self) -> Decision:
        args = self._args
        if args is None:  # built (set before the arguments were dropped)
            assert self._decision is not None
            return self._decision
        profile, scorers, raw, endpoints, totals, picked = args
        names = [(ws.scorer.name, ws.weight) for ws in scorers]
        self._decision = record(profile, names, raw, endpoints, totals, picked)
        self._args = None  # the endpoints and score lists can go
        return self._decision


def record(
    profile: str,
    scorers: Sequence[tuple[str, float]],
    raw: Sequence[Sequence[float] | None],
    endpoints: Sequence[Endpoint],
    totals: Sequence[float],
    picked: Sequence[Endpoint],
) -> Decision:
    """The decision from the scores a profile ran on: ``raw[j][i]`` is scorer ``j``'s unweighted score
    of ``endpoints[i]`` (``raw[j]`` None: a scorer of weight 0 left uncalled), ``totals[i]`` the
    weighted sum. O(endpoints) for the runners-up."""
    index = {id(e): i for i, e in enumerate(endpoints)} if len(picked) > 1 else None
    chosen: list[int] = []
    for e in picked:
        if index is not None:
            i = index.get(id(e), -1)
        else:
            i = next((k for k, x in enumerate(endpoints) if x is e), -1)
        if i >= 0:
            chosen.append(i)
    taken = set(chosen)
    others = (i for i in range(len(endpoints)) if i not in taken)
    runners = heapq.nlargest(RUNNERS_UP, others, key=totals.__getitem__)
    weights = [w for _, w in scorers]
    rows = []
    for i in (*chosen, *runners):
        e = endpoints[i]
        weighted = tuple(
            0.0 if row is None else _clamp(row[i]) * w for row, w in zip(raw, weights, strict=True)
        )
        rows.append(Row(e.metadata.name, e.hostport, i in taken, float(totals[i]), weighted))
    return Decision(profile, len(endpoints), tuple(scorers), tuple(rows))


def _clamp(s: float) -> float:
    return float(s) if 0.0 < s < 1.0 else 1.0 if s >= 1.0 else 0.0  # as the profile sums (NaN: 0)
