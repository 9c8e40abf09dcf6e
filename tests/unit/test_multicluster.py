"""The multicluster plugin family (alpha): cluster discovery, pool-aggregate metrics, cluster scorers."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.framework import CycleState, registry
from epp.framework.endpoint_attributes import (
    MULTICLUSTER_KV_CACHE_UTILIZATION_KEY,
    MULTICLUSTER_QUEUE_SIZE_KEY,
)
from epp.framework.interfaces import Stability
from epp.plugins.discovery.file_discovery import parse_endpoints
from epp.plugins.scorers._metric_scorer import NEUTRAL
from epp.plugins.scorers.multicluster_kv_cache_utilization import MultiClusterKVCacheUtilizationScorer
from epp.plugins.scorers.multicluster_queue import MultiClusterQueueScorer
from epp.plugins.scraping.multicluster_metrics_extractor import (
    MultiClusterMetricsExtractor,
    MultiClusterMetricsExtractorParams,
)
from tests.unit.factories import completions, config, config_error, endpoints

HEAD = Path(__file__).resolve().parents[3] / "shared/reference/llm-d-configs/head"
CLUSTERS = b"""endpoints:
- {name: east, address: gw.east.example.com, port: "443",
   labels: {metricsAddress: epp.east.example.com, metricsPort: "9090"}}
- {name: west, address: "2001:db8::1", port: "443"}
- {name: bad, address: "Not_A_Host", port: "443"}
"""


def test_cluster_discovery_accepts_hostnames_and_a_metrics_address() -> None:
    result = parse_endpoints(CLUSTERS, "clusters.yaml", hostnames=True)
    east, west = result.endpoints["default/east"], result.endpoints["default/west"]
    assert east.metrics_host == "epp.east.example.com:9090"
    assert west.metrics_host == "[2001:db8::1]:443" and west.hostport == "[2001:db8::1]:443"
    assert result.invalid == ('endpoint "bad": invalid host "Not_A_Host"',)
    pods = parse_endpoints(CLUSTERS, "pods.yaml")  # file-discovery keeps IPv4 only
    assert not pods.endpoints and len(pods.invalid) == 3


def test_extractor_writes_the_pool_aggregates() -> None:
    ep = endpoints(1)[0]
    body = (
        b"# TYPE llm_d_epp_average_kv_cache_utilization gauge\nllm_d_epp_average_kv_cache_utilization 0.25\n"
    )
    body += b'llm_d_epp_average_queue_size{name="p"} 7\n'
    assert MultiClusterMetricsExtractor("x").extract_attributes(ep, body) == ()
    assert ep.attributes[MULTICLUSTER_KV_CACHE_UTILIZATION_KEY] == 0.25
    assert ep.attributes[MULTICLUSTER_QUEUE_SIZE_KEY] == 7.0
    custom = MultiClusterMetricsExtractor(
        "y", MultiClusterMetricsExtractorParams(queue_size_metric="q_total")
    )
    problems = custom.extract_attributes(ep, body)
    assert len(problems) == 1 and MULTICLUSTER_QUEUE_SIZE_KEY in problems[0]


def test_cluster_scorers_read_the_attributes_and_score_missing_ones_neutrally() -> None:
    eps = endpoints(3)
    for e, kv, q in zip(eps[:2], (0.2, 0.8), (1.0, 5.0), strict=True):
        e.attributes[MULTICLUSTER_KV_CACHE_UTILIZATION_KEY] = kv
        e.attributes[MULTICLUSTER_QUEUE_SIZE_KEY] = q
    req, cycle = completions(), CycleState()
    assert list(MultiClusterKVCacheUtilizationScorer("kv", None).score(cycle, req, eps)) == pytest.approx(
        [0.8, 0.2, 0.5]
    )
    assert list(MultiClusterQueueScorer("q", None).score(cycle, req, eps)) == [1.0, 0.0, 0.5]
    assert list(MultiClusterQueueScorer("q", None).score(cycle, req, endpoints(2))) == [NEUTRAL, NEUTRAL]


def test_the_family_is_alpha() -> None:
    for name in (
        "multicluster-file-discovery",
        "multicluster-metrics-data-source",
        "multicluster-metrics-extractor",
        "multicluster-session-affinity-filter",
        "multicluster-kv-cache-utilization-scorer",
        "multicluster-queue-scorer",
        "multicluster-prefix-cache-scorer",
        "multicluster-approx-prefix-cache-producer",
    ):
        cls = registry.lookup(name)
        assert cls is not None and cls.stability is Stability.ALPHA, name


def test_cluster_source_verifies_by_default_and_needs_its_ca_file(tmp_path: Path) -> None:
    body = (
        "plugins:\n- type: multicluster-metrics-data-source\n  parameters: {{caCertPath: {ca}}}\n"
        "- type: multicluster-metrics-extractor\n- type: max-score-picker\n- type: single-profile-handler\n"
        "dataLayer:\n  sources:\n  - pluginRef: multicluster-metrics-data-source\n    extractors:\n"
        "    - pluginRef: multicluster-metrics-extractor\n"
    )
    err = config_error(body.format(ca=tmp_path / "missing.crt"), allow_experimental=True)
    assert err.field.endswith("caCertPath") and "no such file" in err.reason


@pytest.mark.skipif(
    not HEAD.is_dir(), reason="../shared/reference/llm-d-configs is absent (data from outside)"
)
def test_the_reference_runner_config_loads() -> None:
    text = (HEAD / "cmd__epp__runner__multicluster_config_test.go.1.yaml").read_text()
    loaded = config(text.split("kind: EndpointPickerConfig\n", 1)[1], allow_experimental=True)
    assert loaded.discovery is not None and loaded.discovery.type_name == "multicluster-file-discovery"
    with pytest.raises(Exception, match=r"alpha|experimental"):
        config(text.split("kind: EndpointPickerConfig\n", 1)[1], allow_experimental=False)


SNAPSHOT = HEAD.parent / "snapshot"


@pytest.mark.skipif(
    not SNAPSHOT.is_dir(), reason="../shared/reference/llm-d-configs is absent (data from outside)"
)
def test_the_plugins_readme_config_loads_where_its_files_exist(tmp_path: Path) -> None:
    """The plugins README's multicluster sample (EXPECTED.yaml: refused here only because its CA file
    is not on this machine) loads once its discovery file and CA bundle exist."""
    from epp.server.tls import Authority

    text = (SNAPSHOT / "pkg__epp__framework__plugins__README.md.1.yaml").read_text()
    assert "/etc/epp/tls/ca.crt" in text and "/etc/epp/clusters.yaml" in text
    (tmp_path / "ca.crt").write_bytes(Authority.create().cert)
    (tmp_path / "clusters.yaml").write_bytes(CLUSTERS)
    text = text.replace("/etc/epp/tls/ca.crt", str(tmp_path / "ca.crt"))
    text = text.replace("/etc/epp/clusters.yaml", str(tmp_path / "clusters.yaml"))
    body = text.split("kind: EndpointPickerConfig\n", 1)[1]
    loaded = config(body, allow_experimental=True)
    assert loaded.discovery is not None and loaded.discovery.type_name == "multicluster-file-discovery"
    types = {p.type_name for p in loaded.plugins.values()}
    assert {
        "multicluster-session-affinity-filter",
        "multicluster-kv-cache-utilization-scorer",
        "multicluster-queue-scorer",
    } <= types
    with pytest.raises(Exception, match=r"alpha|experimental"):
        config(body, allow_experimental=False)
