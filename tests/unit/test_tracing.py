"""``--tracing``: spans of requests driven through a real ext_proc stream (gRPC, like Envoy), the
caller's W3C ``traceparent`` honoured, the reference's span names and nesting, the ``OTEL_*``
sampler settings, and export over OTLP/gRPC to an in-process collector with the variables the llm-d
Helm chart sets.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from epp import tracing
from epp.datalayer.store import EndpointStore
from tests.unit import factories
from tests.unit.extproc_harness import (
    Harness,
    body_msg,
    endpoint,
    headers_msg,
    response_headers_msg,
    set_headers,
    start,
)
from tests.unit.polling import until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHAT = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}).encode()
OTEL_VARS = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_INSECURE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    tracing.shutdown()


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    store = EndpointStore()
    for i in (1, 2, 3):
        store.upsert(endpoint(i))
    director = factories.director(store)
    h = await start(store, director)
    yield h
    await h.channel.close()
    await h.server.stop(0)


def _instrument(h: Harness) -> None:
    tracing.instrument(h.director.scheduler.profiles)


async def _request(h: Harness, headers: dict[str, str]) -> str:
    """One routed chat request; the destination it was sent to."""
    out = await h.exchange([headers_msg(headers), body_msg(CHAT, True)], expect=2)
    return set_headers(out[0].request_headers.response)["x-gateway-destination-endpoint"]


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_traceparent_joins_the_callers_trace_with_the_reference_span_tree(harness: Harness) -> None:
    exporter = InMemorySpanExporter()
    tracing.configure(exporter)
    _instrument(harness)
    destination = await _request(harness, {"traceparent": TRACEPARENT, "x-request-id": "req-1"})
    await until(lambda: any(s.name == "gateway.request" for s in exporter.get_finished_spans()))
    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {
        "gateway.request",
        "gateway.request_orchestration",
        "run_scheduler_profile",
        "filter_endpoints",
        "llm_d.epp.scoring",
        "llm_d.epp.scorer.queue-scorer",
        "pick_endpoints",
    }
    assert {s.context.trace_id for s in spans.values()} == {int(TRACE_ID, 16)}
    root = spans["gateway.request"]
    assert root.parent is not None and root.parent.span_id == int(PARENT_ID, 16) and root.parent.is_remote
    assert root.kind.name == "SERVER"
    tree = {name: _parent(s) for name, s in spans.items()}
    ids = {name: s.context.span_id for name, s in spans.items()}
    assert tree["gateway.request_orchestration"] == ids["gateway.request"]
    assert tree["run_scheduler_profile"] == ids["gateway.request_orchestration"]
    for child in ("filter_endpoints", "llm_d.epp.scoring", "pick_endpoints"):
        assert tree[child] == ids["run_scheduler_profile"], child
    assert tree["llm_d.epp.scorer.queue-scorer"] == ids["llm_d.epp.scoring"]
    assert spans["run_scheduler_profile"].attributes == {"llm_d.epp.scheduling.profile.name": "default"}
    scorer = spans["llm_d.epp.scorer.queue-scorer"].attributes or {}
    assert scorer["llm_d.epp.scorer.type"] == "queue-scorer"
    assert scorer["llm_d.epp.scorer.candidate_endpoints"] == 3
    assert scorer["llm_d.epp.scorer.endpoints_scored"] == 3
    pick = spans["pick_endpoints"].attributes or {}
    assert pick["llm_d.epp.picker.candidate_endpoints"] == 3 and pick["gen_ai.request.id"] == "req-1"
    assert (root.attributes or {})["llm_d.epp.destination_endpoint"] == destination
    assert (spans["gateway.request_orchestration"].attributes or {})["target_model"] == "demo"


async def test_without_a_traceparent_a_request_starts_its_own_trace(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    exporter = InMemorySpanExporter()
    tracing.configure(exporter)
    _instrument(harness)
    await _request(harness, {})
    await _request(harness, {})
    await until(lambda: sum(s.name == "gateway.request" for s in exporter.get_finished_spans()) == 2)
    roots = [s for s in exporter.get_finished_spans() if s.name == "gateway.request"]
    assert all(s.parent is None for s in roots)
    assert len({s.context.trace_id for s in roots}) == 2


async def test_the_default_sampler_follows_the_callers_sampling_decision(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # parentbased_traceidratio at 0: only requests whose caller sampled them are traced
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    exporter = InMemorySpanExporter()
    tracing.configure(exporter)
    _instrument(harness)
    await _request(harness, {})  # a new root: ratio 0, not sampled
    await _request(harness, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})  # caller: not sampled
    await _request(harness, {"traceparent": TRACEPARENT})  # caller sampled it
    await until(lambda: any(s.name == "gateway.request" for s in exporter.get_finished_spans()))
    await harness.exchange([headers_msg({":method": "GET"}, end_of_stream=True)], expect=1)
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {int(TRACE_ID, 16)}
    assert sum(s.name == "gateway.request" for s in exporter.get_finished_spans()) == 1


def test_sampler_settings_from_the_environment() -> None:
    cases = {
        ("", ""): "ParentBased{root:TraceIdRatioBased{0.1},",
        ("parentbased_traceidratio", "0.25"): "ParentBased{root:TraceIdRatioBased{0.25},",
        ("traceidratio", "0.5"): "TraceIdRatioBased{0.5}",
        ("always_off", ""): "AlwaysOffSampler",
        ("something-else", "0.7"): "ParentBased{root:TraceIdRatioBased{0.1},",
        ("parentbased_traceidratio", "not-a-number"): "ParentBased{root:TraceIdRatioBased{0.1},",
    }
    for (name, arg), description in cases.items():
        env = {"OTEL_TRACES_SAMPLER": name, "OTEL_TRACES_SAMPLER_ARG": arg}
        assert tracing.sampler_from_env(env).get_description().startswith(description), (name, arg)


def test_an_unknown_exporter_is_a_precise_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(tracing.TracingConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        tracing.configure()
    assert tracing.TRACER is None


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_spans_reach_an_otlp_collector_configured_as_the_helm_chart_does(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # the env the llm-d Helm chart sets with router.tracing.enabled
        monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-d-router/epp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.namespace.name=ns,k8s.pod.name=epp-0")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
        tracing.configure()
        _instrument(harness)
        await _request(harness, {"traceparent": TRACEPARENT})
        tracing.shutdown()  # flushes the batch
        spans = [
            (rs.resource, span)
            for req in collector.requests
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]
        assert {span.name for _, span in spans} >= {"gateway.request", "run_scheduler_profile"}
        assert {span.trace_id.hex() for _, span in spans} == {TRACE_ID}
        resource = {a.key: a.value.string_value for a in spans[0][0].attributes}
        assert resource["service.name"] == "llm-d-router/epp"
        assert resource["k8s.pod.name"] == "epp-0" and resource["k8s.namespace.name"] == "ns"
    finally:
        server.stop(0)


async def test_a_rejected_request_ends_its_spans_with_an_error_status(harness: Harness) -> None:
    exporter = InMemorySpanExporter()
    tracing.configure(exporter)
    _instrument(harness)
    bad = json.dumps({"model": 7, "messages": []}).encode()  # model is not a string: 400
    out = await harness.exchange([headers_msg({"traceparent": TRACEPARENT}), body_msg(bad, True)], expect=1)
    assert out[0].immediate_response.status.code == 400
    await until(lambda: any(s.name == "gateway.request" for s in exporter.get_finished_spans()))
    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {"gateway.request", "gateway.request_orchestration"}
    for span in spans.values():
        assert span.status.status_code.name == "ERROR" and span.context.trace_id == int(TRACE_ID, 16)


async def test_an_upstream_error_status_marks_the_request_span(harness: Harness) -> None:
    exporter = InMemorySpanExporter()
    tracing.configure(exporter)
    _instrument(harness)
    messages = [
        headers_msg({"traceparent": TRACEPARENT}),
        body_msg(CHAT, True),
        response_headers_msg({":status": "503"}),
    ]
    await harness.exchange(messages, expect=3)
    await until(lambda: any(s.name == "gateway.request" for s in exporter.get_finished_spans()))
    root = _by_name(exporter.get_finished_spans())["gateway.request"]
    assert root.status.status_code.name == "ERROR" and root.status.description == "503"


def test_the_console_exporter_writes_one_json_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from epp.tracing import _exporter_from_env

    exporter = _exporter_from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert exporter is not None
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for name in ("one", "two"):
        with provider.get_tracer("t").start_as_current_span(name):
            pass
    provider.shutdown()
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["one", "two"]
