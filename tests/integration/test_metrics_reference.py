"""The reference's metric names and drop reasons end to end: real Envoy, ``epp serve`` and a sim.

The Envoy bootstrap sends the response body (``STREAMED``), so the EPP observes usage, TTFT and
inter-token latency; the deprecated names must show the same values as the current ones.
"""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from tests.integration.harness import JSON_HEADERS, MODEL, Rig, marker
from tests.unit.extproc_harness import body_msg, headers_msg

pytestmark = pytest.mark.integration

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$")


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((labels, float(m.group(3))))
    return out


def _total(text: str, name: str, **want: str) -> float:
    return sum(v for labels, v in _samples(text, name) if all(labels.get(k) == x for k, x in want.items()))


def test_current_and_deprecated_names_and_drop_reasons_through_envoy(rig: Rig) -> None:
    sims = rig.start_sims(1, extra=["--inter-token-latency", "20", "--max-tokens", "4"])  # ms between tokens
    epp = rig.start_epp(sims)
    envoy = rig.start_envoy(epp, response_body_mode="STREAMED", subset_hint_header="x-test-subset")
    processed = _total(epp.metrics(), "llm_d_epp_request_processing_duration_seconds_count")  # the GETs
    plain = envoy.post(
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"{marker()} hi"}]}).encode(),
        {**JSON_HEADERS, "x-llm-d-inference-fairness-id": "tenant-int"},
    )
    assert plain.status == 200, plain.body
    usage = plain.json()["usage"]
    streamed = envoy.post(
        "/v1/chat/completions",
        json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"{marker()} hi"}],
            }
        ).encode(),
        {**JSON_HEADERS, "x-llm-d-inference-fairness-id": "tenant-int"},
    )
    assert streamed.status == 200 and b"[DONE]" in streamed.body

    # No candidate for the subset hint: 503 with the reference's drop reason, through Envoy.
    rejected = envoy.post(
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode(),
        {**JSON_HEADERS, "x-test-subset": "10.255.255.1:1"},
    )
    assert rejected.status == 503, rejected.body
    assert rejected.headers.get("x-llm-d-request-dropped-reason") == "rejected-no-endpoints"

    text = epp.metrics()
    key = {"model_name": MODEL, "target_model_name": MODEL}
    assert _total(text, "llm_d_epp_request_total", **key, fairness_id="tenant-int") == 2
    assert _total(text, "llm_d_epp_request_total", **key) == _total(
        text, "inference_objective_request_total", **key
    )
    assert _total(text, "llm_d_epp_request_error_total", error_code="ServiceUnavailable") == 1
    assert _total(text, "inference_objective_request_error_total", error_code="ServiceUnavailable") == 1
    for current, deprecated in (
        ("llm_d_epp_request_duration_seconds_count", "inference_objective_request_duration_seconds_count"),
        ("llm_d_epp_request_output_tokens_sum", "inference_objective_output_tokens_sum"),
        ("llm_d_epp_request_input_tokens_sum", "inference_objective_input_tokens_sum"),
        ("llm_d_epp_response_size_bytes_sum", "inference_objective_response_sizes_sum"),
        (
            "llm_d_epp_scheduler_e2e_duration_seconds_count",
            "inference_extension_scheduler_e2e_duration_seconds_count",
        ),
    ):
        assert _total(text, current) == _total(text, deprecated) > 0, current
    fair = {"fairness_id": "tenant-int", **key}
    assert _total(text, "llm_d_epp_request_output_tokens_sum", **fair) >= usage["completion_tokens"] + 1
    assert _total(text, "llm_d_epp_request_ttft_seconds_count", **fair, streaming="true") == 1
    assert _total(text, "llm_d_epp_request_ttft_seconds_count", **fair, streaming="false") == 1
    assert _total(text, "llm_d_epp_request_streaming_itl_seconds_count", **fair) >= 1
    assert _total(text, "llm_d_epp_request_processing_duration_seconds_count") == processed + 3
    assert _total(text, "llm_d_epp_response_processing_duration_seconds_count") >= 2
    assert _total(text, "llm_d_epp_request_running", **key) == 0
    assert _total(text, "inference_objective_running_requests", model_name=MODEL) == 0


async def _route_once(port: int, body: bytes) -> ep.ProcessingResponse | grpc.RpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        try:
            await call.write(headers_msg({}))
            await call.write(body_msg(body, True))
            first = await call.read()
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError as e:
            return e
        assert first is not grpc.aio.EOF
        return first


def test_serve_flags_endpoint_scores_stream_metrics_and_message_size(rig: Rig) -> None:
    sims = rig.start_sims(2)
    epp = rig.start_epp(
        sims,
        extra=["--emit-endpoint-scores", "--enable-grpc-stream-metrics", "--grpc-max-recv-msg-size=4KiB"],
    )
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    reply = asyncio.run(_route_once(epp.grpc_port, body))
    assert isinstance(reply, ep.ProcessingResponse) and reply.HasField("request_headers"), reply
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    destination = lb["x-gateway-destination-endpoint"].string_value
    scores = lb["x-gateway-destination-endpoint-scores"].struct_value.fields
    assert list(scores) == [destination] and scores[destination].number_value > 0

    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}).encode()
    refused = asyncio.run(_route_once(epp.grpc_port, big))
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    text = epp.metrics()
    assert _total(text, "llm_d_epp_extproc_streams_total", code="OK") >= 1
    assert _total(text, "llm_d_epp_extproc_stream_duration_seconds_count") >= 1


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_metrics_show_what_is_loaded_and_the_deprecated_twins_only_when_asked(rig: Rig) -> None:
    sims = rig.start_sims(1)
    plain = _families(rig.start_epp(sims, name="epp-plain").metrics())
    lean = _families(
        rig.start_epp(sims, name="epp-lean", extra=["--emit-deprecated-metrics=false"]).metrics()
    )
    deprecated = {f for f in plain if f.startswith(("inference_objective_", "inference_extension_"))}
    assert deprecated, "the deprecated twins are on by default (drop-in dashboards)"
    assert lean & deprecated == set()
    assert "llm_d_epp_request_total" in lean or "llm_d_epp_request" in lean
    # families of plugins the default configuration does not load are left out
    absent = {
        "llm_d_epp_flow_control_queue_size",  # the flowControl gate is off
        "llm_d_epp_flow_control_requests",
        "llm_d_epp_kv_cache_events_pool_capacity",  # no precise-prefix-cache-producer
        "llm_d_epp_kv_cache_events_active_subscribers",
    }
    assert plain & absent == set()
    # the loaded ones stay: the default saturation detector's, the approximate prefix index's
    assert {"llm_d_epp_flow_control_stale_endpoints", "llm_d_epp_prefix_indexer_size"} <= plain
