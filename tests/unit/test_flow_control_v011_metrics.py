"""The flow-control metrics added after v0.10: per-band and global capacity utilization, the
``EvictedNoEndpoints`` outcome and the ``stage`` label of pool saturation, read from the gauges and
counters the controller sets while requests queue and leave."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from epp.flowcontrol import FlowController, FlowControlSettings
from epp.flowcontrol import metrics as fcm
from epp.framework import Endpoint
from tests.unit.factories import endpoint
from tests.unit.test_flow_controller import Detector, Rig, band, reason, request, settle

ROLE = "llm-d.ai/role"


async def test_capacity_utilization_per_band_and_global_follow_the_queue() -> None:
    settings = FlowControlSettings(
        default_band=band(max_requests=4, max_bytes=100), max_requests=8, max_bytes=400
    )
    rig = Rig(settings, Detector(value=1.0))  # saturated: everything queues
    rig.fc.pool_name = "cap-pool"
    tasks = [rig.start(request(f"r{i}", size=10)) for i in range(3)]
    await settle()
    assert rig.fc.queued == 3
    assert fcm.CAPACITY_REQUESTS.labels("0", "cap-pool").value == 3 / 4
    assert fcm.CAPACITY_BYTES.labels("0", "cap-pool").value == rig.fc.queued_bytes / 100
    assert fcm.GLOBAL_CAPACITY_REQUESTS.labels("cap-pool").value == 3 / 8
    assert fcm.GLOBAL_CAPACITY_BYTES.labels("cap-pool").value == rig.fc.queued_bytes / 400
    assert rig.fc.queued_bytes > 0
    rig.detector.value = 0.0  # the queue drains: the fractions fall back to zero
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert fcm.CAPACITY_REQUESTS.labels("0", "cap-pool").value == 0.0
    assert fcm.GLOBAL_CAPACITY_BYTES.labels("cap-pool").value == 0.0
    rig.fc.close()


async def test_a_request_timed_out_with_no_endpoints_is_counted_evicted_no_endpoints() -> None:
    settings = FlowControlSettings(default_band=band(), request_ttl=0.03, no_endpoint_ttl=0.03)
    rig = Rig(settings, Detector(value=1.0))
    rig.fc.pool_name = "empty-pool"
    no_endpoints = fcm.REQUESTS_TOTAL.labels("EvictedNoEndpoints", "0", "empty-pool")
    ttl = fcm.REQUESTS_TOTAL.labels("EvictedTTL", "0", "empty-pool")
    before_ne, before_ttl = no_endpoints.value, ttl.value
    rig.pool.clear()
    await rig.start(request("r"))
    assert reason(rig.errors["r"]) == "rejected-no-endpoints"
    assert no_endpoints.value == before_ne + 1
    assert ttl.value == before_ttl  # not counted as a plain TTL expiry
    rig.fc.close()


class _ByRole(Detector):
    """Saturation by the roles of the endpoints asked about: prefill 0.3, decode 0.8."""

    def dispatch_saturation(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        roles = {e.metadata.labels.get(ROLE) for e in endpoints}
        return 0.8 if "decode" in roles else 0.3


async def test_pool_saturation_is_reported_per_stage_and_effective_is_the_busier() -> None:
    rig = Rig(detector=_ByRole())
    rig.fc = FlowController(
        FlowControlSettings(default_band=band()), rig.detector, lambda: rig.pool, pool_name="stage-pool"
    )
    rig.pool[:] = [
        endpoint("p", "10.0.0.1", labels={ROLE: "prefill"}),
        endpoint("d", "10.0.0.2", labels={ROLE: "decode"}),
    ]
    (await rig.fc.admit(request("r"), 0.0)).release()
    assert fcm.POOL_SATURATION.labels("stage-pool", "prefill").value == 0.3
    assert fcm.POOL_SATURATION.labels("stage-pool", "decode").value == 0.8
    assert fcm.POOL_SATURATION.labels("stage-pool", "effective").value == 0.8
    rig.fc.close()


async def test_a_reload_changes_band_caps_and_keeps_what_is_queued() -> None:
    """``reconfigure`` (a config reload of the flowControl section): the new cap applies to the next
    request, the queued one stays and is dispatched when the pool frees."""
    rig = Rig(FlowControlSettings(default_band=band(max_requests=1)), Detector(value=1.0))
    first = rig.start(request("queued"))
    await settle()
    assert rig.fc.queued == 1
    await rig.start(request("over-cap"))
    assert reason(rig.errors["over-cap"]) == "rejected-saturated"  # the band holds one
    rig.fc.reconfigure(FlowControlSettings(default_band=band(max_requests=3)))
    second = rig.start(request("fits-now"))
    await settle()
    assert rig.fc.queued == 2 and "fits-now" not in rig.errors
    assert fcm.CAPACITY_REQUESTS.labels("0", "pool").value == 2 / 3  # measured against the new cap
    rig.detector.value = 0.0
    await asyncio.wait_for(asyncio.gather(first, second), 1)
    assert rig.order == ["queued", "fits-now"]
    rig.fc.close()
