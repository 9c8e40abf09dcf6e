"""Shared implementation of the role filters (``decode-filter``, ``prefill-filter``, ``encode-filter``).

Each role filter keeps an endpoint when its ``llm-d.ai/role`` label is one of the filter's role
values; an endpoint without the label is kept only when the filter allows unlabelled endpoints
(``decode-filter`` does: plain pods can decode, quirk D8). A label present with any value outside the
set drops the endpoint.

The reference builds these on its ``by-label`` filter and reports type ``by-label`` for all three
(visible in the ``plugin_type`` metric label). epp reports the configured type instead (quirk D18):
each role filter is its own registered class with its own ``type_name``.
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
