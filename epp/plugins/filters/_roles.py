"""Shared implementation of the role filters (``decode-filter``, ``prefill-filter``, ``encode-filter``).

Each role filter is its own registered class, so it reports its own type name.
"""

from __future__ import annotations

from typing import ClassVar

from epp.framework import CycleState, Endpoint, Filter, LLMRequest

ROLE_LABEL = "llm-d.ai/role"

ROLE_DECODE = "decode"
ROLE_PREFILL = "prefill"
ROLE_ENCODE = "encode"
ROLE_PREFILL_DECODE = "prefill-decode"
ROLE_ENCODE_PREFILL = "encode-prefill"
ROLE_ENCODE_PREFILL_DECODE = "encode-prefill-decode"
ROLE_BOTH = "both"  # deprecated synonym of prefill-decode


class RoleFilter(Filter):
    """Keeps endpoints whose role label is in ``roles`` (unlabelled ones iff ``allows_no_label``)."""

    roles: ClassVar[frozenset[str]] = frozenset()
    allows_no_label: ClassVar[bool] = False

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        roles = self.roles
        keep_unlabelled = self.allows_no_label
        out = []
        for e in endpoints:
            role = e.metadata.labels.get(ROLE_LABEL)
            if keep_unlabelled if role is None else role in roles:
                out.append(e)
        return out
