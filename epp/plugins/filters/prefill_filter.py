"""``prefill-filter``: keep endpoints that can run the prefill stage.

Type: ``prefill-filter``. Parameters: none.
Algorithm: keep an endpoint whose ``llm-d.ai/role`` label is one of ``prefill``, ``encode-prefill``,
``prefill-decode``, ``both`` or ``encode-prefill-decode``; endpoints without the label are dropped
(quirk D8). Reports its configured type, not the reference's ``by-label`` (quirk D18).
"""

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
