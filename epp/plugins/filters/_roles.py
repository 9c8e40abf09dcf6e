"""Shared implementation of the role filters (``decode-filter``, ``prefill-filter``, ``encode-filter``).

Each role filter is its own registered class, so it reports its own type name. The removed role
value ``both`` is read as ``prefill-decode`` unless the configuration was loaded for router v0.11
(``drop_removed_roles``), where it is an unknown role that no role filter keeps.
"""

from __future__ import annotations

from typing import Any, ClassVar

from epp.framework import CycleState, Endpoint, Filter, Handle, LLMRequest
from epp.framework.roles import (  # noqa: F401  (re-exported for the role filters)
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_ENCODE,
    ROLE_ENCODE_PREFILL,
    ROLE_ENCODE_PREFILL_DECODE,
    ROLE_LABEL,
    ROLE_PREFILL,
    ROLE_PREFILL_DECODE,
)


class RoleFilter(Filter):
    """Keeps endpoints whose role label is in ``roles`` (unlabelled ones iff ``allows_no_label``)."""

    roles: ClassVar[frozenset[str]] = frozenset()
    allows_no_label: ClassVar[bool] = False

    def __init__(self, name: str, params: Any, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        self._roles = self.roles

    def drop_removed_roles(self) -> None:
        """Router v0.11: ``both`` is no role any more (the pod is kept by no role filter)."""
        self._roles = self.roles - {ROLE_BOTH}

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        roles = self._roles
        keep_unlabelled = self.allows_no_label
        out = []
        for e in endpoints:
            role = e.metadata.labels.get(ROLE_LABEL)
            if keep_unlabelled if role is None else role in roles:
                out.append(e)
        return out
