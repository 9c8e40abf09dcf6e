"""``prefix-spread-scorer``'s kept columns for its bulk path: per candidate position, the engine's
scraped load (running + waiting requests) and freshness, and the decayed new-prompt entry
``(value, as of)``, kept while the candidate list is the same objects in order. Metric changes are
followed through the metrics journal (the positions it names), new-prompt changes through the
scorer's log of changed keys; a list too far behind, or most positions changed, is read again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from epp.framework.candidates import CandidateMemo
from epp.framework.endpoint import Endpoint
from epp.framework.metrics_journal import JOURNAL


class _HasCount(Protocol):
    n: int


_NO_ENTRY = (0.0, -math.inf)  # no new prompts: decays to 0.0 exactly as new_prompts' 0.0


class SpreadColumns:
    """``eng[i]``, ``fresh[i]``: ``endpoints[i]``'s engine load and ``fresh_until``; ``vals[i]``,
    ``sinces[i]``: its new-prompt entry; ``key_pos``: key -> position (None: keys repeat)."""

    __slots__ = (
        "_decay",
        "_memo",
        "_seq",
        "eng",
        "fresh",
        "fresh_min",
        "key_pos",
        "new_epoch",
        "new_read",
        "own",
        "own_epoch",
        "own_read",
        "sinces",
        "vals",
        "weighted_news",
    )

    def __init__(self) -> None:
        self._memo = CandidateMemo()
        self._seq = -1  # journal number the metric columns were read at (-1: nothing kept)
        self.eng: list[int] = []
        self.fresh: list[float] = []
        self.fresh_min = -math.inf
        self.key_pos: dict[str, int] | None = None
        self.vals: list[float] = []
        self.sinces: list[float] = []
        self.new_epoch = -1  # the scorer's log epoch the new-prompt columns follow (-1: none)
        self.new_read = 0  # entries of that log already applied
        self.own: list[int] = []  # requests in flight from the scorer, per position
        self.own_epoch = -1  # the scorer's count-log epoch ``own`` follows (-1: none)
        self.own_read = 0
        self.weighted_news: list[float] = []  # newPromptWeight x the decayed entry, at ``_decay``
        self._decay: tuple[float, float, float] | None = None  # (clock, weight, half-life) of it

    def sync_metrics(self, endpoints: list[Endpoint]) -> bool:
        """Bring the metric columns up to ``endpoints``; False when the keys repeat (no bulk)."""
        if self._memo.update(endpoints) and self._seq >= 0:
            seq, changed = JOURNAL.since(self._seq)
            if changed is not None and self._patch(endpoints, changed):
                self._seq = seq
                return self.key_pos is not None
        else:
            self.new_epoch = -1  # another candidate list: the new-prompt and count columns too
            self.own_epoch = -1
        self._seq = JOURNAL.seq  # before reading: a later change is patched next time
        ms = [e.metrics for e in endpoints]
        self.eng = [m.running_requests_size + m.waiting_queue_size for m in ms]
        self.fresh = [m.fresh_until for m in ms]
        self.fresh_min = min(self.fresh, default=math.inf)
        self.key_pos = self._memo.key_positions()
        return self.key_pos is not None

    def _patch(self, endpoints: list[Endpoint], changed: list[Endpoint]) -> bool:
        if not changed:
            return True
        get = self._memo.positions().get
        idx = {i for i in map(get, changed) if i is not None}
        if len(idx) * 4 > len(endpoints):
            return False  # most changed: reading all again is cheaper
        eng, fresh = self.eng, self.fresh
        for i in idx:
            m = endpoints[i].metrics
            eng[i] = m.running_requests_size + m.waiting_queue_size
            fresh[i] = m.fresh_until
        if idx:
            self.fresh_min = min(fresh, default=math.inf)
        return True

    def keys(self) -> list[str]:
        """The candidates' keys, in order."""
        return self._memo.keys()

    def sync_own(self, counts: Mapping[str, _HasCount], log: list[str], epoch: int) -> None:
        """Bring ``own`` up to ``counts`` (keys whose count changed in ``log`` since last read)."""
        pos = self.key_pos
        assert pos is not None
        if self.own_epoch != epoch or self.own_read > len(log):
            get = counts.get
            self.own = [c.n if (c := get(k)) is not None else 0 for k in pos]
            self.own_epoch = epoch
        else:
            own = self.own
            for key in log[self.own_read :]:
                i = pos.get(key)
                if i is not None:
                    c = counts.get(key)
                    own[i] = c.n if c is not None else 0
        self.own_read = len(log)

    def sync_new(
        self,
        new: Mapping[str, tuple[float, float]],
        log: list[str],
        epoch: int,
        t: float,
        weight: float,
        half_life: float,
    ) -> None:
        """Bring the new-prompt columns up to ``new`` (changed keys in ``log`` since last read), and
        ``weighted_news`` to ``weight`` times each entry decayed to clock ``t``."""
        pos = self.key_pos
        assert pos is not None
        if self.new_epoch != epoch or self.new_read > len(log):
            keys = list(pos)
            entries = [new.get(k, _NO_ENTRY) for k in keys]
            self.vals = [v for v, _ in entries]
            self.sinces = [s for _, s in entries]
            self.new_epoch = epoch
            self.new_read = len(log)
            self._decay = None
        else:
            vals, sinces = self.vals, self.sinces
            weighted = self.weighted_news if self._decay == (t, weight, half_life) else None
            for key in log[self.new_read :]:
                i = pos.get(key)
                if i is not None:
                    vals[i], sinces[i] = v, since = new.get(key, _NO_ENTRY)
                    if weighted is not None:
                        weighted[i] = _weighted(v, since, t, weight, half_life)
            self.new_read = len(log)
        if self._decay != (t, weight, half_life):
            self.weighted_news = [
                _weighted(v, since, t, weight, half_life)
                for v, since in zip(self.vals, self.sinces, strict=True)
            ]
            self._decay = (t, weight, half_life)


def _weighted(value: float, since: float, t: float, weight: float, half_life: float) -> float:
    """``weight`` x the entry ``(value, since)`` decayed to ``t`` (as the scorer's ``new_prompts``)."""
    return weight * (value * 0.5 ** (max(0.0, t - since) / half_life))
