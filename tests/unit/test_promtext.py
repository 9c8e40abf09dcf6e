"""Prometheus text extraction (promtext) and the core-metrics-extractor engine mappings."""

from __future__ import annotations

import math

import pytest

from epp.framework import ConfigError, Endpoint, Metrics
from epp.framework.params import decode_params
from epp.plugins.scraping.core_metrics_extractor import (
    CoreMetricsExtractor,
    CoreMetricsExtractorParams,
)
from epp.plugins.scraping.promtext import Selector, info_labels, lora_info, split_csv
from tests.unit.factories import endpoint

VLLM_PAGE = b"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 123.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.3
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.0e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters=" a1 ,, a2 ",waiting_lora_adapters="a3"} 1.7e9
vllm:lora_requests_info{max_lora="3",running_lora_adapters="mid",waiting_lora_adapters=""} 1.5e9
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="31250"} 1.0
"""


def _endpoint(labels: dict[str, str] | None = None, metrics: Metrics | None = None) -> Endpoint:
    return endpoint("e", labels=labels, metrics=metrics)


def _extractor(**raw: object) -> CoreMetricsExtractor:
    params = decode_params(CoreMetricsExtractorParams, dict(raw), "plugins[0].parameters")
    return CoreMetricsExtractor("core-metrics-extractor", params)


# --- spec compilation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "name", "matchers"),
    [
        ("vllm:num_requests_waiting", "vllm:num_requests_waiting", ()),
        ("  m  ", "m", ()),
        ("m{a=b}", "m", (("a", "b"),)),
        ("m{a=\"b c\", d = 'e'}", "m", (("a", "b c"), ("d", "e"))),
        ('m{a="x\\"y"}', "m", (("a", 'x"y'),)),
        ("m{a=b,}", "m", (("a", "b"),)),
        ("m{}", "m", ()),
        ('{__name__="m",a="b"}', "m", (("a", "b"),)),
        ("m{__meta=x,a=b}", "m", (("a", "b"),)),
        (
            "nv_trt_llm_request_metrics{request_type=waiting}",
            "nv_trt_llm_request_metrics",
            (("request_type", "waiting"),),
        ),
    ],
)
def test_selector_parse(spec: str, name: str, matchers: tuple[tuple[str, str], ...]) -> None:
    selector = Selector.parse(spec)
    assert selector.name == name
    assert selector.matchers == matchers
    assert Selector.parse(str(selector)) == selector  # str() renders a spec that compiles back


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("", "no metric name"),
        ("m{a!=b}", "only '=' matchers"),
        ("m{a=~b}", "only '=' matchers"),
        ("m{a=b", "missing closing"),
        ("1m", "invalid metric name"),
        ("m{a b}", "cannot parse matcher"),
        ("m{a=b c=d}", "cannot parse matcher"),
    ],
)
def test_selector_parse_errors(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Selector.parse(spec)


# --- value extraction ----------------------------------------------------------------------------


def test_value_of_exact_family_skips_names_sharing_a_prefix() -> None:
    assert Selector.parse("vllm:num_requests_waiting").value(VLLM_PAGE) == 3.0
    assert Selector.parse("vllm:num_requests_running").value(VLLM_PAGE) == 7.0
    assert Selector.parse("vllm:time_to_first_token_seconds").value(VLLM_PAGE) is None
    assert Selector.parse("vllm:time_to_first_token_seconds_count").value(VLLM_PAGE) == 2.0


def test_missing_family_and_unmatched_series_are_none() -> None:
    assert Selector.parse("sglang:num_queue_reqs").value(VLLM_PAGE) is None
    assert Selector.parse('vllm:num_requests_waiting{engine="1"}').value(VLLM_PAGE) is None
    assert Selector.parse("vllm:num_requests_waiting{engine=0}").value(VLLM_PAGE) == 3.0
    assert Selector.parse("x").value(b"") is None


def test_labels_with_escaped_quotes_backslashes_and_braces() -> None:
    body = (
        b'm{path="C:\\\\dir",quote="say \\"hi\\" }",nl="a\\nb"} 5 1700000000000\n'
        b'm{path="other",quote="plain",nl=""} 6\n'
    )
    sample = Selector.parse("m").select(body, with_labels=True)
    assert sample is not None
    assert sample.labels == {"path": "C:\\dir", "quote": 'say "hi" }', "nl": "a\nb"}
    assert sample.value == 5.0 and sample.timestamp_ms == 1700000000000
    # Without labels requested the value is found after the last "}" despite the "}" in a value.
    assert Selector.parse("m").value(body) == 5.0
    # A matcher on an escaped value matches the decoded value.
    assert Selector.parse('m{quote="say \\"hi\\" }"}').value(body) == 5.0
    assert Selector.parse("m{path=other}").value(body) == 6.0


def test_largest_timestamp_wins_else_first_in_exposition_order() -> None:
    with_ts = b'm{a="1"} 1 100\nm{a="2"} 2 300\nm{a="3"} 3 200\nm{a="4"} 4\n'
    assert Selector.parse("m").value(with_ts) == 2.0
    without_ts = b'm{a="1"} 1\nm{a="2"} 2\n'
    assert Selector.parse("m").value(without_ts) == 1.0
    negative = b"m 1 -5\nm 2 -1\n"
    assert Selector.parse("m").value(negative) == 2.0


def test_special_values_and_malformed_lines() -> None:
    body = b'm{a="x"} not-a-number\nm{a="y"} +Inf\n'
    assert Selector.parse("m").value(body) == math.inf  # the malformed first line is skipped
    assert math.isnan(Selector.parse("n").value(b"n NaN\n") or 0.0)
    unterminated = b'm{a="unterminated} 1\n'
    assert Selector.parse("m").select(unterminated, with_labels=True) is None
    assert Selector.parse("m{a=x}").value(unterminated) is None


def test_family_at_offset_zero_without_trailing_newline_and_crlf() -> None:
    assert Selector.parse("m").value(b"m 4") == 4.0
    assert Selector.parse("m").value(b'm_total 1\r\nm{a="b"} 9 12\r\nz 1\r\n') == 9.0
    assert Selector.parse("m{a=b}").value(b'm{a="b"} 9\r\n') == 9.0


def test_series_choice_is_stable_when_the_family_moves_within_the_page() -> None:
    # The selector learns to search from the end when its family sits late in the page; the block's
    # first series must still win, wherever the family is found next time.
    filler = b"".join(b"filler_%d 1\n" % i for i in range(200))
    late = filler + b'm{r="a"} 1\nm{r="b"} 2\nm{r="c"} 3\n'
    early = b'm{r="x"} 10\nm{r="y"} 20\n' + filler
    selector = Selector.parse("m")
    for body, expected in ((late, 1.0), (late, 1.0), (early, 10.0), (late, 1.0), (early, 10.0)):
        assert selector.value(body) == expected
    # Prefix-sharing families around the real one are skipped in both search directions.
    tricky = filler + b"m_total 4\nm 5\nm_created 6\n" + filler
    for body, expected in ((late, 1.0), (tricky, 5.0), (early, 10.0), (tricky, 5.0)):
        assert selector.value(body) == expected


def test_info_labels_and_lora_info() -> None:
    labels = info_labels(VLLM_PAGE, Selector.parse("vllm:cache_config_info"))
    assert labels is not None
    assert (labels["block_size"], labels["num_gpu_blocks"]) == ("16", "31250")
    assert info_labels(VLLM_PAGE, Selector.parse("sglang:cache_config_info")) is None

    lora = lora_info(VLLM_PAGE, Selector.parse("vllm:lora_requests_info"))
    assert lora is not None
    assert lora.max_lora == 4  # the series with the largest value, not the first or the last
    assert lora.running == ("a1", "a2")
    assert lora.waiting == ("a3",)
    assert lora_info(b"", Selector.parse("vllm:lora_requests_info")) is None

    bad = b'vllm:lora_requests_info{max_lora="many",running_lora_adapters="a"} 1\n'
    bad_info = lora_info(bad, Selector.parse("vllm:lora_requests_info"))
    assert bad_info is not None and bad_info.max_lora is None and bad_info.running == ("a",)


def test_cached_label_decoding_follows_changed_lines() -> None:
    selector = Selector.parse("vllm:lora_requests_info")
    first = b'vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters=""} 1\n'
    second = b'vllm:lora_requests_info{max_lora="1",running_lora_adapters="b",waiting_lora_adapters=""} 2\n'
    for _ in range(2):
        info = lora_info(first, selector)
        assert info is not None and info.running == ("a",)
        info = lora_info(second, selector)
        assert info is not None and info.running == ("b",)


def test_split_csv() -> None:
    assert split_csv(" a, b ,,c ,") == ("a", "b", "c")
    assert split_csv("") == ()


# --- core-metrics-extractor ----------------------------------------------------------------------


def test_vllm_mapping_extracts_every_field() -> None:
    result = _extractor().extract(_endpoint(), VLLM_PAGE)
    assert result.errors == ()
    m = result.metrics
    assert m is not None
    assert (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage_percent) == (3, 7, 0.25)
    assert dict(m.active_models) == {"a1": 0, "a2": 0}
    assert dict(m.waiting_models) == {"a3": 0}
    assert (m.max_active_models, m.cache_block_size, m.cache_num_blocks) == (4, 16, 31250)
    assert m.update_time > 0


def test_missing_metric_keeps_that_field_only() -> None:
    previous = Metrics(
        waiting_queue_size=11, running_requests_size=12, kv_cache_usage_percent=0.9, update_time=1.0
    )
    page = b'vllm:num_requests_running 5\nvllm:cache_config_info{block_size="32",num_gpu_blocks="100"} 1\n'

    result = _extractor().extract(_endpoint(metrics=previous), page)
    m = result.metrics
    assert m is not None
    assert m.waiting_queue_size == 11 and m.kv_cache_usage_percent == 0.9  # kept
    assert m.running_requests_size == 5 and (m.cache_block_size, m.cache_num_blocks) == (32, 100)
    assert m.update_time > 1.0
    assert any("vllm:num_requests_waiting" in e for e in result.errors)
    assert any("vllm:kv_cache_usage_perc" in e for e in result.errors)
    assert not any("lora" in e for e in result.errors)  # an absent LoRA family is not an error


def test_nothing_extracted_returns_no_snapshot() -> None:
    result = _extractor().extract(_endpoint(), b"unrelated 1\n")
    assert result.metrics is None
    assert len(result.errors) == 4  # queue, running, kv, cache info


def test_integers_are_truncated_and_non_finite_values_are_errors() -> None:
    page = b"vllm:num_requests_waiting 2.9\nvllm:num_requests_running NaN\nvllm:kv_cache_usage_perc 0.5\n"
    previous = Metrics(running_requests_size=4)
    result = _extractor().extract(_endpoint(metrics=previous), page)
    assert result.metrics is not None
    assert result.metrics.waiting_queue_size == 2
    assert result.metrics.running_requests_size == 4
    assert any("non-finite" in e for e in result.errors)


def test_cache_info_with_bad_label_resets_block_size() -> None:
    previous = Metrics(cache_block_size=16, cache_num_blocks=10)
    page = b'vllm:cache_config_info{block_size="sixteen",num_gpu_blocks="20"} 1\n'
    result = _extractor().extract(_endpoint(metrics=previous), page)
    assert result.metrics is not None
    assert (result.metrics.cache_block_size, result.metrics.cache_num_blocks) == (0, 20)
    assert any("block_size" in e for e in result.errors)


SGLANG_PAGE = b"""\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 4.0
sglang:num_running_reqs{model_name="m"} 9.0
sglang:token_usage{model_name="m"} 0.5
sglang:cache_config_info{page_size="64",num_pages="1000"} 1.0
"""

TRTLLM_PAGE = b"""\
trtllm_num_requests_waiting 2
trtllm_num_requests_running 6
trtllm_kv_cache_utilization 0.75
trtllm_kv_cache_tokens_per_block 32
trtllm_kv_cache_max_blocks 4096
"""

TRITON_PAGE = b"""\
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="ensemble",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="ensemble",request_type="scheduled",version="1"} 8
nv_trt_llm_request_metrics{model="ensemble",request_type="waiting",version="1"} 5
nv_trt_llm_request_metrics{model="ensemble",request_type="active",version="1"} 13
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="ensemble",version="1"} 2048
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="ensemble",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="ensemble",version="1"} 0.125
"""


@pytest.mark.parametrize(
    ("engine", "page", "expected"),
    [
        ("sglang", SGLANG_PAGE, (4, 9, 0.5, 64, 1000)),
        ("trtllm-serve", TRTLLM_PAGE, (2, 6, 0.75, 32, 4096)),
        ("triton-tensorrt-llm", TRITON_PAGE, (5, 8, 0.125, 64, 2048)),
    ],
)
def test_builtin_engine_mappings(engine: str, page: bytes, expected: tuple[float, ...]) -> None:
    result = _extractor().extract(_endpoint({"llm-d.ai/engine-type": engine}), page)
    assert result.errors == ()
    m = result.metrics
    assert m is not None
    got = (m.waiting_queue_size, m.running_requests_size, m.kv_cache_usage_percent)
    assert (*got, m.cache_block_size, m.cache_num_blocks) == expected


def test_engine_selection_label_fallback_default_and_unknown() -> None:
    ex = _extractor()
    assert ex.mapping_for({"llm-d.ai/engine-type": "sglang"}).name == "sglang"
    assert ex.mapping_for({"inference.networking.k8s.io/engine-type": "trtllm-serve"}).name == "trtllm-serve"
    both = {"llm-d.ai/engine-type": "sglang", "inference.networking.k8s.io/engine-type": "trtllm-serve"}
    assert ex.mapping_for(both).name == "sglang"
    assert ex.mapping_for({}).name == "vllm"
    assert ex.mapping_for({"llm-d.ai/engine-type": "mystery"}).name == "vllm"
    custom = _extractor(engineLabelKey="example.com/engine", defaultEngine="sglang")
    assert custom.mapping_for({"example.com/engine": "trtllm-serve"}).name == "trtllm-serve"
    assert custom.mapping_for({"llm-d.ai/engine-type": "vllm"}).name == "sglang"  # not the configured key
    assert custom.mapping_for({}).name == "sglang"


def test_engine_configs_override_inherit_disable_and_add() -> None:
    ex = _extractor(
        engineConfigs=[
            {"name": "vllm", "kvUsageSpec": "vllm:gpu_cache_usage_perc", "loraSpec": ""},
            {"name": "custom", "queuedRequestsSpec": "q{pool=a}", "runningRequestsSpec": "r"},
        ],
        defaultEngine="custom",
    )
    vllm = ex.mappings["vllm"]
    assert vllm.kv_usage is not None and vllm.kv_usage.name == "vllm:gpu_cache_usage_perc"
    assert vllm.queued is not None and vllm.queued.name == "vllm:num_requests_waiting"  # inherited
    assert vllm.lora is None  # "" disables
    page = b'q{pool="b"} 1\nq{pool="a"} 2\nr 3\n'
    result = ex.extract(_endpoint(), page)
    assert result.metrics is not None
    assert (result.metrics.waiting_queue_size, result.metrics.running_requests_size) == (2, 3)
    assert result.errors == ()  # the new engine's omitted metrics are disabled, not missing


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        ({"engineConfigs": [{"name": "default"}]}, "engineConfigs[0].name", "reserved"),
        ({"engineConfigs": [{"queuedRequestsSpec": "q"}]}, "engineConfigs[0].name", "needs a name"),
        (
            {"engineConfigs": [{"name": "x", "kvUsageSpec": "kv{a!=b}"}]},
            "engineConfigs[0].kvUsageSpec",
            "only '=' matchers",
        ),
        ({"engineConfigs": [{"name": "x"}, {"name": "x"}]}, "engineConfigs", "duplicate"),
        ({"defaultEngine": "nope"}, "defaultEngine", "unknown engine"),
        ({"engineLabel": "x"}, "engineLabel", "unknown parameter"),
    ],
)
def test_extractor_parameter_errors(raw: dict[str, object], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        _extractor(**raw)
    assert info.value.field == f"plugins[0].parameters.{field}"
    assert reason in info.value.reason
