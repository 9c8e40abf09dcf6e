"""``request-attribute-reporter``: a number computed from the response's usage, sent to Envoy.

Each ``attributes`` entry has a CEL ``expression`` (and an optional boolean ``condition``) over the
variable ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and, when the server
reported it, ``prompt_tokens_details.cached_tokens``; numbers are doubles). Both are compiled once
at load. When the response ends, an entry whose condition holds and whose value is a non-zero
number (truncated to an integer) becomes Envoy dynamic metadata ``key.namespace`` (default
``envoy.lb``) / ``key.name`` on the reply that ends the response.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from epp.framework import (
    ConfigError,
    Endpoint,
    Handle,
    LLMRequest,
    ResponseBodyProcessor,
    ResponseInfo,
    register,
)
from epp.framework.wire import LB_NAMESPACE

__all__ = ["AttributeKey", "AttributeSpec", "RequestAttributeReporter", "RequestAttributeReporterParams"]

log = structlog.get_logger("epp.plugins.request_attribute_reporter")

USAGE_VARIABLE = "usage"
_ZERO_USAGE: Mapping[str, Any] = {"prompt_tokens": 0.0, "completion_tokens": 0.0, "total_tokens": 0.0}


@dataclass(slots=True, frozen=True)
class AttributeKey:
    namespace: str = ""
    name: str = ""


@dataclass(slots=True, frozen=True)
class AttributeSpec:
    key: AttributeKey = field(default_factory=AttributeKey)
    expression: str = ""
    condition: str = ""


@dataclass(slots=True, frozen=True)
class RequestAttributeReporterParams:
    attributes: tuple[AttributeSpec, ...] = ()

    def validate(self) -> str | None:
        if not self.attributes:
            return "attributes: must contain at least one entry"
        seen: set[tuple[str, str]] = set()
        for i, a in enumerate(self.attributes):
            if not a.key.name:
                return f"attributes[{i}].key.name: cannot be empty"
            if not a.expression.strip():
                return f"attributes[{i}].expression: cannot be empty"
            where = (a.key.namespace or LB_NAMESPACE, a.key.name)
            if where in seen:
                return f"attributes[{i}].key: duplicate key {where[0]}/{where[1]}"
            seen.add(where)
        return None


@dataclass(slots=True)
class _Compiled:
    namespace: str
    name: str
    expression: Any  # cel.Program
    condition: Any | None


def _compile(source: str, where: str) -> Any:
    """A compiled CEL program; a syntax error or an undeclared variable is a ``ConfigError``."""
    import cel  # the CEL interpreter loads only with this plugin (its CLI imports take ~0.3 s)

    try:
        program = cel.compile(source)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(where, f"failed to compile: {e}") from None
    try:  # what the reference's type check rejects: an identifier other than `usage`
        program.execute({USAGE_VARIABLE: dict(_ZERO_USAGE)})
    except RuntimeError as e:
        if "Undefined variable" in str(e):
            raise ConfigError(where, f"failed to compile: {e}") from None
    except Exception:  # a type error on zero usage is a per-response failure, as in the reference
        pass
    return program


def usage_variable(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """``usage`` as the expressions see it: the three counts always (0 when not reported), as doubles."""
    out: dict[str, Any] = dict(_ZERO_USAGE)
    if not usage:
        return out
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        v = usage.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = float(v)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        cached = details.get("cached_tokens")
        out["prompt_tokens_details"] = {
            "cached_tokens": float(cached)
            if isinstance(cached, int | float) and not isinstance(cached, bool)
            else 0.0
        }
    return out


@register
class RequestAttributeReporter(ResponseBodyProcessor):
    type_name = "request-attribute-reporter"
    Params = RequestAttributeReporterParams
    params: RequestAttributeReporterParams

    def __init__(
        self, name: str, params: RequestAttributeReporterParams | None = None, handle: Handle | None = None
    ) -> None:
        if params is None:
            raise ConfigError("attributes", "must contain at least one entry")
        super().__init__(name, params, handle)
        self._warned: set[tuple[str, str]] = set()
        self._attributes = tuple(
            _Compiled(
                a.key.namespace or LB_NAMESPACE,
                a.key.name,
                _compile(a.expression, f"attributes[{i}].expression"),
                _compile(a.condition, f"attributes[{i}].condition") if a.condition.strip() else None,
            )
            for i, a in enumerate(params.attributes)
        )

    def response_body(
        self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None, chunk: bytes
    ) -> None:
        if not response.end_of_stream:
            return
        values = self.evaluate(response.usage)
        if not values:
            return
        md = response.dynamic_metadata
        if md is None:
            md = response.dynamic_metadata = {}
        for namespace, name, value in values:
            md.setdefault(namespace, {})[name] = value

    def _problem(self, a: _Compiled, event: str, detail: str) -> None:
        """A warning the first time an attribute fails for a reason, debug lines after that."""
        key = (a.name, event)
        emit = log.debug if key in self._warned else log.warning
        self._warned.add(key)
        emit(event, plugin=self.typed_name, attribute=a.name, detail=detail)

    def evaluate(self, usage: Mapping[str, Any] | None) -> list[tuple[str, str, float]]:
        """``(namespace, name, value)`` of every attribute to report for this usage."""
        variables = {USAGE_VARIABLE: usage_variable(usage)}
        out: list[tuple[str, str, float]] = []
        for a in self._attributes:
            try:
                if a.condition is not None and a.condition.execute(variables) is not True:
                    continue
                result = a.expression.execute(variables)
            except Exception as e:  # a CEL runtime error skips this attribute for this response
                self._problem(a, "CEL evaluation failed", str(e))
                continue
            if isinstance(result, bool) or not isinstance(result, int | float):
                self._problem(a, "expression result is not a number", type(result).__name__)
                continue
            if isinstance(result, float) and not math.isfinite(result):
                continue
            value = int(result)  # truncated toward zero, as the reference's int64 conversion
            if value != 0:  # zero values are not reported
                out.append((a.namespace, a.name, float(value)))
        return out
