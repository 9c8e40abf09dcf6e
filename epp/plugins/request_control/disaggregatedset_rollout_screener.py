"""``disaggregatedset-rollout-screener`` (alpha): keeps prefill and decode on one DisaggregatedSet
revision during a rollout.

Revision gating (``sum`` / ``max-role``): the pool's endpoints matching ``scope.labelSelector``
are counted per revision and role (one per pod). A revision lacking a Ready pod of any required
role gets no traffic; the others get a share by weight (``sum``: its pods of every required role;
``max-role``: its pods of the role with the largest total, ties to the first listed), and each
request without a strict header is confined to one revision drawn by those shares, so every
profile sees the same revision. Strict header selectors then keep only endpoints whose label
equals the request header (none left: 503). Every selector stamps the serving endpoint's label
into its response header.
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from epp import promlite
from epp.framework import (
    ConfigError,
    Endpoint,
    Handle,
    LLMRequest,
    ResponseHeaderProcessor,
    ResponseInfo,
    Screener,
    Stability,
    register,
)
from epp.framework.params import OMIT_UNSET

__all__ = [
    "DEFAULT_REVISION_LABEL",
    "DEFAULT_ROLE_LABEL",
    "DisaggregatedSetRolloutScreener",
    "DisaggregatedSetRolloutScreenerParams",
    "parse_label_selector",
]

DEFAULT_REVISION_LABEL = "disaggregatedset.x-k8s.io/revision"
DEFAULT_ROLE_LABEL = "disaggregatedset.x-k8s.io/role"
GATING_MODES = ("sum", "max-role", "disabled")
SELECTOR_MODES = ("strict", "prefer")

STRICT_NO_MATCH = promlite.Counter(
    "llm_d_epp_disaggregatedset_strict_header_no_match_total",
    "[ALPHA] Strict header selections that matched no endpoint and failed closed.",
    ["plugin_type", "plugin_name", "selector"],
)
GATING_SHARE = promlite.Gauge(
    "llm_d_epp_disaggregatedset_revision_gating_share",
    "[ALPHA] Current weighted revision gating share from 0 to 1; incomplete revisions have share 0.",
    ["plugin_type", "plugin_name", "mode", "revision"],
)
promlite.register(STRICT_NO_MATCH, owners=("disaggregatedset-rollout-screener",))
promlite.register(GATING_SHARE, owners=("disaggregatedset-rollout-screener",))


# --- label selectors (Kubernetes syntax) -------------------------------------------------------

_KEY = r"(?:[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_TERM = re.compile(
    rf"\s*(?:(?P<not>!)\s*(?P<nkey>{_KEY})"
    rf"|(?P<key>{_KEY})\s*(?:(?P<op>==|!=|=)\s*(?P<value>{_VALUE})"
    rf"|\s+(?P<set>in|notin)\s*\((?P<values>[^()]*)\))?)\s*(?:,|$)"
)


@dataclass(slots=True, frozen=True)
class _Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        op = self.op
        if op == "exists":
            return self.key in labels
        if op == "!":
            return self.key not in labels
        value = labels.get(self.key)
        if op in ("=", "in"):
            return value is not None and value in self.values
        return value is None or value not in self.values  # "!=" and "notin" match a missing label


def parse_label_selector(text: str) -> tuple[_Requirement, ...]:
    """The requirements of a Kubernetes label selector string; ``ValueError`` naming the bad term."""
    out: list[_Requirement] = []
    pos, n = 0, len(text)
    if not text.strip():
        return ()
    while pos < n:
        m = _TERM.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"invalid label selector term at {text[pos:]!r}")
        pos = m.end()
        if m["not"]:
            out.append(_Requirement(m["nkey"], "!"))
        elif m["op"]:
            op = "!=" if m["op"] == "!=" else "="
            out.append(_Requirement(m["key"], op, frozenset({m["value"]})))
        elif m["set"]:
            values = [v.strip() for v in m["values"].split(",")]
            if not all(re.fullmatch(_VALUE, v) for v in values):
                raise ValueError(f"invalid values in {m.group(0).strip()!r}")
            out.append(_Requirement(m["key"], m["set"], frozenset(values)))
        else:
            out.append(_Requirement(m["key"], "exists"))
    return tuple(out)


# --- parameters ----------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ScopeSpec:
    label_selector: str = ""


@dataclass(slots=True, frozen=True)
class HeaderSelectorSpec:
    name: str = ""
    header_name: str = ""
    label_key: str = ""
    mode: str = ""


@dataclass(slots=True, frozen=True)
class RequireRolesSpec:
    values: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class RevisionGatingSpec:
    revision_label_key: str = field(default="", metadata=OMIT_UNSET)
    role_label_key: str = field(default="", metadata=OMIT_UNSET)
    mode: str = ""
    require_roles: RequireRolesSpec | None = field(default=None, metadata=OMIT_UNSET)


@dataclass(slots=True, frozen=True)
class DisaggregatedSetRolloutScreenerParams:
    scope: ScopeSpec = field(default_factory=ScopeSpec)
    header_selectors: tuple[HeaderSelectorSpec, ...] = ()
    revision_gating: RevisionGatingSpec | None = None

    def validate(self) -> str | None:
        if not self.scope.label_selector:
            return "scope.labelSelector: is required"
        try:
            parse_label_selector(self.scope.label_selector)
        except ValueError as e:
            return f"scope.labelSelector: is not a valid label selector: {e}"
        names: set[str] = set()
        headers: set[str] = set()
        for i, s in enumerate(self.header_selectors):
            for key, value in (("name", s.name), ("headerName", s.header_name), ("labelKey", s.label_key)):
                if not value:
                    return f"headerSelectors[{i}].{key}: is required"
            if s.mode not in SELECTOR_MODES:
                return f"headerSelectors[{i}].mode: {s.mode!r} must be one of strict|prefer"
            if s.name in names:
                return f"headerSelectors: duplicate name {s.name!r}"
            if s.header_name.lower() in headers:
                return f"headerSelectors: duplicate headerName {s.header_name.lower()!r}"
            names.add(s.name)
            headers.add(s.header_name.lower())
        g = self.revision_gating
        if g is None:
            return "revisionGating: is required"
        if g.mode not in GATING_MODES:
            return f"revisionGating.mode: {g.mode!r} must be one of sum|max-role|disabled"
        if g.mode != "disabled":
            if g.require_roles is None:
                return f"revisionGating.requireRoles: is required when revisionGating.mode={g.mode}"
            roles = g.require_roles.values
            if not roles:
                return "revisionGating.requireRoles.values: must contain at least one role"
            for i, role in enumerate(roles):
                if not role:
                    return f"revisionGating.requireRoles.values[{i}]: must not be empty"
                if role in roles[:i]:
                    return f"revisionGating.requireRoles.values: contains duplicate role {role!r}"
        return None


# --- the plugin --------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Selector:
    name: str
    header: str  # lower case
    label_key: str
    strict: bool


def _shares(counts: Mapping[str, Mapping[str, int]], roles: Sequence[str], mode: str) -> dict[str, float]:
    """Each revision's traffic share; a revision missing a required role has none."""
    covered = {rev: c for rev, c in counts.items() if all(c.get(r, 0) > 0 for r in roles)}
    if mode == "max-role":
        dominant, best = "", -1
        for role in roles:  # the first listed role wins a tie
            total = sum(per_role.get(role, 0) for per_role in covered.values())
            if total > best:
                dominant, best = role, total
        weights = {rev: per_role.get(dominant, 0) for rev, per_role in covered.items()}
    else:
        weights = {rev: sum(per_role.get(r, 0) for r in roles) for rev, per_role in covered.items()}
    total = sum(weights.values())
    return {rev: w / total for rev, w in weights.items()} if total > 0 else {}


