"""``decode-filter``: keep endpoints that can run the decode stage (unlabelled ones included)."""

from __future__ import annotations

from epp.framework import register
from epp.plugins.filters._roles import (
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_ENCODE_PREFILL_DECODE,
    ROLE_PREFILL_DECODE,
    RoleFilter,
)


@register
class DecodeFilter(RoleFilter):
    type_name = "decode-filter"
    roles = frozenset({ROLE_DECODE, ROLE_PREFILL_DECODE, ROLE_BOTH, ROLE_ENCODE_PREFILL_DECODE})
    allows_no_label = True
