"""PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902)."""

from __future__ import annotations

import copy
from typing import Any


class PatchError(ValueError):
    """A patch that cannot be applied (the API server answers 422 or 400)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str]) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise PatchError(f"path {'/'.join(parts)!r} does not exist") from None
    return node, parts[-1]


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent, last = _parent(doc, parts)
    try:
        return parent[int(last)] if isinstance(parent, list) else parent[last]
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"path {path!r} does not exist") from None


def _remove(doc: Any, path: str) -> Any:
    parent, last = _parent(doc, _pointer(path))
    try:
        return parent.pop(int(last)) if isinstance(parent, list) else parent.pop(last)
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"unable to remove nonexistent key {path!r}") from None


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent, last = _parent(doc, parts)
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise PatchError(f"index out of range in {path!r}")
        parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise PatchError(f"cannot add at {path!r}")
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 operations ``add``, ``remove``, ``replace``, ``move``, ``copy`` and ``test``."""
    if not isinstance(operations, list):
        raise PatchError("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "path" not in op:
            raise PatchError(f"invalid JSON patch operation {op!r}")
        kind, path = op.get("op"), op["path"]
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)
            if _pointer(path):
                _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            value = _get(doc, op.get("from", ""))
            if kind == "move":
                _remove(doc, op["from"])
            doc = _add(doc, path, copy.deepcopy(value))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"testing value {path!r} failed")
        else:
            raise PatchError(f"unexpected JSON patch op {kind!r}")
    return doc