@register
class DisaggregatedSetRolloutScreener(Screener, ResponseHeaderProcessor):
    type_name = "disaggregatedset-rollout-screener"
    stability = Stability.ALPHA
    Params = DisaggregatedSetRolloutScreenerParams
    params: DisaggregatedSetRolloutScreenerParams

    def __init__(
        self,
        name: str,
        params: DisaggregatedSetRolloutScreenerParams | None = None,
        handle: Handle | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        if params is None or params.revision_gating is None:
            raise ConfigError("", "disaggregatedset-rollout-screener requires parameters")
        super().__init__(name, params, handle)
        self._handle = handle
        self._random = (rng or random.Random()).random
        self._scope = parse_label_selector(params.scope.label_selector)
        self._selectors = tuple(
            _Selector(s.name, s.header_name.lower(), s.label_key, s.mode == "strict")
            for s in params.header_selectors
        )
        g = params.revision_gating
        self.mode = g.mode
        self.gating = g.mode != "disabled" and g.require_roles is not None
        self._roles = g.require_roles.values if g.require_roles is not None else ()
        self._revision_key = g.revision_label_key or DEFAULT_REVISION_LABEL
        self._role_key = g.role_label_key or DEFAULT_ROLE_LABEL
        self._seen: Sequence[Endpoint] | None = None  # the endpoint snapshot the shares come from
        self._share_of: dict[str, float] = {}
        self._gauged: set[str] = set()

    # --- revision distribution (recomputed when the pool's endpoint set changes) -------------

    def shares(self) -> dict[str, float]:
        """The current revision shares, from the pool's endpoints in scope (one count per pod)."""
        endpoints = self._handle.endpoints() if self._handle is not None else ()
        if endpoints is not self._seen:
            self._seen = endpoints
            self._share_of = self._distribution(endpoints)
        return self._share_of

    def _distribution(self, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        pods: dict[str, tuple[str, str]] = {}
        rev_key, role_key, scope = self._revision_key, self._role_key, self._scope
        for e in endpoints:
            md = e.metadata
            labels = md.labels
            revision, role = labels.get(rev_key, ""), labels.get(role_key, "")
            if not revision or not role or not all(r.matches(labels) for r in scope):
                continue
            pods[f"{md.namespace}/{md.pod_name or md.name}"] = (revision, role)
        counts: dict[str, dict[str, int]] = {}
        for revision, role in pods.values():
            per_role = counts.setdefault(revision, {})
            per_role[role] = per_role.get(role, 0) + 1
        shares = _shares(counts, self._roles, self.mode)
        for revision in self._gauged - counts.keys():
            GATING_SHARE.remove(self.type_name, self.name, self.mode, revision)
        for revision in counts:
            GATING_SHARE.labels(self.type_name, self.name, self.mode, revision).set(shares.get(revision, 0.0))
        self._gauged = set(counts)
        return shares

    # --- Screener ----------------------------------------------------------------------------

    def screen(self, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        current = endpoints
        headers = request.headers
        if self.gating:
            share_of = self.shares()
            rev_key = self._revision_key
            allowed: dict[str, float] = {}
            for e in current:
                revision = e.metadata.labels.get(rev_key, "")
                share = share_of.get(revision, 0.0) if revision else 0.0
                if share > 0.0:
                    allowed[revision] = share
            chosen = ""
            if not any(s.strict and headers.get(s.header) for s in self._selectors):
                chosen = self._pick(allowed)
            current = [
                e
                for e in current
                if (r := e.metadata.labels.get(rev_key, "")) in allowed and (not chosen or r == chosen)
            ]
            if not current:
                return []
        for s in self._selectors:
            if not s.strict:
                continue
            wanted = headers.get(s.header)
            if not wanted:
                continue
            current = [e for e in current if e.metadata.labels.get(s.label_key) == wanted]
            if not current:
                STRICT_NO_MATCH.labels(self.type_name, self.name, s.name).inc()
                return []
        return current

    def _pick(self, shares: Mapping[str, float]) -> str:
        """A revision drawn by its share (revisions in name order, so a seed is reproducible)."""
        if not shares:
            return ""
        revisions = sorted(shares)
        if len(revisions) == 1:
            return revisions[0]
        cumulative: list[float] = []
        total = 0.0
        for r in revisions:
            total += shares[r]
            cumulative.append(total)
        i = bisect.bisect_right(cumulative, self._random() * total)
        return revisions[min(i, len(revisions) - 1)]

    # --- ResponseHeaderProcessor -------------------------------------------------------------

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        if endpoint is None:
            return
        labels = endpoint.metadata.labels
        for s in self._selectors:
            value = labels.get(s.label_key)
            if value:
                response.headers[s.header] = value
