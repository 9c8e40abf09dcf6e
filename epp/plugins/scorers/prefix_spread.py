"""``prefix-spread-scorer``: prefix affinity under a bounded load; cold prompts spread.

One score per endpoint from what the EPP knows at once: the prompt's prefix match there (the
producer's match ratio), the requests in flight there (those this scorer sent and has not seen
finish, or the engine's scraped running + waiting requests when that is higher), and a load bound
(``loadBound`` times the mean in flight, at least ``loadBoundMin``). An endpoint at the bound scores
0 while another is under it, so a hot prefix spills instead of piling up. Under the bound, the match
ratio dominates and a balance term worth up to ``balanceWeight`` prefers the endpoint with the least
load, counting each new prompt it took recently (decaying with ``newPromptHalfLife``) as
``newPromptWeight`` requests: a prompt that matches nowhere goes where the fewest new prefixes and
requests are, so distinct prefixes (conversations, system prompts) spread evenly; exact ties break
by rendezvous hashing of the prompt's first characters (the same cold prefix, the same endpoint,
on every EPP replica). A prompt whose first ``hashPrefixChars`` characters were placed before (a
conversation's next turn, an agent's shared system prompt) but that the prefix index no longer
matches goes back where they went, as a match of ``coldMatchRatio``, while that endpoint is under
the bound: the engine keeps a prompt's head longer than the index remembers its whole.
"""

from __future__ import annotations

import math
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress

from epp.framework import (
    CycleState,
    Endpoint,
    Handle,
    LLMRequest,
    PreRequest,
    RequestDone,
    SchedulingResult,
    Scorer,
    register,
)
from epp.framework.attributes import PREFIX_CACHE_MATCH_INFO_KEY, PrefixCacheMatchInfo, PrefixMatches
from epp.framework.sparse import SparseLabels
from epp.plugins.scorers._data_keys import check_producers
from epp.plugins.scorers._rendezvous import hash_rank
from epp.plugins.scorers._spread_columns import SpreadColumns

__all__ = ["PrefixSpreadParams", "PrefixSpreadScorer"]

TYPE_NAME = "prefix-spread-scorer"
_TIE_WORTH = 0.5  # a hash tie-break is worth less than half an in-flight request: it orders equals only
_EPS = 1e-9
_HEADS = 65536  # prompt heads remembered (their last endpoint), least recently placed forgotten first
_NEW_LOG = 4096  # new-prompt changes logged for the bulk path's columns before they are read afresh
_NEAR = 1e-6  # a C-level pre-filter of the near-best scores, far wider than _EPS
# Scores read the new-prompt decay on a clock of this step (seconds): a minute's half-life moves
# 0.3 % in a step, and the bulk path's decayed column then changes four times a second, not on
# every request.
DECAY_STEP = 0.25


def decay_clock(now: float) -> float:
    """``now`` rounded down to the decay clock's step."""
    return now - now % DECAY_STEP


@dataclass(slots=True, frozen=True)
class PrefixSpreadParams:
    load_bound: float = 1.25
    load_bound_min: int = 8
    balance_weight: float = 0.25
    cold_match_ratio: float = 0.5
    new_prompt_weight: float = 2.0
    new_prompt_half_life: float = 60.0
    hash_prefix_chars: int = 512
    prefix_match_info_producer_name: str = ""

    def validate(self) -> str | None:
        if self.load_bound != 0.0 and self.load_bound < 1.0:
            return f"loadBound: must be 0 (off) or at least 1.0, got {self.load_bound:g}"
        if self.load_bound_min < 1:
            return f"loadBoundMin: must be at least 1, got {self.load_bound_min}"
        if not 0.0 <= self.balance_weight <= 100.0:
            return f"balanceWeight: must be between 0 and 100, got {self.balance_weight:g}"
        if not 0.0 <= self.cold_match_ratio <= 1.0:
            return f"coldMatchRatio: must be between 0 and 1, got {self.cold_match_ratio:g}"
        if not 0.0 <= self.new_prompt_weight <= 1000.0:
            return f"newPromptWeight: must be between 0 and 1000, got {self.new_prompt_weight:g}"
        if self.new_prompt_half_life <= 0.0:
            return f"newPromptHalfLife: must be positive (seconds), got {self.new_prompt_half_life:g}"
        if self.hash_prefix_chars < 0:
            return f"hashPrefixChars: must be non-negative, got {self.hash_prefix_chars}"
        return None


