"""Label and field selectors with the Kubernetes query-string syntax and matching semantics.

Label selectors follow ``k8s.io/apimachinery/pkg/labels.Parse``: comma-joined requirements
``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``, ``k>1``, ``k<1``.
Field selectors follow ``fields.ParseSelector``: comma-joined ``f=v``, ``f==v``, ``f!=v`` with
backslash escapes, restricted to the field labels the resource supports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SPECIAL = set("=!(),<>")
_WHITESPACE = set(" \t\r\n")
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class SelectorError(ValueError):
    """A selector string that does not parse (the API server answers 400 BadRequest)."""


# ------------------------------------------------------------------------------------ label selectors


@dataclass(frozen=True)
class Requirement:
    """One label requirement: ``key``, an operator and its values."""

    key: str
    op: str  # one of: in, notin, exists, !, gt, lt
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` satisfy this requirement (``!=``/``notin`` match absent keys)."""
        has = self.key in labels
        if self.op == "in":
            return has and labels[self.key] in self.values
        if self.op == "notin":
            return not has or labels[self.key] not in self.values
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if not has:
            return False
        try:
            actual = int(labels[self.key])
        except ValueError:
            return False
        (bound,) = self.values
        return actual > int(bound) if self.op == "gt" else actual < int(bound)


@dataclass(frozen=True)
class LabelSelector:
    """The AND of several requirements; the empty selector matches everything."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        """Whether an object with ``labels`` is selected."""
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    @property
    def empty(self) -> bool:
        """True when the selector selects everything."""
        return not self.requirements


def _lex(text: str) -> list[str]:
    """Split a label selector into tokens: identifiers and the symbols ``! != ( ) , = == > <``."""
    tokens: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in _WHITESPACE:
            i += 1
        elif ch in _SPECIAL:
            pair = text[i : i + 2]
            if pair in ("!=", "=="):
                tokens.append(pair)
                i += 2
            else:
                tokens.append(ch)
                i += 1
        else:
            start = i
            while i < len(text) and text[i] not in _SPECIAL and text[i] not in _WHITESPACE:
                i += 1
            tokens.append(text[start:i])
    return tokens


def _is_identifier(token: str | None) -> bool:
    return token is not None and token[0] not in _SPECIAL


def _validate_key(key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        raise SelectorError(
            f'unable to parse requirement: key: Invalid value: "{key}": prefix part is invalid'
        )
    if not name or len(name) > 63 or not _NAME.match(name):
        raise SelectorError(f'unable to parse requirement: key: Invalid value: "{key}": name part is invalid')


def _validate_value(value: str) -> None:
    if value and (len(value) > 63 or not _NAME.match(value)):
        raise SelectorError(f'unable to parse requirement: values: Invalid value: "{value}"')


class _LabelParser:
    def __init__(self, text: str) -> None:
        self.tokens = _lex(text)
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.pos += 1
        return token

    @staticmethod
    def _shown(token: str | None) -> str:
        return "end of string" if token is None else token

    def parse(self) -> LabelSelector:
        requirements: list[Requirement] = []
        while True:
            token = self.peek()
            if token is None:
                return LabelSelector(tuple(requirements))
            if token != "!" and not _is_identifier(token):
                raise SelectorError(f"found '{token}', expected: !, identifier, or 'end of string'")
            requirements.append(self.requirement())
            after = self.take()
            if after is None:
                return LabelSelector(tuple(requirements))
            if after != ",":
                raise SelectorError(f"found '{after}', expected: ',' or 'end of string'")
            nxt = self.peek()
            if nxt != "!" and not _is_identifier(nxt):
                raise SelectorError(f"found '{self._shown(nxt)}', expected: identifier after ','")

    def requirement(self) -> Requirement:
        if self.peek() == "!":
            self.take()
            key = self.take()
            if not _is_identifier(key):
                raise SelectorError(f"found '{self._shown(key)}', expected: identifier")
            assert key is not None
            _validate_key(key)
            return Requirement(key, "!")
        key = self.take()
        assert key is not None
        _validate_key(key)
        op = self.peek()
        if op is None or op == ",":
            return Requirement(key, "exists")
        self.take()
        if op in ("=", "==", "!="):
            value = ""
            if _is_identifier(self.peek()):
                value = self.take() or ""
            elif self.peek() not in (None, ","):
                raise SelectorError(f"found '{self.peek()}', expected: identifier for value")
            _validate_value(value)
            return Requirement(key, "notin" if op == "!=" else "in", frozenset({value}))
        if op in ("in", "notin"):
            values = self.value_set()
            if not values:
                raise SelectorError("for 'in', 'notin' operators, values set can't be empty")
            for value in values:
                _validate_value(value)
            return Requirement(key, op, values)
        if op in (">", "<"):
            bound = self.take()
            if not _is_identifier(bound) or not re.fullmatch(r"-?\d+", bound or ""):
                raise SelectorError(f"for 'Gt', 'Lt' operators, the value must be an integer: {bound}")
            assert bound is not None
            return Requirement(key, "gt" if op == ">" else "lt", frozenset({bound}))
        raise SelectorError(f"found '{op}', expected: in, notin, =, ==, !=, gt, lt")

    def value_set(self) -> frozenset[str]:
        if self.take() != "(":
            raise SelectorError("found token, expected: '('")
        values: set[str] = set()
        expect_value = True
        while True:
            token = self.take()
            if token == ")":
                if expect_value and values:
                    values.add("")  # "(a,)" has an empty value
                return frozenset(values)
            if token == ",":
                if expect_value:
                    values.add("")  # "(,a)" and "(a,,b)" have an empty value
                expect_value = True
            elif _is_identifier(token) and expect_value:
                assert token is not None
                values.add(token)
                expect_value = False
            else:
                raise SelectorError(f"found '{self._shown(token)}', expected: ',', ')' or identifier")


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse a ``labelSelector`` query value; :class:`SelectorError` when it is invalid."""
    return _LabelParser(text or "").parse()


