"""``decode-filter``: keep endpoints that can run the decode stage.

Type: ``decode-filter``. Parameters: none.
Algorithm: keep an endpoint whose ``llm-d.ai/role`` label is one of ``decode``, ``prefill-decode``,
``both`` or ``encode-prefill-decode``; endpoints **without** the label are kept (quirk D8: a plain
pod can decode). Reports its configured type, not the reference's ``by-label`` (quirk D18).
"""

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
