"""OpenTelemetry traces for ``epp serve --tracing``: off unless asked, then one server span per
request, joined to the caller's W3C trace context (``traceparent``), with the scheduling spans the
reference EPP emits (``gateway.request`` > ``gateway.request_orchestration`` >
``run_scheduler_profile`` > ``filter_endpoints`` / ``llm_d.epp.scoring`` > ``llm_d.epp.scorer.<type>``
/ ``pick_endpoints``).

Configured by the standard variables: ``OTEL_SERVICE_NAME`` (default ``llm-d-epp``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_EXPORTER`` (``otlp``, the default, over gRPC to
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, plain text to
localhost:4317 when unset; ``console``; ``none``), ``OTEL_TRACES_SAMPLER`` and
``OTEL_TRACES_SAMPLER_ARG`` (default ``parentbased_traceidratio`` with 0.1).

While tracing is off, :data:`TRACER` is None and the request path costs one attribute check.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Span, Tracer

    from epp.framework.endpoint import Endpoint
    from epp.framework.request import LLMRequest
    from epp.framework.results import ScoredEndpoint

log = structlog.get_logger("epp.tracing")

DEFAULT_SERVICE_NAME = "llm-d-epp"
DEFAULT_RATIO = 0.1
TOP_SCORES = 5  # the picker span records this many best-scored candidates

#: The tracer while ``--tracing`` is on; None when off (the only thing the request path checks).
TRACER: Tracer | None = None
_provider: TracerProvider | None = None
_propagator: Any = None


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable epp cannot honour: the variable and the reason."""


def _ratio(environ: Mapping[str, str]) -> float:
    text = environ.get("OTEL_TRACES_SAMPLER_ARG", "")
    try:
        ratio = float(text)
    except ValueError:
        if text:
            log.warning("OTEL_TRACES_SAMPLER_ARG is not a number; using the default", value=text)
        return DEFAULT_RATIO
    if not 0.0 <= ratio <= 1.0:
        log.warning("OTEL_TRACES_SAMPLER_ARG is outside [0, 1]; using the default", value=text)
        return DEFAULT_RATIO
    return ratio


def sampler_from_env(environ: Mapping[str, str]) -> Sampler:
    """The sampler ``OTEL_TRACES_SAMPLER`` names (unset: ``parentbased_traceidratio``)."""
    from opentelemetry.sdk.trace import sampling

    name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_traceidratio"
    if name == "always_on":
        return sampling.ALWAYS_ON
    if name == "always_off":
        return sampling.ALWAYS_OFF
    if name == "traceidratio":
        return sampling.TraceIdRatioBased(_ratio(environ))
    if name == "parentbased_always_on":
        return sampling.ParentBased(sampling.ALWAYS_ON)
    if name == "parentbased_always_off":
        return sampling.ParentBased(sampling.ALWAYS_OFF)
    if name != "parentbased_traceidratio":
        log.warning(
            "unsupported OTEL_TRACES_SAMPLER; using parentbased_traceidratio",
            sampler=name,
            ratio=DEFAULT_RATIO,
        )
        return sampling.ParentBased(sampling.TraceIdRatioBased(DEFAULT_RATIO))
    return sampling.ParentBased(sampling.TraceIdRatioBased(_ratio(environ)))


def _exporter_from_env(environ: Mapping[str, str]) -> SpanExporter | None:
    kind = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    if kind == "none":
        return None
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        # one JSON object per line on stdout (the log is on stderr), not the SDK's pretty-printed form
        return ConsoleSpanExporter(out=sys.stdout, formatter=lambda span: span.to_json(indent=None) + "\n")
    if kind != "otlp":
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={kind!r}: supported are otlp, console and none")
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(var, "").strip()
        if protocol and protocol != "grpc":
            log.warning(f"{var}={protocol} is not supported; spans are sent over OTLP/gRPC")
            break
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def configure(exporter: SpanExporter | None = None, *, batch: bool | None = None) -> None:
    """Turn tracing on, from the ``OTEL_*`` environment; ``exporter`` replaces the configured one
    (tests). Spans are exported in batches from a background thread unless ``batch`` is False."""
    global TRACER, _provider, _propagator
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from epp import __version__

    environ = os.environ
    chosen = exporter if exporter is not None else _exporter_from_env(environ)
    attributes: dict[str, str] = {"service.version": __version__}
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create(attributes)
    if not named:
        resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    shutdown()
    provider = TracerProvider(sampler=sampler_from_env(environ), resource=resource)
    if chosen is not None:
        batched = exporter is None if batch is None else batch
        provider.add_span_processor(BatchSpanProcessor(chosen) if batched else SimpleSpanProcessor(chosen))
    _provider = provider
    _propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    TRACER = provider.get_tracer("epp", __version__)
    log.info(
        "tracing on",
        service=resource.attributes.get("service.name"),
        exporter=type(chosen).__name__ if chosen is not None else "none",
        sampler=provider.sampler.get_description(),
    )


def shutdown() -> None:
    """Flush and stop (at exit): the request path sees tracing off again."""
    global TRACER, _provider
    provider, _provider, TRACER = _provider, None, None
    if provider is not None:
        provider.shutdown()


# --- the request path (called only while TRACER is not None) -----------------------------------


def start_request(tracer: Tracer, headers: Mapping[str, str]) -> Span | None:
    """``gateway.request``: the server span of one ext_proc stream, a child of the caller's
    ``traceparent`` when the request carries one; None when the sampler drops the request (its
    other spans then cost nothing either)."""
    from opentelemetry.trace import SpanKind

    parent = _propagator.extract(headers)
    span = tracer.start_span("gateway.request", context=parent, kind=SpanKind.SERVER)
    return span if span.is_recording() else None


