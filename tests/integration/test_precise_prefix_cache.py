"""``precise-prefix-cache-producer`` in a real ``epp serve``: ingestion starts with serving, and the
KV-event subscriptions follow file discovery (a test publisher stands in for the engines)."""

from __future__ import annotations

import re
import time

from tests.integration.harness import Rig
from tests.unit.kv_publisher import Publisher, batch, free_port, stored


def _value(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _poll(fn, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while True:
        try:
            if fn():
                return
        except AssertionError:
            pass
        if time.monotonic() > end:
            raise AssertionError("condition not met")
        time.sleep(0.1)


def test_subscriptions_follow_discovery_in_epp_serve(rig: Rig) -> None:
    port = free_port()
    sims = rig.start_sims(2)
    config = {
        "plugins": [
            {
                "name": "pp",
                "type": "precise-prefix-cache-producer",
                "parameters": {
                    "kvEventsConfig": {"podDiscoveryConfig": {"socketPort": port}},
                    "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
                },
            },
            {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": "pp"}},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "prefix-cache-scorer"}]}],
    }
    epp = rig.start_epp(sims, config=config)
    pub = Publisher(port)  # both sims listen on 127.0.0.1: both subscribers connect here
    try:
        pub.wait_subscribed(timeout=30)
        received = "llm_d_epp_kv_cache_events_messages_received_total"
        keys = [f"default/{s.name}" for s in sims]

        def both_received() -> bool:
            pub.send(batch([stored([1, 2], list(range(32)), bs=16)]))
            text = epp.metrics()
            return all((_value(text, received, f'{{pod_identifier="{k}"}}') or 0) >= 1 for k in keys)

        _poll(both_received)
        text = epp.metrics()
        assert _value(text, "llm_d_epp_kv_cache_events_active_subscribers") == 2
        assert (_value(text, "llm_d_epp_kv_cache_index_keys") or 0) >= 2
        assert _value(text, "kvcache_index_admissions_total") == _value(
            text, "llm_d_epp_kv_cache_index_admissions_total"
        )
        epp.set_endpoints(sims[:1])  # one endpoint leaves the pool

        def one_left() -> bool:
            text = epp.metrics()
            return (
                _value(text, "llm_d_epp_kv_cache_events_active_subscribers") == 1
                and f'pod_identifier="{keys[1]}"' not in text
            )

        _poll(one_left)
    finally:
        pub.close()
    epp.stop()
