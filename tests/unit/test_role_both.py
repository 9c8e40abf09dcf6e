"""The removed role label value ``both``: read as ``prefill-decode`` with one warning per endpoint,
kept by no role filter when the configuration is loaded for router v0.11."""

from __future__ import annotations

from structlog.testing import capture_logs

from epp.config import load_config
from epp.datalayer.store import EndpointStore
from epp.dev.sim.engine import ROLES, SimConfig
from epp.framework import CycleState
from tests.unit.factories import endpoint, metadata, request

ROLE = "llm-d.ai/role"
CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: decode-filter}
- {type: prefill-filter}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]
"""
POOL = [
    endpoint("both", labels={ROLE: "both"}),
    endpoint("pd", labels={ROLE: "prefill-decode"}),
    endpoint("decode", labels={ROLE: "decode"}),
    endpoint("prefill", labels={ROLE: "prefill"}),
]


def _kept(compat_version: str, filter_name: str) -> list[str]:
    cfg = load_config(CONFIG, compat_version=compat_version)
    f = cfg.plugins[filter_name]
    return [e.metadata.name for e in f.filter(CycleState(), request(), list(POOL))]


def test_both_is_prefill_decode_by_default() -> None:
    assert _kept("", "decode-filter") == ["both", "pd", "decode"]
    assert _kept("", "prefill-filter") == ["both", "pd", "prefill"]


def test_v011_role_filters_keep_no_both_pod() -> None:
    assert _kept("v0.11", "decode-filter") == ["pd", "decode"]
    assert _kept("v0.11", "prefill-filter") == ["pd", "prefill"]
    # a later default load is not affected by the v0.11 one
    assert _kept("", "decode-filter") == ["both", "pd", "decode"]


def _warnings(logs: list[dict[str, object]]) -> list[object]:
    return [e.get("endpoint") for e in logs if e["log_level"] == "warning" and "both" in str(e["event"])]


def test_store_warns_once_per_endpoint_naming_prefill_decode() -> None:
    store = EndpointStore()
    a = metadata("a", "10.0.0.1", labels={ROLE: "both"})
    with capture_logs() as logs:
        store.upsert(a)
        store.upsert(a)  # unchanged: nothing
        store.upsert(metadata("a", "10.0.0.1", labels={ROLE: "both", "x": "1"}))  # relabelled, still both
        store.upsert(metadata("b", "10.0.0.2", labels={ROLE: "decode"}))
        store.upsert(metadata("b", "10.0.0.2", labels={ROLE: "both"}))  # relabelled to both
        store.upsert(metadata("c", "10.0.0.3", labels={ROLE: "prefill-decode"}))
    assert _warnings(logs) == ["default/a", "default/b"]
    assert "label the pod llm-d.ai/role: prefill-decode" in str(
        next(e["event"] for e in logs if e["log_level"] == "warning")
    )


def test_sim_defaults_to_prefill_decode_and_keeps_both() -> None:
    assert SimConfig().role == "prefill-decode"
    assert "both" in ROLES
