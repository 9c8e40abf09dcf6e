"""``prefill-filter``: keep endpoints that can run the prefill stage."""

from __future__ import annotations

from epp.framework import register
from epp.plugins.filters._roles import (
    ROLE_BOTH,
    ROLE_ENCODE_PREFILL,
    ROLE_ENCODE_PREFILL_DECODE,
    ROLE_PREFILL,
    ROLE_PREFILL_DECODE,
    RoleFilter,
)


@register
class PrefillFilter(RoleFilter):
    type_name = "prefill-filter"
    roles = frozenset(
        {ROLE_PREFILL, ROLE_ENCODE_PREFILL, ROLE_PREFILL_DECODE, ROLE_BOTH, ROLE_ENCODE_PREFILL_DECODE}
    )
    allows_no_label = False
