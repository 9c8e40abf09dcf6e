"""``encode-filter``: keep endpoints that can run the (multimodal) encode stage."""

from __future__ import annotations

from epp.framework import register
from epp.plugins.filters._roles import (
    ROLE_ENCODE,
    ROLE_ENCODE_PREFILL,
    ROLE_ENCODE_PREFILL_DECODE,
    RoleFilter,
)


@register
class EncodeFilter(RoleFilter):
    type_name = "encode-filter"
    roles = frozenset({ROLE_ENCODE, ROLE_ENCODE_PREFILL, ROLE_ENCODE_PREFILL_DECODE})
    allows_no_label = False
