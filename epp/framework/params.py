"""Typed plugin parameters: frozen dataclasses with snake_case fields, written in camelCase in YAML."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from epp.framework.errors import ConfigError


def yaml_key(f: dataclasses.Field[Any]) -> str:
    """The YAML key of a Params field: explicit ``metadata['key']`` or camelCase of the name."""
    explicit = f.metadata.get("key")
    if explicit:
        return str(explicit)
    head, *rest = f.name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(hint):
            try:
                return _check(value, arm, where)
            except ConfigError as e:
                errors.append(e.reason)
        raise ConfigError(where, " or ".join(errors))
    if hint is type(None):
        if value is None:
            return None
        raise ConfigError(where, f"expected null, got {type(value).__name__}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(where, f"expected a boolean, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(where, f"expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(where, f"expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(where, f"expected a string, got {value!r}")
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(where, f"expected a list, got {type(value).__name__}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_check(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or hint in (dict,):
        if not isinstance(value, dict):
            raise ConfigError(where, f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return decode_params(hint, value, where)
    return value


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
        raise ConfigError(where, f"parameters must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown parameter (known: {known})")
    kwargs = {}
    for key, f in fields.items():
        if key in raw:
            kwargs[f.name] = _check(raw[key], hints[f.name], f"{where}.{key}")
    params = cls(**kwargs)
    validate = getattr(params, "validate", None)
    if validate is not None:
        problem = validate()
        if problem:
            field_name, _, reason = problem.partition(": ")
            raise ConfigError(f"{where}.{field_name}" if reason else where, reason or problem)
    return params


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
