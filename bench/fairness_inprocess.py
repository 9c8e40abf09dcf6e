"""Fair under a flood, in process: the flow controller alone, without Envoy, engines or a load generator.

The same arrival and service model as ``bench/overload.py`` (Poisson arrivals of a steady tenant at
``--steady`` and a flooding one at ``--flood`` times the fleet's capacity; each request holds an
engine slot for ``--ttft-ms`` plus 0 .. 30 inter-token latencies), run against the real
``FlowController`` with a concurrency gate of ``--slots`` requests and a ``defaultRequestTTL`` of
``--ttl`` seconds, once per fairness policy. It isolates the dispatch policy from the machine's load:
per policy, the steady tenant's wait in the queue (p50, p90, p99), its time to first token as the
wait plus the engine's TTFT (and that over the TTFT alone, the figure ``overload.py`` checks), and
how many flood requests were served or expired. Real time (asyncio), about ``--duration`` seconds
per policy. Results: docs/benchmarks.md, "Fair under a flood".
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epp.flowcontrol import BandSettings, FlowController, FlowControlSettings
from epp.framework import Endpoint, FairnessPolicy, InferenceError, LLMRequest, SaturationDetector
from epp.plugins.flow_control.fair_share import FairShareFairnessPolicy, FairShareParams
from epp.plugins.flow_control.fcfs import FcfsOrderingPolicy
from epp.plugins.flow_control.global_strict import GlobalStrictFairnessPolicy
from epp.plugins.flow_control.round_robin import RoundRobinFairnessPolicy
from tests.unit import factories


class _Slots(SaturationDetector):
    """Saturation = requests in flight (routed or pending) over the fleet's slots."""

    type_name = "bench-slots"

    def __init__(self, slots: int) -> None:
        super().__init__("slots", None)
        self.slots = slots
        self.inflight = 0

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        return self.inflight / self.slots

    def dispatch_saturation(self, endpoints: Sequence[Endpoint], pending: int) -> float:
        return (self.inflight + pending) / self.slots


def _policy(name: str) -> FairnessPolicy:
    if name == "global-strict":
        return GlobalStrictFairnessPolicy("p", None)
    if name == "round-robin":
        return RoundRobinFairnessPolicy("p", None)
    if name.startswith("fair-share"):
        reserve = float(name.partition(":")[2] or 1.0)
        return FairShareFairnessPolicy("p", FairShareParams(reserve=reserve))
    raise SystemExit(f"unknown policy {name!r}: global-strict, round-robin, fair-share[:reserve]")


@dataclass
class _Result:
    policy: str
    steady_waits: list[float] = field(default_factory=list)
    steady_rejected: int = 0
    flood_served: int = 0
    flood_rejected: int = 0


def _request(rid: str, flow: str) -> LLMRequest:
    r = factories.request(request_id=rid)
    r.fairness_id = flow
    r.priority = 0
    return r


async def _run(policy: str, args: argparse.Namespace) -> _Result:
    rng = random.Random(args.seed)
    detector = _Slots(args.slots)
    fifo = FcfsOrderingPolicy("fifo", None)
    settings = FlowControlSettings(
        default_band=BandSettings(0, 0, _policy(policy), fifo), request_ttl=args.ttl
    )
    pool = factories.endpoints(2)
    fc = FlowController(settings, detector, lambda: pool)
    service = args.ttft_ms / 1000.0
    capacity = args.slots / (service + 15 * args.itl_ms / 1000.0)
    out = _Result(policy)

    async def one(i: int, flow: str) -> None:
        t0 = time.monotonic()
        try:
            permit = await fc.admit(_request(f"{flow}-{i}", flow), t0)
        except InferenceError:
            if flow == "steady":
                out.steady_rejected += 1
            else:
                out.flood_rejected += 1
            return
        if flow == "steady":
            out.steady_waits.append(time.monotonic() - t0)
        else:
            out.flood_served += 1
        permit.release()
        detector.inflight += 1
        await asyncio.sleep(service + rng.randint(0, 30) * args.itl_ms / 1000.0)
        detector.inflight -= 1
        permit.done()

    async def arrivals(flow: str, rate: float) -> None:
        tasks = []
        start = time.monotonic()
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(rate)
            if t >= args.duration:
                break
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(i, flow)))
            i += 1
        await asyncio.gather(*tasks)

    await asyncio.gather(arrivals("steady", args.steady * capacity), arrivals("flood", args.flood * capacity))
    fc.close()
    return out


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))] if ordered else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--policies", nargs="+", default=["round-robin", "fair-share", "fair-share:0.5", "fair-share:0"])
    add("--duration", type=float, default=15.0, help="seconds of arrivals per policy (default 15)")
    add("--slots", type=int, default=16, help="the fleet's slots: the concurrency gate (default 16)")
    add("--ttft-ms", type=float, default=200.0)
    add("--itl-ms", type=float, default=40.0)
    add("--steady", type=float, default=0.3, help="steady rate, fraction of capacity (default 0.3)")
    add("--flood", type=float, default=3.0, help="flood rate, fraction of capacity (default 3.0)")
    add("--ttl", type=float, default=10.0, help="defaultRequestTTL in seconds (default 10)")
    add("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    ttft = args.ttft_ms
    print(
        f"{args.slots} slots, TTFT {ttft:g} ms + 0..30 x {args.itl_ms:g} ms; steady {args.steady:g} and "
        f"flood {args.flood:g} x capacity for {args.duration:g} s, TTL {args.ttl:g} s, seed {args.seed}"
    )
    print(
        f"{'policy':<16} {'wait p50':>8} {'p90':>6} {'p99':>6} {'TTFT p90':>9} {'x alone':>7} "
        f"{'steady':>7} {'flood served':>12} {'expired':>7}"
    )
    for policy in args.policies:
        r = asyncio.run(_run(policy, args))
        waits = [w * 1000 for w in r.steady_waits]
        p90 = _pct(waits, 90)
        print(
            f"{policy:<16} {_pct(waits, 50):>8.0f} {p90:>6.0f} {_pct(waits, 99):>6.0f} {p90 + ttft:>9.0f} "
            f"{(p90 + ttft) / ttft:>7.2f} {len(waits):>7} {r.flood_served:>12} {r.flood_rejected:>7}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
