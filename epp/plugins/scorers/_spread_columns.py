"""``prefix-spread-scorer``'s kept columns for its bulk path: per candidate position, the engine's
scraped load (running + waiting requests) and freshness, and the decayed new-prompt entry
``(value, as of)``, kept while the candidate list is the same objects in order. Metric changes are
followed through the metrics journal (the positions it names), new-prompt changes through the
scorer's log of changed keys; a list too far behind, or most positions changed, is read again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from epp.framework.candidates import CandidateMemo
from epp.framework.endpoint import Endpoint
from epp.framework.metrics_journal import JOURNAL

_NO_ENTRY = (0.0, -math.inf)  # no new prompts: decays to 0.0 exactly as new_prompts' 0.0


class SpreadColumns:
    """``eng[i]``, ``fresh[i]``: ``endpoints[i]``'s engine load and ``fresh_until``; ``vals[i]``,
    ``sinces[i]``: its new-prompt entry; ``key_pos``: key -> position (None: keys repeat)."""

    __slots__ = (
        "_memo",
        "_seq",
        "eng",
        "fresh",
        "fresh_min",
        "key_pos",
        "new_epoch",
        "new_read",
        "sinces",
        "vals",
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

    def sync_metrics(self, endpoints: list[Endpoint]) -> bool:
        """Bring the metric columns up to ``endpoints``; False when the keys repeat (no bulk)."""
        if self._memo.update(endpoints) and self._seq >= 0:
            seq, changed = JOURNAL.since(self._seq)
            if changed is not None and self._patch(endpoints, changed):
                self._seq = seq
                return self.key_pos is not None
        else:
            self.new_epoch = -1  # another candidate list: the new-prompt columns too
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

    def sync_new(self, new: Mapping[str, tuple[float, float]], log: list[str], epoch: int) -> None:
        """Bring the new-prompt columns up to ``new`` (changed keys in ``log`` since last read)."""
        pos = self.key_pos
        assert pos is not None
        if self.new_epoch != epoch or self.new_read > len(log):
            keys = list(pos)
            entries = [new.get(k, _NO_ENTRY) for k in keys]
            self.vals = [v for v, _ in entries]
            self.sinces = [s for _, s in entries]
            self.new_epoch = epoch
            self.new_read = len(log)
            return
        vals, sinces = self.vals, self.sinces
        for key in log[self.new_read :]:
            i = pos.get(key)
            if i is not None:
                vals[i], sinces[i] = new.get(key, _NO_ENTRY)
        self.new_read = len(log)
