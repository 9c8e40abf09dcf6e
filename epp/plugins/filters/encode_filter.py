"""``encode-filter``: keep endpoints that can run the (multimodal) encode stage.

Type: ``encode-filter``. Parameters: none.
Algorithm: keep an endpoint whose ``llm-d.ai/role`` label is one of ``encode``, ``encode-prefill`` or
``encode-prefill-decode``; endpoints without the label are dropped (quirk D8). Reports its
configured type, not the reference's ``by-label`` (quirk D18).
"""

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
