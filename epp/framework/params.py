"""Typed plugin parameters: frozen dataclasses with snake_case fields, written in camelCase in YAML.

Decoding is ``epp.framework.decode``'s, the same strict decoder as the configuration document's.

What ``epp check-config`` prints as a plugin's effective parameters are the values the plugin uses:
a Params dataclass (at any depth) whose unset fields stand for defaults resolved later may define
``effective()``, returning a copy with those defaults written out; a field marked ``OMIT_UNSET``
(``field(default=..., metadata=OMIT_UNSET)``) is left out while it holds its default: keys kept only
to migrate older configurations, settings of an alternative that is not chosen, and values that come
from outside the configuration (a command-line flag, the pool) when unset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from epp.framework.decode import decode_dataclass, kind_of, yaml_key
from epp.framework.errors import ConfigError

__all__ = ["OMIT_UNSET", "decode_params", "encode_params", "ensure_valid", "yaml_key"]

# Field metadata: check-config leaves the field out while it holds its default (see the docstring).
OMIT_UNSET: dict[str, bool] = {"omit_unset": True}


def ensure_valid(params: Any) -> None:
    """Raise ``ConfigError`` for parameters built directly (not through ``decode_params``)."""
    validate = getattr(params, "validate", None)
    problem = validate() if validate is not None else None
    if problem:
        field_name, _, reason = problem.partition(": ")
        raise ConfigError(field_name if reason else "", reason or problem)


def decode_params(cls: type, raw: Any, where: str) -> Any:
    """Build ``cls`` (a Params dataclass) from raw YAML parameters; ``where`` prefixes error paths.

    A field is read under its camelCase name, or the name in ``field(metadata={"key": ...})``. Types
    are checked, unknown keys rejected, and the dataclass's optional ``validate()`` (a reason string
    or None) is called; every failure is a ``ConfigError`` naming the exact key.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(where, f"parameters must be a mapping, got {kind_of(raw)}")
    return decode_dataclass(cls, raw, where)


def encode_params(params: Any) -> dict[str, Any]:
    """The effective parameters as YAML keys (used by ``epp check-config``)."""
    if not dataclasses.is_dataclass(params) or isinstance(params, type):
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = encode_params(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[yaml_key(f)] = value
    return out
