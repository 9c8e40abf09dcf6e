"""The reference's metric names, drop reasons and wire extras, checked on the real /metrics page.

Requests go through the real ext_proc handler over gRPC (``extproc_harness``); the page is the
exposition the metrics server serves (``promlite.exposition``), parsed with prometheus-client.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import epp.plugins  # noqa: F401  (registers the plugin metrics)
from epp import metrics, promlite
from epp.datalayer.pool_gauges import PoolGauges
from epp.datalayer.store import EndpointStore
from epp.framework import (
    CycleState,
    Endpoint,
    Filter,
    LLMRequest,
    Metrics,
    PreRequest,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    ResponseInfo,
    SchedulingResult,
)
from epp.server.extproc import StreamOptions
from tests.unit import factories
from tests.unit.extproc_harness import (
    Harness,
    body_msg,
    endpoint,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    set_headers,
    start,
)

CHAT = b'{"model":"demo","messages":[{"role":"user","content":"hi"}]}'
STREAM_CHAT = b'{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
DROPPED = "x-llm-d-request-dropped-reason"
POOL = "pool-ref"  # the harness director's pool: the request families' inference_pool label

# Every name of the reference's docs/metrics.md that epp implements, current and deprecated.
CURRENT = [
    "llm_d_epp_request_total",
    "llm_d_epp_request_error_total",
    "llm_d_epp_request_duration_seconds",
    "llm_d_epp_request_size_bytes",
    "llm_d_epp_response_size_bytes",
    "llm_d_epp_request_input_tokens",
    "llm_d_epp_request_output_tokens",
    "llm_d_epp_request_cached_tokens",
    "llm_d_epp_request_running",
    "llm_d_epp_request_ntpot_seconds",
    "llm_d_epp_request_ttft_seconds",
    "llm_d_epp_request_streaming_tpot_seconds",
    "llm_d_epp_request_streaming_itl_seconds",
    "llm_d_epp_average_kv_cache_utilization",
    "llm_d_epp_average_queue_size",
    "llm_d_epp_average_running_requests",
    "llm_d_epp_std_dev_kv_cache_utilization",
    "llm_d_epp_std_dev_queue_size",
    "llm_d_epp_std_dev_running_requests",
    "llm_d_epp_ready_endpoints",
    "llm_d_epp_per_endpoint_queue_size",
    "llm_d_epp_scheduler_e2e_duration_seconds",
    "llm_d_epp_scheduler_attempts_total",
    "llm_d_epp_request_processing_duration_seconds",
    "llm_d_epp_response_processing_duration_seconds",
    "llm_d_epp_plugin_duration_seconds",
    "llm_d_epp_info",
    "llm_d_epp_model_rewrite_decisions_total",
    "llm_d_epp_datalayer_poll_errors_total",
    "llm_d_epp_datalayer_extract_errors_total",
    "llm_d_epp_prefix_indexer_size",
    "llm_d_epp_prefix_indexer_hit_ratio",
    "llm_d_epp_prefix_indexer_hit_bytes",
    "llm_d_epp_disagg_decision_total",
    "llm_d_epp_pd_decision_total",
    "llm_d_epp_flow_control_stale_endpoints",
    "llm_d_epp_program_aware_jains_fairness_index",
    "llm_d_epp_program_aware_avg_wait_time_milliseconds",
    "llm_d_epp_program_aware_attained_service_tokens",
    "llm_d_epp_extproc_streams_inflight",
]
# (deprecated name, current name, {deprecated label: current label} for renamed labels)
DEPRECATED: list[tuple[str, str, dict[str, str]]] = [
    ("inference_objective_request_total", "llm_d_epp_request_total", {}),
    ("inference_objective_request_error_total", "llm_d_epp_request_error_total", {}),
    ("inference_objective_request_duration_seconds", "llm_d_epp_request_duration_seconds", {}),
    ("inference_objective_request_sizes", "llm_d_epp_request_size_bytes", {}),
    ("inference_objective_response_sizes", "llm_d_epp_response_size_bytes", {}),
    ("inference_objective_input_tokens", "llm_d_epp_request_input_tokens", {}),
    ("inference_objective_output_tokens", "llm_d_epp_request_output_tokens", {}),
    ("inference_objective_prompt_cached_tokens", "llm_d_epp_request_cached_tokens", {}),
    ("inference_objective_running_requests", "llm_d_epp_request_running", {}),
    ("inference_objective_normalized_time_per_output_token_seconds", "llm_d_epp_request_ntpot_seconds", {}),
    ("inference_pool_average_kv_cache_utilization", "llm_d_epp_average_kv_cache_utilization", {}),
    ("inference_pool_average_queue_size", "llm_d_epp_average_queue_size", {}),
    ("inference_pool_average_running_requests", "llm_d_epp_average_running_requests", {}),
    ("inference_pool_ready_pods", "llm_d_epp_ready_endpoints", {}),
    (
        "inference_pool_per_pod_queue_size",
        "llm_d_epp_per_endpoint_queue_size",
        {"model_server_pod": "model_server_endpoint"},
    ),
    ("inference_extension_scheduler_e2e_duration_seconds", "llm_d_epp_scheduler_e2e_duration_seconds", {}),
    (
        "inference_extension_scheduler_attempts_total",
        "llm_d_epp_scheduler_attempts_total",
        {"pod_name": "endpoint_name"},
    ),
    ("inference_extension_plugin_duration_seconds", "llm_d_epp_plugin_duration_seconds", {}),
    ("inference_extension_model_rewrite_decisions_total", "llm_d_epp_model_rewrite_decisions_total", {}),
    ("inference_extension_info", "llm_d_epp_info", {}),
    ("llm_d_inference_scheduler_datalayer_poll_errors_total", "llm_d_epp_datalayer_poll_errors_total", {}),
    (
        "llm_d_inference_scheduler_datalayer_extract_errors_total",
        "llm_d_epp_datalayer_extract_errors_total",
        {},
    ),
    ("inference_extension_prefix_indexer_size", "llm_d_epp_prefix_indexer_size", {}),
    ("inference_extension_prefix_indexer_hit_ratio", "llm_d_epp_prefix_indexer_hit_ratio", {}),
    ("inference_extension_prefix_indexer_hit_bytes", "llm_d_epp_prefix_indexer_hit_bytes", {}),
    ("llm_d_inference_scheduler_disagg_decision_total", "llm_d_epp_disagg_decision_total", {}),
    ("llm_d_inference_scheduler_pd_decision_total", "llm_d_epp_pd_decision_total", {}),
]


Samples = list[tuple[str, dict[str, str], float]]


def page() -> dict[str, Samples]:
    """The /metrics page: family name (counters without ``_total``) -> (sample name, labels, value)."""
    text = promlite.exposition(REGISTRY).decode()
    return {
        fam.name: [(s.name, dict(s.labels), s.value) for s in fam.samples]
        for fam in text_string_to_metric_families(text)
    }


def family(families: dict[str, Samples], name: str) -> Samples:
    return families[name.removesuffix("_total")]


def by_labels(
    samples: Samples, base: str, keep: set[str], rename: dict[str, str] | None = None
) -> dict[tuple[Any, ...], float]:
    """Values per (sample suffix, labels in ``keep``), summed over the other labels."""
    rename = rename or {}
    out: dict[tuple[Any, ...], float] = {}
    for name, lbls, v in samples:
        named = {rename.get(k, k): x for k, x in lbls.items()}
        key = (name[len(base) :], *sorted((k, x) for k, x in named.items() if k in keep or k == "le"))
        out[key] = out.get(key, 0.0) + v
    return out


class Seen(PreRequest):
    type_name = "seen"

    def __init__(self) -> None:
        super().__init__("seen", None)
        self.requests: list[LLMRequest] = []

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        self.requests.append(request)


class DropAll(Filter):
    type_name = "drop-all"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        return []


@pytest.fixture
def store() -> EndpointStore:
    s = EndpointStore()
    for i in (1, 2):
        s.upsert(endpoint(i))
    return s


@pytest.fixture
async def run(store: EndpointStore) -> AsyncIterator[Any]:
    started: list[Harness] = []

    async def _run(messages: list[Any], expect: int, **kw: Any) -> list[Any]:
        opts = kw.pop("opts", None)
        director = kw.pop("director", None) or factories.director(store, **kw)
        director.pool_label = metrics.pool_label(POOL)
        h = await start(store, director=director, opts=opts)
        started.append(h)
        return await h.exchange(messages, expect=expect)

    yield _run
    for h in started:
        await h.channel.close()
        await h.server.stop(0)


def error_reply(reply: Any) -> tuple[int, str, dict[str, str]]:
    ir = reply.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, json.loads(ir.body)["error"]["message"], headers


def value(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


# --- names and dual emission ---------------------------------------------------------------------


async def test_every_implemented_reference_name_is_on_the_metrics_page(run: Any) -> None:
    await run(
        [
            headers_msg({"x-llm-d-inference-fairness-id": "tenant-names"}),
            body_msg(STREAM_CHAT, True),
            response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
            response_body_msg(b'data: {"choices":[]}\n\n', False),
            response_body_msg(b'data: {"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n', True),
        ],
        expect=5,
    )
    families = page()
    missing = [n for n in CURRENT + [d for d, _, _ in DEPRECATED] if n.removesuffix("_total") not in families]
    assert missing == []


async def test_deprecated_series_equal_the_current_ones_they_are_rendered_from(
    run: Any, store: EndpointStore
) -> None:
    for fairness in ("tenant-x", "tenant-y"):  # two flows: the deprecated series sum over fairness_id
        await run(
            [
                headers_msg({"x-llm-d-inference-fairness-id": fairness}),
                body_msg(STREAM_CHAT, True),
                response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
                response_body_msg(
                    b'data: {"usage":{"prompt_tokens":7,"completion_tokens":2,'
                    b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n',
                    True,
                ),
            ],
            expect=4,
        )
    await run([headers_msg({}), body_msg(b'{"messages":[]}', True)], expect=1)  # a 400: the error counter
    _record_the_rest()
    for e in store.endpoints():
        e.metrics = Metrics(waiting_queue_size=3, kv_cache_usage_percent=0.5, update_time=time.monotonic())
    PoolGauges(store, "pool-dual").refresh()
    families = page()
    for old, new, renamed in DEPRECATED:
        old_samples = family(families, old)
        assert old_samples, old
        keep = {k for _, lbls, _ in old_samples for k in lbls} - {"le"}
        back = {cur: dep for dep, cur in renamed.items()}
        current = by_labels(family(families, new), new.removesuffix("_total"), keep, back)
        assert by_labels(old_samples, old.removesuffix("_total"), keep) == current, old
    fair = family(families, "llm_d_epp_request_total")
    assert {s[1]["fairness_id"] for s in fair if s[1]["model_name"] == "demo"} >= {"tenant-x", "tenant-y"}
    assert "fairness_id" not in family(families, "inference_objective_request_total")[0][1]
    # epp's pool label: on every current request family, on none of the reference's deprecated twins
    assert {s[1]["inference_pool"] for s in fair if s[1]["fairness_id"] in ("tenant-x", "tenant-y")} == {POOL}
    for old, new, _ in DEPRECATED[:10]:
        assert all("inference_pool" in lbls for _, lbls, _ in family(families, new)), new
        assert not any("inference_pool" in lbls for _, lbls, _ in family(families, old)), old


class _Index:
    def size(self) -> int:
        return 5


_INDEX = _Index()


def _record_the_rest() -> None:
    """Metrics a unit harness does not reach: recorded through the functions the server uses."""
    from epp.plugins.producers import _prefix_metrics
    from epp.plugins.profile_handlers import _metrics as disagg_metrics

    metrics.observe_plugin("Filter", DropAll("dual-filter", None), 0.0003)
    metrics.DATALAYER_POLL_ERRORS.labels("dual-source").inc()
    metrics.DATALAYER_EXTRACT_ERRORS.labels("dual-source", "dual-extractor").inc()
    metrics.MODEL_REWRITE_DECISIONS.labels("rule", "demo", "demo").inc()
    metrics.INFO.labels("unknown", "epp").set(1)
    metrics.SCHEDULER_ATTEMPTS.labels("success", "demo", "ep-1", "default", "8000").inc()
    disagg_metrics.record_disagg_decision("dual-a", "disagg-profile-handler", "demo", "decode-only")
    disagg_metrics.record_disagg_decision("dual-b", "disagg-profile-handler", "demo", "decode-only")
    disagg_metrics.record_pd_decision("dual-c", "pd-profile-handler", "demo", "prefill-decode")
    hits = _prefix_metrics.track_index(_INDEX, "dual-prefix", "approx-prefix-cache-producer")
    _prefix_metrics.record_match(hits, 16, 64)


def test_alias_sums_dropped_labels_and_renames() -> None:
    c = promlite.Counter("t_cur_total", "c", ["a", "b"])
    old = promlite.alias(c, "t_old_total", "old", ["x"], from_labels=["a"])
    h = promlite.Histogram("t_cur_seconds", "h", ["a", "b"], buckets=(1.0, 2.0))
    old_h = promlite.alias(h, "t_old_seconds", "old h", ["a"])
    c.labels("1", "p").inc(2)
    c.labels("1", "q").inc(3)
    c.labels("2", "p").inc()
    h.labels("1", "p").observe(0.5)
    h.labels("1", "q").observe(1.5)
    out: list[str] = []
    old.render(out)
    old_h.render(out)
    text = "".join(out)
    assert 't_old_total{x="1"} 5.0' in text and 't_old_total{x="2"} 1.0' in text
    assert 't_old_seconds_bucket{a="1",le="1.0"} 1.0' in text
    assert 't_old_seconds_bucket{a="1",le="2.0"} 2.0' in text
    assert 't_old_seconds_sum{a="1"} 2.0' in text
    with pytest.raises(ValueError, match="not among"):
        promlite.alias(c, "t_bad_total", "bad", ["z"])


def test_pool_gauges_means_and_sample_standard_deviations() -> None:
    s = EndpointStore()
    now = time.monotonic()
    for i in (1, 2):
        s.upsert(endpoint(i))
    ordered = sorted(s.endpoints(), key=lambda e: e.hostport)
    for e, (q, kv, run) in zip(ordered, ((2, 0.2, 1), (4, 0.6, 3)), strict=True):
        e.metrics = Metrics(
            waiting_queue_size=q, kv_cache_usage_percent=kv, running_requests_size=run, update_time=now
        )
    PoolGauges(s, "pool-std").refresh(now)
    assert value("llm_d_epp_average_queue_size", name="pool-std") == 3.0
    # the reference's sample standard deviation, rounded to two decimals: sqrt(2) for (2, 4)
    assert value("llm_d_epp_std_dev_queue_size", name="pool-std") == 1.41
    assert value("llm_d_epp_std_dev_kv_cache_utilization", name="pool-std") == 0.28
    assert value("llm_d_epp_std_dev_running_requests", name="pool-std") == 1.41
    assert value("llm_d_epp_ready_endpoints", name="pool-std") == 2.0
    assert value("inference_pool_ready_pods", name="pool-std") == 2.0
    assert value("inference_pool_per_pod_queue_size", name="pool-std", model_server_pod="ep-2") == 4.0


# --- response observation ------------------------------------------------------------------------


async def test_streamed_response_records_ttft_itl_tpot_tokens_and_sizes(run: Any) -> None:
    key = {
        "model_name": "demo",
        "target_model_name": "demo",
        "fairness_id": "tenant-stream",
        "priority": "0",
        "inference_pool": POOL,
    }
    chunks = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'] * 3 + [
        b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":4}}\n\ndata: [DONE]\n\n'
    ]
    await run(
        [
            headers_msg({"x-llm-d-inference-fairness-id": "tenant-stream"}),
            body_msg(STREAM_CHAT, True),
            response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
            *[response_body_msg(c, i == len(chunks) - 1) for i, c in enumerate(chunks)],
        ],
        expect=3 + len(chunks),
    )
    assert value("llm_d_epp_request_ttft_seconds_count", **key, streaming="true") == 1
    assert value("llm_d_epp_request_streaming_itl_seconds_count", **key) == 3  # between 4 chunks
    assert value("llm_d_epp_request_streaming_tpot_seconds_count", **key) == 1
    assert value("llm_d_epp_request_input_tokens_sum", **key) == 11
    assert value("llm_d_epp_request_output_tokens_sum", **key) == 4
    assert value("llm_d_epp_request_ntpot_seconds_count", **key) == 1
    assert value("llm_d_epp_request_cached_tokens_count", **key) == 0  # no prompt_tokens_details
    assert value("llm_d_epp_response_size_bytes_sum", **key) == sum(len(c) for c in chunks)
    assert value("llm_d_epp_request_running", **key) == 0


async def test_a_stream_without_usage_leaves_only_the_usage_histograms_empty(run: Any) -> None:
    """A streamed completion whose client did not ask for ``stream_options.include_usage`` has no
    token counts: exactly the ``FROM_USAGE`` histograms stay empty (nothing estimates them)."""
    key = {
        "model_name": "demo",
        "target_model_name": "demo",
        "fairness_id": "tenant-no-usage",
        "priority": "0",
        "inference_pool": POOL,
    }
    chunks = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'] * 3 + [b"data: [DONE]\n\n"]
    await run(
        [
            headers_msg({"x-llm-d-inference-fairness-id": "tenant-no-usage"}),
            body_msg(STREAM_CHAT, True),
            response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
            *[response_body_msg(c, i == len(chunks) - 1) for i, c in enumerate(chunks)],
        ],
        expect=3 + len(chunks),
    )
    histograms = [
        (metrics.INPUT_TOKENS, key),
        (metrics.OUTPUT_TOKENS, key),
        (metrics.CACHED_TOKENS, key),
        (metrics.NTPOT, key),
        (metrics.TTFT, {**key, "streaming": "true"}),
        (metrics.TPOT, key),
        (metrics.ITL, key),
        (metrics.RESPONSE_SIZES, key),
    ]
    empty = {h.name for h, labels in histograms if value(f"{h.name}_count", **labels) == 0}
    assert empty == {h.name for h in metrics.FROM_USAGE}
    assert value("llm_d_epp_request_streaming_itl_seconds_count", **key) == 3  # between 4 chunks


def test_the_readme_names_the_metrics_that_need_include_usage() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (paragraph,) = [p for p in readme.split("\n- **") if p.startswith("Metrics**")]
    assert '"stream_options": {"include_usage": true}' in paragraph
    assert [h.name for h in metrics.FROM_USAGE if f"`{h.name}`" not in paragraph] == []


async def test_non_streaming_usage_split_across_chunks_is_read(run: Any) -> None:
    key = {
        "model_name": "demo",
        "target_model_name": "demo",
        "fairness_id": "tenant-split",
        "priority": "0",
        "inference_pool": POOL,
    }
    body = (
        b'{"id":"x","choices":[],"usage":{"prompt_tokens":21,"completion_tokens":9,'
        b'"prompt_tokens_details":{"cached_tokens":16}}}'
    )
    cut = body.index(b"completion")
    await run(
        [
            headers_msg({"x-llm-d-inference-fairness-id": "tenant-split"}),
            body_msg(CHAT, True),
            response_headers_msg({":status": "200", "content-type": "application/json"}),
            response_body_msg(body[:cut], False),
            response_body_msg(body[cut:], True),
        ],
        expect=5,  # full duplex, not streaming, no model to undo: each chunk is answered as it comes
    )
    assert value("llm_d_epp_request_input_tokens_sum", **key) == 21
    assert value("llm_d_epp_request_output_tokens_sum", **key) == 9
    assert value("llm_d_epp_request_cached_tokens_sum", **key) == 16
    assert value("llm_d_epp_request_ttft_seconds_count", **key, streaming="false") == 1
    assert value("llm_d_epp_request_streaming_itl_seconds_count", **key) == 0
    assert value("llm_d_epp_response_size_bytes_sum", **key) == len(body)


async def test_without_the_body_the_response_size_comes_from_content_length(run: Any) -> None:
    key = {
        "model_name": "demo",
        "target_model_name": "demo",
        "fairness_id": "tenant-cl",
        "priority": "0",
        "inference_pool": POOL,
    }
    before = value("llm_d_epp_response_processing_duration_seconds_count")
    await run(
        [
            headers_msg({"x-llm-d-inference-fairness-id": "tenant-cl"}),
            body_msg(CHAT, True),
            response_headers_msg(
                {":status": "200", "content-type": "application/json", "content-length": "321"}
            ),
        ],
        expect=3,
    )
    assert value("llm_d_epp_response_size_bytes_sum", **key) == 321
    assert value("llm_d_epp_request_input_tokens_count", **key) == 0  # no body, no usage
    assert value("llm_d_epp_response_processing_duration_seconds_count") == before + 1


async def test_request_processing_is_observed_for_routed_and_rejected_requests(run: Any) -> None:
    before = value("llm_d_epp_request_processing_duration_seconds_count")
    await run([headers_msg({}), body_msg(CHAT, True)], expect=2)
    await run([headers_msg({}), body_msg(b"not json", True)], expect=1)
    assert value("llm_d_epp_request_processing_duration_seconds_count") == before + 2


async def test_rejected_request_is_counted_with_its_model_and_fairness_labels(
    run: Any, store: EndpointStore
) -> None:
    labels = {
        "model_name": "demo",
        "target_model_name": "demo",
        "fairness_id": "tenant-err",
        "priority": "0",
        "inference_pool": POOL,
        "error_code": "ResourceExhausted",
    }
    before = value("llm_d_epp_request_error_total", **labels)
    (reply,) = await run(
        [headers_msg({"x-llm-d-inference-fairness-id": "tenant-err"}), body_msg(CHAT, True)],
        expect=1,
        filters=[DropAll("drop-all", None)],
    )
    assert error_reply(reply)[0] == 429
    assert value("llm_d_epp_request_error_total", **labels) == before + 1


# --- drop reasons ---------------------------------------------------------------------------------


async def test_filters_draining_every_candidate_is_429_rejected_saturated(run: Any) -> None:
    (reply,) = await run(
        [headers_msg({}), body_msg(CHAT, True)], expect=1, filters=[DropAll("drop-all", None)]
    )
    status, message, headers = error_reply(reply)
    assert status == 429
    assert "no endpoints available for the given request" in message
    assert headers[DROPPED] == "rejected-saturated"


async def test_no_candidates_is_503_rejected_no_endpoints(run: Any, store: EndpointStore) -> None:
    # the subset hint names an address no endpoint has
    (reply,) = await run([headers_msg({}, subset=["10.9.9.9:8000"]), body_msg(CHAT, True)], expect=1)
    assert error_reply(reply)[0] == 503
    assert error_reply(reply)[2][DROPPED] == "rejected-no-endpoints"
    for e in list(store.endpoints()):
        store.delete(e.metadata.key)
    (reply,) = await run([headers_msg({}), body_msg(CHAT, True)], expect=1)
    assert error_reply(reply)[2][DROPPED] == "rejected-no-endpoints"
    (reply,) = await run([headers_msg({}, end_of_stream=True)], expect=1)  # GET: the random path
    assert error_reply(reply)[:1] == (503,) and error_reply(reply)[2][DROPPED] == "rejected-no-endpoints"


async def test_other_rejections_carry_no_drop_reason(run: Any) -> None:
    (reply,) = await run([headers_msg({}), body_msg(b'{"messages":[]}', True)], expect=1)
    status, _, headers = error_reply(reply)
    assert status == 400 and DROPPED not in headers


# --- SLO headers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "ttft", "tpot"),
    [
        ({"x-llm-d-slo-ttft-ms": "250", "x-llm-d-slo-tpot-ms": "12.5"}, 250.0, 12.5),
        ({"x-slo-ttft-ms": "300", "x-slo-tpot-ms": "20"}, 300.0, 20.0),
        ({"x-llm-d-slo-ttft-ms": "100", "x-slo-ttft-ms": "900"}, 100.0, 0.0),
        ({}, 0.0, 0.0),
    ],
)
async def test_slo_headers_reach_the_request_and_are_not_forwarded(
    run: Any, store: EndpointStore, headers: dict[str, str], ttft: float, tpot: float
) -> None:
    seen = Seen()
    out = await run([headers_msg(headers), body_msg(CHAT, True)], expect=2, pre_request=[seen])
    (request,) = seen.requests
    assert (request.slo_ttft_ms, request.slo_tpot_ms) == (ttft, tpot)
    mutation = out[0].request_headers.response.header_mutation
    assert set(headers) <= set(mutation.remove_headers)
    assert not set(headers) & set(set_headers(out[0].request_headers.response))


@pytest.mark.parametrize("raw", ["fast", "-5", "nan", "inf"])
async def test_an_invalid_slo_header_is_400(run: Any, raw: str) -> None:
    (reply,) = await run([headers_msg({"x-llm-d-slo-tpot-ms": raw}), body_msg(CHAT, True)], expect=1)
    status, message, _ = error_reply(reply)
    assert status == 400
    assert "x-llm-d-slo-tpot-ms" in message and "milliseconds" in message


async def test_a_client_sent_drop_reason_header_is_not_forwarded(run: Any) -> None:
    out = await run([headers_msg({DROPPED: "rejected-saturated"}), body_msg(CHAT, True)], expect=2)
    assert DROPPED in out[0].request_headers.response.header_mutation.remove_headers


# --- endpoint scores ------------------------------------------------------------------------------


def _scores(reply: Any) -> dict[str, float] | None:
    ns = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    if "x-gateway-destination-endpoint-scores" not in ns.fields:
        return None
    return {
        k: v.number_value
        for k, v in ns.fields["x-gateway-destination-endpoint-scores"].struct_value.fields.items()
    }


async def test_endpoint_scores_are_emitted_only_when_enabled(run: Any, store: EndpointStore) -> None:
    now = time.monotonic()
    for e, q in zip(sorted(store.endpoints(), key=lambda e: e.hostport), (0, 8), strict=True):
        e.metrics = factories.known_metrics(waiting_queue_size=q, update_time=now)
    off = await run([headers_msg({}), body_msg(CHAT, True)], expect=2)
    assert _scores(off[0]) is None

    director = factories.director(store)
    for profile in director.scheduler.profiles.values():  # what `epp serve --emit-endpoint-scores` sets
        profile.record_scores = True
    on = await run(
        [headers_msg({}), body_msg(CHAT, True)],
        expect=2,
        director=director,
        opts=StreamOptions(emit_endpoint_scores=True),
    )
    scores = _scores(on[0])
    assert scores is not None and list(scores) == ["10.0.0.1:8000"]  # the picked endpoint only
    assert scores["10.0.0.1:8000"] == pytest.approx(1.0)  # the idle queue scores 1 (weight 1)


# --- ext_proc stream metrics ----------------------------------------------------------------------


async def test_grpc_stream_metrics_count_completed_streams_by_code(run: Any) -> None:
    metrics.enable_grpc_stream_metrics()
    ok = value("llm_d_epp_extproc_streams_total", code="OK")
    n = value("llm_d_epp_extproc_stream_duration_seconds_count")
    await run([headers_msg({}), body_msg(CHAT, True)], expect=2, opts=StreamOptions(grpc_stream_metrics=True))
    assert value("llm_d_epp_extproc_streams_total", code="OK") == ok + 1
    assert value("llm_d_epp_extproc_stream_duration_seconds_count") == n + 1
    await run([headers_msg({}), body_msg(CHAT, True)], expect=2)  # off: not counted
    assert value("llm_d_epp_extproc_streams_total", code="OK") == ok + 1


# --- usage parsing and flags ----------------------------------------------------------------------


def test_usage_reader_openai_anthropic_null_split_and_strings() -> None:
    from epp.server.usage import UsageReader

    r = UsageReader()
    r.feed(b'data: {"choices":[{"delta":{"content":"the \\"usage\\": {x}"}}],"usage":null}\n\n')
    assert (r.prompt, r.completion, r.raw) == (0, 0, None)  # a quoted "usage" in text, then null
    r.feed(b'data: {"usage":{"prompt_tokens":3,"comp')
    r.feed(b'letion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}\n\n')
    assert (r.prompt, r.completion, r.cached) == (3, 2, 1)

    a = UsageReader()  # Anthropic: prompt side in message_start, completion in message_delta
    a.feed(
        b'event: message_start\ndata: {"message":{"usage":'
        b'{"input_tokens":9,"cache_read_input_tokens":4}}}\n\n'
    )
    a.feed(b'event: message_delta\ndata: {"usage":{"output_tokens":5}}\n\n')
    assert (a.prompt, a.completion, a.cached) == (9, 5, 4)


def test_grpc_message_size_flags() -> None:
    from epp.cli import _msg_size_bytes, build_parser

    assert _msg_size_bytes("10MiB") == 10 << 20
    assert _msg_size_bytes("25MB") == 25_000_000
    assert _msg_size_bytes("") == 0
    args = build_parser().parse_args(
        ["serve", "--grpc-max-recv-msg-size", "4Mi", "--emit-endpoint-scores", "--enable-grpc-stream-metrics"]
    )
    assert (
        args.grpc_max_recv_msg_size == "4Mi" and args.emit_endpoint_scores and args.enable_grpc_stream_metrics
    )
    assert not build_parser().parse_args(["serve"]).emit_endpoint_scores
    for bad in ("lots", "-1Mi", "3Gi"):
        with pytest.raises(ValueError):
            _msg_size_bytes(bad)


class _Watcher(ResponseHeaderProcessor, ResponseBodyProcessor):
    type_name = "response-watcher"

    def __init__(self) -> None:
        super().__init__("watcher", None)
        self.usage: list[Any] = []

    def response_header(self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None) -> None:
        pass

    def response_body(
        self, request: LLMRequest, response: ResponseInfo, endpoint: Endpoint | None, chunk: bytes
    ) -> None:
        self.usage.append(response.usage)


async def test_response_plugins_are_timed_and_see_the_usage(run: Any) -> None:
    watcher = _Watcher()
    opts = StreamOptions(response_header=(watcher,), response_body=(watcher,))

    def count(point: str) -> float:
        return value(
            "llm_d_epp_plugin_duration_seconds_count",
            extension_point=point,
            plugin_type="response-watcher",
            plugin_name="watcher",
        )

    before = {p: count(p) for p in ("ResponseReceived", "ResponseStreaming", "ResponseComplete")}
    await run(
        [
            headers_msg({}),
            body_msg(STREAM_CHAT, True),
            response_headers_msg({":status": "200", "content-type": "text/event-stream"}),
            response_body_msg(b'data: {"choices":[]}\n\n', False),
            response_body_msg(b'data: {"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n', True),
        ],
        expect=5,
        opts=opts,
    )
    assert {p: count(p) - before[p] for p in before} == {
        "ResponseReceived": 1,
        "ResponseStreaming": 1,
        "ResponseComplete": 1,
    }
    assert watcher.usage == [None, {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}]