class _Count:
    """One endpoint's requests in flight from this scorer; each change noted in ``log`` (the
    scorer's log of changed keys, read by the bulk path's columns)."""

    __slots__ = ("key", "log", "n")

    def __init__(self, key: str, log: list[str]) -> None:
        self.n = 0
        self.key = key
        self.log = log


class _Charge:
    """A request's counts, released once (at request_done, or when the request is collected)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: list[_Count] = []

    def release(self) -> None:
        for c in self.counts:
            c.n = max(0, c.n - 1)
            c.log.append(c.key)
        self.counts = []

    def __del__(self) -> None:
        if self.counts:
            try:
                self.release()
            except Exception:  # never raise from a finaliser
                pass


def _ratio(info: object) -> float:
    if isinstance(info, PrefixCacheMatchInfo) and info.total_blocks > 0:
        return info.match_blocks / info.total_blocks
    return 0.0


class _RatioTable(dict[object, float]):
    """Matched block count -> its match ratio, computed once per distinct count."""

    __slots__ = ("_infos",)

    def __init__(self, infos: PrefixMatches) -> None:
        super().__init__()
        self._infos = infos

    def __missing__(self, label: object) -> float:
        r = self[label] = _ratio(self._infos.info(label))  # type: ignore[arg-type]
        return r


class _Ratios:
    """The match ratio of each candidate key, read as the mapping ``score`` stores (``get``:
    the ratio where above 0.0, else the default) without building it."""

    __slots__ = ("_pos", "_ratios")

    def __init__(self, pos: dict[str, int], ratios: list[float]) -> None:
        self._pos = pos
        self._ratios = ratios

    def __bool__(self) -> bool:
        return True

    def get(self, key: str, default: float = 0.0) -> float:
        i = self._pos.get(key)
        if i is None:
            return default
        r = self._ratios[i]
        return r if r > 0.0 else default


@register
class PrefixSpreadScorer(Scorer, PreRequest, RequestDone):
    type_name = TYPE_NAME
    category = "Affinity"
    Params = PrefixSpreadParams
    params: PrefixSpreadParams
    consumes = frozenset({PREFIX_CACHE_MATCH_INFO_KEY})

    def __init__(
        self, name: str, params: PrefixSpreadParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else PrefixSpreadParams()
        super().__init__(name, params, handle)
        check_producers(handle, params)
        self._counts: dict[str, _Count] = {}
        self._new: dict[str, tuple[float, float]] = {}  # endpoint key -> (decayed new prompts, as of)
        self._heads: OrderedDict[int, str] = OrderedDict()  # hash of a prompt's head -> its last endpoint
        self._head_key = f"{TYPE_NAME}/{name}/head"
        self._state_key = f"{TYPE_NAME}/{name}"
        self._ratio_key = f"{TYPE_NAME}/{name}/ratio"
        # bulk path: keys whose count changed, keys whose new-prompt entry changed (each log read
        # by the columns; cleared with a new epoch when long), and the columns
        self._count_log: list[str] = []
        self._count_epoch = 0
        self._new_log: list[str] = []
        self._new_epoch = 0
        self._cols = SpreadColumns()

    def load(self, e: Endpoint, now: float) -> int:
        """Requests in flight at ``e``: this scorer's count, or the engine's if known and higher."""
        c = self._counts.get(e.metadata.key)
        own = c.n if c is not None else 0
        m = e.metrics
        if now <= m.fresh_until:
            return max(own, m.running_requests_size + m.waiting_queue_size)
        return own

    def new_prompts(self, key: str, now: float) -> float:
        """New prompts endpoint ``key`` took recently, each decayed by its age (half-life)."""
        entry = self._new.get(key)
        if entry is None:
            return 0.0
        value, since = entry
        return value * 0.5 ** (max(0.0, now - since) / self.params.new_prompt_half_life)

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        n = len(endpoints)
        if n == 0:
            return []
        p = self.params
        now = time.monotonic()
        infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
        get = infos.get if infos else None
        ratios = [_ratio(get(e)) for e in endpoints] if get is not None else [0.0] * n
        loads = [self.load(e, now) for e in endpoints]
        if p.hash_prefix_chars > 0:
            head = hash(request.body.prompt_prefix(p.hash_prefix_chars))
            cycle[self._head_key] = head
            last = self._heads.get(head)
            if last is not None and max(ratios) < p.cold_match_ratio:
                for i, e in enumerate(endpoints):
                    if e.metadata.key == last:
                        ratios[i] = p.cold_match_ratio
                        break
        cycle[self._ratio_key] = {
            e.metadata.key: r for e, r in zip(endpoints, ratios, strict=True) if r > 0.0
        }
        cap = float(max(loads) + 1)
        if p.load_bound > 0.0:
            cap = float(max(p.load_bound_min, math.ceil(p.load_bound * (sum(loads) + 1) / n)))
        under = [load < cap for load in loads]
        bounded = any(under) and not all(under)
        bw, nw = p.balance_weight, p.new_prompt_weight
        t = decay_clock(now)
        news = (
            [self.new_prompts(e.metadata.key, t) for e in endpoints] if nw > 0.0 and self._new else [0.0] * n
        )
        norm = 1.0 + bw
        out = [
            0.0 if bounded and not u else (r + bw * cap / (cap + load + nw * new)) / norm
            for r, load, new, u in zip(ratios, loads, news, under, strict=True)
        ]
        best = max(out)
        tied = [i for i, s in enumerate(out) if s > 0.0 and best - s <= _EPS]
        if len(tied) > 1 and p.hash_prefix_chars > 0:
            # worth less than any load step: bw * (cap/(cap+l) - cap/(cap+l+0.5)) at the cap's far end
            worth = bw * (1.0 / 2.0 - cap / (2.0 * cap + _TIE_WORTH)) / norm
            cands = [endpoints[i] for i in tied]
            rank = hash_rank(request.body.prompt_prefix(p.hash_prefix_chars), cands)
            for i, r in zip(tied, rank, strict=True):
                out[i] += worth * (1.0 - r)
        return out

    def score_bulk(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]
    ) -> Sequence[float] | None:
        """``score`` from kept columns: the same floats, C-level passes over the candidates and
        Python steps only for the prefix holders, the endpoints with requests in flight from here
        and the near-best scores. None (call ``score``) while some candidate's metrics are stale
        or two candidates share a key."""
        n = len(endpoints)
        if n == 0:
            return []
        cols = self._cols
        if not cols.sync_metrics(endpoints):
            return None
        now = time.monotonic()
        if now > cols.fresh_min:
            return None
        pos = cols.key_pos
        assert pos is not None
        p = self.params
        infos = cycle.get(PREFIX_CACHE_MATCH_INFO_KEY)
        labels = infos.labels(endpoints) if isinstance(infos, PrefixMatches) else None
        if isinstance(labels, SparseLabels) and isinstance(infos, PrefixMatches):
            table = _RatioTable(infos)
            ratios = [table[labels.default]] * n
            exceptions = labels.exceptions
            deque(map(ratios.__setitem__, exceptions, map(table.__getitem__, exceptions.values())), maxlen=0)
        elif labels is not None and isinstance(infos, PrefixMatches):
            info = infos.info
            ratios = [_ratio(info(label)) for label in labels]
        elif infos:
            get = infos.get
            ratios = [_ratio(get(e)) for e in endpoints]
        else:
            ratios = [0.0] * n
        if p.hash_prefix_chars > 0:
            head = hash(request.body.prompt_prefix(p.hash_prefix_chars))
            cycle[self._head_key] = head
            last = self._heads.get(head)
            if last is not None and max(ratios) < p.cold_match_ratio:
                at = pos.get(last)
                if at is not None:
                    ratios[at] = p.cold_match_ratio
        cycle[self._ratio_key] = _Ratios(pos, ratios)
        cols.sync_own(self._counts, self._count_log, self._count_epoch)
        loads: list[int] = list(map(max, cols.eng, cols.own)) if any(cols.own) else cols.eng
        lo, hi = min(loads), max(loads)
        cap = float(hi + 1)
        if p.load_bound > 0.0:
            cap = float(max(p.load_bound_min, math.ceil(p.load_bound * (sum(loads) + 1) / n)))
        bounded = lo < cap <= hi  # some under the bound, some at or above it
        bw, nw = p.balance_weight, p.new_prompt_weight
        norm = 1.0 + bw
        k = bw * cap
        if nw > 0.0 and self._new:
            cols.sync_new(
                self._new, self._new_log, self._new_epoch, decay_clock(now), nw, p.new_prompt_half_life
            )
            news = cols.weighted_news
        else:
            news = [nw * 0.0] * n
        # (r + k / (cap + load + news)) / norm, in C-level passes: the same floats as ``score``
        totals = map(operator.add, map(cap.__add__, loads), news)
        out = list(map(norm.__rtruediv__, map(operator.add, ratios, map(k.__truediv__, totals))))
        if bounded:
            for i in compress(range(n), map(cap.__le__, loads)):
                out[i] = 0.0
        best = max(out)
        near = compress(range(n), map((best - _NEAR).__le__, out))
        tied = [i for i in near if out[i] > 0.0 and best - out[i] <= _EPS]
        if len(tied) > 1 and p.hash_prefix_chars > 0:
            worth = bw * (1.0 / 2.0 - cap / (2.0 * cap + _TIE_WORTH)) / norm
            cands = [endpoints[i] for i in tied]
            rank = hash_rank(request.body.prompt_prefix(p.hash_prefix_chars), cands)
            for i, r in zip(tied, rank, strict=True):
                out[i] += worth * (1.0 - r)
        return out

    def _note_new(self, key: str) -> None:
        log = self._new_log
        if len(log) >= _NEW_LOG:
            log.clear()
            self._new_epoch += 1
        log.append(key)

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        ratios: dict[str, float] | _Ratios = cycle.get(self._ratio_key) or {}
        head: int | None = cycle.get(self._head_key)
        charge: _Charge | None = None
        now = time.monotonic()
        primary = result.primary
        if head is not None and primary is not None and primary.target_endpoints:
            heads = self._heads
            heads[head] = primary.target_endpoints[0].metadata.key
            heads.move_to_end(head)
            if len(heads) > _HEADS:
                heads.popitem(last=False)
        for res in result.profile_results.values():
            if res is None or not res.target_endpoints:
                continue
            key = res.target_endpoints[0].metadata.key
            c = self._counts.get(key)
            if c is None:
                c = self._counts[key] = _Count(key, self._count_log)
            if len(self._count_log) >= _NEW_LOG:
                self._count_log.clear()
                self._count_epoch += 1
            c.n += 1
            self._count_log.append(key)
            if ratios.get(key, 0.0) < self.params.cold_match_ratio:
                self._new[key] = (self.new_prompts(key, now) + 1.0, now)
                self._note_new(key)
            if charge is None:
                charge = request.state[self._state_key] = _Charge()
            charge.counts.append(c)

    def request_done(self, request: LLMRequest, result: SchedulingResult) -> None:
        charge: _Charge | None = request.state.pop(self._state_key, None)
        if charge is not None:
            charge.release()

    def remove_endpoint(self, key: str) -> None:
        """Forget an endpoint that left the pool (its requests' counts release harmlessly)."""
        self._counts.pop(key, None)
        self._new.pop(key, None)
        self._count_log.append(key)
        self._note_new(key)

    def in_flight(self, key: str) -> int:
        """Requests this scorer has in flight to endpoint ``key`` (for tests and debugging)."""
        c = self._counts.get(key)
        return c.n if c is not None else 0
