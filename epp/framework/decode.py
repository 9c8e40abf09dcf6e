"""Strict decoding of parsed YAML values; every failure is a ``ConfigError`` naming the field path.

One decoder serves the configuration document's schema and typed plugin parameters: by type hint
(``decode_value``, dataclasses with camelCase keys) or one kind of value at a time.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

from epp.framework.errors import ConfigError


def kind_of(value: Any) -> str:
    """What a parsed YAML value is, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def _got(value: Any) -> str:
    return "null" if value is None else f"{kind_of(value)} {value!r}"


def join(path: str, key: str) -> str:
    """The dotted path of ``key`` under ``path``."""
    return f"{path}.{key}" if path else key


def _unknown_field(key: str) -> str:
    return f'unknown field "{key}"'


def did_you_mean(name: str, candidates: Collection[str]) -> str:
    """``'; did you mean "x"?'`` for the candidate closest to a misspelt ``name``, else ``""``."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f'; did you mean "{matches[0]}"?' if matches else ""


def decode_mapping(
    value: Any,
    where: str,
    allowed: Collection[str] | None = None,
    unknown: Callable[[str], str] = _unknown_field,
) -> dict[str, Any]:
    """A mapping; with ``allowed``, its keys must be strings among them (``unknown(key)`` is the
    reason, followed by the closest allowed key when one is close)."""
    if not isinstance(value, dict):
        raise ConfigError(where, f"expected a mapping, got {kind_of(value)}")
    if allowed is not None:
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(where, f"field names must be strings, got {key!r}")
            if key not in allowed:
                reason = unknown(key)
                hint = did_you_mean(key, allowed)
                if hint:
                    head, sep, tail = reason.partition(" (")
                    reason = f"{head}{hint}{sep}{tail}"
                raise ConfigError(join(where, key), reason)
    return value


def decode_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(where, f"expected a list, got {kind_of(value)}")
    return value


def decode_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(where, f"expected a string, got {_got(value)}")
    return value


def decode_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(where, f"expected a boolean, got {_got(value)}")
    return value


def decode_int(value: Any, where: str) -> int:
    """An integer; an integral float (``3.0``) counts, a boolean does not."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(where, f"expected an integer, got {_got(value)}")


def decode_number(value: Any, where: str, *, finite: bool = False) -> float:
    """A number as a float; ``finite`` also rejects ``.inf`` and ``.nan``."""
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (not finite or math.isfinite(value))
    ):
        return float(value)
    raise ConfigError(where, f"expected a number, got {_got(value)}")


def yaml_key(f: dataclasses.Field[Any]) -> str:
    """The YAML key of a dataclass field: explicit ``metadata['key']`` or camelCase of the name."""
    explicit = f.metadata.get("key")
    if explicit:
        return str(explicit)
    head, *rest = f.name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def decode_value(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the type hint ``hint``: scalars, unions, lists/tuples (as tuples),
    mappings, dataclasses; any other hint accepts the value as it is."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        if value is None and type(None) in arms:
            return None  # an explicit null leaves an optional field unset
        others = [arm for arm in arms if arm is not type(None)]
        if len(others) == 1:
            return decode_value(value, others[0], where)  # its error keeps the nested field's path
        errors = []
        for arm in arms:
            try:
                return decode_value(value, arm, where)
            except ConfigError as e:
                if arm is not type(None):
                    errors.append(e.reason)
        raise ConfigError(where, " or ".join(errors))
    if hint is type(None):
        if value is None:
            return None
        raise ConfigError(where, f"expected null, got {kind_of(value)}")
    if hint is bool:
        return decode_bool(value, where)
    if hint is int:
        return decode_int(value, where)
    if hint is float:
        return decode_number(value, where)
    if hint is str:
        return decode_str(value, where)
    if origin in (list, tuple) or hint in (list, tuple):
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(decode_value(v, item, f"{where}[{i}]") for i, v in enumerate(decode_list(value, where)))
    if origin in (dict, Mapping) or hint in (dict,):
        return dict(decode_mapping(value, where))
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return decode_dataclass(hint, {} if value is None else value, where)
    return value


def decode_dataclass(cls: type, raw: Any, where: str) -> Any:
    """Build the dataclass ``cls`` from a mapping of its YAML keys; ``where`` prefixes error paths.

    Types are checked, unknown keys rejected, and the dataclass's optional ``validate()`` (a reason
    string, optionally ``"field: reason"``, or None) is called.
    """
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    known = ", ".join(sorted(fields)) or "none"
    m = decode_mapping(raw, where, fields, lambda _key: f"unknown parameter (known: {known})")
    kwargs = {
        f.name: decode_value(m[key], hints[f.name], join(where, key)) for key, f in fields.items() if key in m
    }
    value = cls(**kwargs)
    validate = getattr(value, "validate", None)
    if validate is not None:
        problem = validate()
        if problem:
            field_name, _, reason = problem.partition(": ")
            raise ConfigError(join(where, field_name) if reason else where, reason or problem)
    return value
