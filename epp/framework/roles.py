"""Pod roles in disaggregated serving: the ``llm-d.ai/role`` label and its values."""

ROLE_LABEL = "llm-d.ai/role"

ROLE_DECODE = "decode"
ROLE_PREFILL = "prefill"
ROLE_ENCODE = "encode"
ROLE_PREFILL_DECODE = "prefill-decode"
ROLE_ENCODE_PREFILL = "encode-prefill"
ROLE_ENCODE_PREFILL_DECODE = "encode-prefill-decode"
ROLE_BOTH = "both"  # deprecated synonym of prefill-decode

PREFILL_ROLES = frozenset({ROLE_PREFILL, ROLE_ENCODE_PREFILL})
INTERLEAVED_ROLES = frozenset({ROLE_PREFILL_DECODE, ROLE_BOTH, ROLE_ENCODE_PREFILL_DECODE})