# ------------------------------------------------------------------------------------ field selectors


@dataclass(frozen=True)
class FieldTerm:
    """``field op value`` where op is ``=`` or ``!=``."""

    field: str
    equal: bool
    value: str


@dataclass(frozen=True)
class FieldSelector:
    """The AND of several field terms; the empty selector matches everything."""

    terms: tuple[FieldTerm, ...] = ()

    def matches(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` is selected."""
        return all((field_value(obj, t.field) == t.value) == t.equal for t in self.terms)

    @property
    def empty(self) -> bool:
        """True when the selector selects everything."""
        return not self.terms


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The value at a dotted ``path`` of ``obj`` as a field selector sees it (missing -> ``""``)."""
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, current, i = [], [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            current.append(text[i : i + 2])
            i += 2
            continue
        if text[i] == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(text[i])
        i += 1
    parts.append("".join(current))
    return parts


def _unescape(value: str) -> str:
    out, i = [], 0
    while i < len(value):
        ch = value[i]
        if ch == "\\":
            if i + 1 >= len(value) or value[i + 1] not in "\\,=!":
                raise SelectorError(f"invalid field selector value escape: {value!r}")
            out.append(value[i + 1])
            i += 2
            continue
        if ch in ",=":
            raise SelectorError(f"invalid field selector value: {value!r}: unescaped {ch!r}")
        out.append(ch)
        i += 1
    return "".join(out)


def parse_field_selector(text: str | None, supported: frozenset[str]) -> FieldSelector:
    """Parse a ``fieldSelector`` query value over the ``supported`` field labels."""
    terms: list[FieldTerm] = []
    for term in _split_unescaped(text or "", ","):
        if not term:
            continue
        for i in range(len(term)):
            op = next((o for o in ("!=", "==", "=") if term.startswith(o, i)), None)
            if op is not None:
                key, value = term[:i], _unescape(term[i + len(op) :])
                break
        else:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        if key not in supported:
            raise SelectorError(f"field label not supported: {key}")
        terms.append(FieldTerm(key, op != "!=", value))
    return FieldSelector(tuple(terms))