def start_orchestration(tracer: Tracer, request_span: Span) -> tuple[Span, object]:
    """``gateway.request_orchestration`` under ``request_span``, made the current span (so the
    scheduler's spans nest under it) until :func:`end_orchestration`."""
    from opentelemetry import context, trace

    span = tracer.start_span(
        "gateway.request_orchestration",
        context=trace.set_span_in_context(request_span),
        kind=trace.SpanKind.SERVER,
    )
    return span, context.attach(trace.set_span_in_context(span))


def end_orchestration(
    span: Span, token: object, request: LLMRequest | None, error: BaseException | None
) -> None:
    from opentelemetry import context
    from opentelemetry.trace import Status, StatusCode

    context.detach(token)  # type: ignore[arg-type]
    if request is not None:
        span.set_attribute("target_model", request.target_model)
        span.set_attribute("request_prio", request.priority)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def end_request(span: Span, request: LLMRequest | None, destination: str, error: str | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    if request is not None:
        span.set_attribute("gen_ai.request.model", request.incoming_model)
        span.set_attribute("gen_ai.request.id", request.request_id)
    if destination:
        span.set_attribute("llm_d.epp.destination_endpoint", destination)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def response_status(span: Span, status: str) -> None:
    """The upstream's HTTP status on the request span; 4xx and 5xx mark it as an error (as the
    reference, with the code as the description)."""
    from opentelemetry.trace import Status, StatusCode

    if not status.isdigit():
        return
    span.set_attribute("http.response.status_code", int(status))
    if int(status) >= 400:
        span.set_status(Status(StatusCode.ERROR, status))


def _request_attributes(request: LLMRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if request.target_model:
        out["gen_ai.request.model"] = request.target_model
    if request.request_id:
        out["gen_ai.request.id"] = request.request_id
    return out


class ProfileSpans:
    """The spans of one profile run, for ``SchedulerProfile.run``: ``enter`` starts a child of the
    innermost open span and makes it current; ``leave`` ends the innermost one. Leaving the ``with``
    block ends whatever is still open (a profile that failed or raised)."""

    __slots__ = ("_open", "_tracer")

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._open: list[tuple[Span, object]] = []

    def enter(self, name: str, attributes: dict[str, Any]) -> None:
        from opentelemetry import context, trace

        span = self._tracer.start_span(name, kind=trace.SpanKind.INTERNAL, attributes=attributes)
        self._open.append((span, context.attach(trace.set_span_in_context(span))))

    def leave(self, attributes: dict[str, Any] | None = None) -> None:
        from opentelemetry import context

        span, token = self._open.pop()
        context.detach(token)  # type: ignore[arg-type]
        if attributes:
            span.set_attributes(attributes)
        span.end()

    def __enter__(self) -> ProfileSpans:
        return self

    def __exit__(self, *exc: object) -> None:
        while self._open:
            self.leave()

    # the reference's span names and attributes

    def profile(self, name: str) -> None:
        self.enter("run_scheduler_profile", {"llm_d.epp.scheduling.profile.name": name})

    def filters(self, request: LLMRequest, candidates: list[Endpoint]) -> None:
        self.enter(
            "filter_endpoints",
            {"llm_d.epp.filter.candidate_endpoints": len(candidates), **_request_attributes(request)},
        )

    def filters_done(self, remaining: list[Endpoint]) -> None:
        self.leave({"llm_d.epp.filter.filtered_endpoints": len(remaining)})

    def scoring(self, request: LLMRequest, scorers: int, endpoints: list[Endpoint]) -> None:
        self.enter(
            "llm_d.epp.scoring",
            {
                "llm_d.epp.scorer.count": scorers,
                "llm_d.epp.scoring.candidate_endpoints": len(endpoints),
                **_request_attributes(request),
            },
        )

    def scorer(self, type_name: str, name: str, weight: float, endpoints: list[Endpoint]) -> None:
        self.enter(
            f"llm_d.epp.scorer.{type_name}",
            {
                "llm_d.epp.scorer.type": type_name,
                "llm_d.epp.scorer.name": name,
                "llm_d.epp.scorer.weight": weight,
                "llm_d.epp.scorer.candidate_endpoints": len(endpoints),
            },
        )

    def scorer_done(self, scores: list[float]) -> None:
        if not scores:
            self.leave()
            return
        self.leave(
            {
                "llm_d.epp.scorer.score.max": max(scores),
                "llm_d.epp.scorer.score.avg": sum(scores) / len(scores),
                "llm_d.epp.scorer.endpoints_scored": len(scores),
            }
        )

    def picker(self, request: LLMRequest, scored: list[ScoredEndpoint]) -> None:
        top = sorted(scored, key=lambda s: s.score, reverse=True)[:TOP_SCORES]
        attributes: dict[str, Any] = {"llm_d.epp.picker.candidate_endpoints": len(scored)}
        if top:
            attributes["llm_d.epp.picker.top_endpoints"] = [s.endpoint.metadata.key for s in top]
            attributes["llm_d.epp.picker.top_scores"] = [s.score for s in top]
        self.enter("pick_endpoints", attributes | _request_attributes(request))


class ProfileTracer:
    """Set on a ``SchedulerProfile`` (``profile.tracer``) while tracing is on."""

    __slots__ = ("tracer",)

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def spans(self) -> ProfileSpans | None:
        """The spans of one profile run, or None when the current request is not traced."""
        from opentelemetry import trace

        if not trace.get_current_span().is_recording():
            return None
        return ProfileSpans(self.tracer)


def instrument(profiles: Any) -> None:
    """Give every ``SchedulerProfile`` in ``profiles`` (a mapping) the tracer, while tracing is on."""
    tracer = TRACER
    if tracer is None:
        return
    for profile in profiles.values():
        profile.tracer = ProfileTracer(tracer)
