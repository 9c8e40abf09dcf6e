"""Kubernetes discovery cost: initial sync, watch events and a 410 relist, for large pools.

The fake API server (tests/fakekube) runs in a child process; only the EPP side's CPU is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epp import logs
from epp.datalayer.store import EndpointStore
from epp.k8s.client import api_client
from epp.k8s.pool_discovery import PoolDiscovery
from tests.fakekube import FakeKube, objects

NS = "bench"


def _pod(i: int) -> dict[str, Any]:
    """A Ready pod with the labels, annotations and conditions a real vLLM pod carries."""
    labels = {"app": "vllm", "llm-d.ai/role": "decode", "pod-template-hash": "5d8f9c7b6"}
    pod = objects.pod(NS, f"vllm-{i}", f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}", labels=labels)
    pod["metadata"]["annotations"] = {"kubectl.kubernetes.io/restartedAt": "2026-12-01T00:00:00Z"}
    pod["spec"]["containers"][0].update(image="vllm/vllm-openai:v0.11.0", args=["--model", "m"])
    pod["status"]["conditions"] += [
        {"type": t, "status": "True"} for t in ("Initialized", "ContainersReady", "PodScheduled")
    ]
    return pod


async def _until(predicate: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.001)


def _serve_fake(conn: Any) -> None:
    """Child process: a FakeKube whose methods the parent calls as ``(name, args)`` over ``conn``."""
    import logging

    for name in ("asyncio", "aiohttp.server", "aiohttp.web", "aiohttp.access"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # watches cut at shutdown are expected
    with FakeKube(bookmark_interval=60) as kube:
        while True:
            name, args = conn.recv()
            if name == "stop":
                return
            conn.send(getattr(kube, name)(*args))


class _RemoteKube:
    """The parent's handle on the child's FakeKube (synchronous calls, results pickled back)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_fake, args=(child,), daemon=True)
        self._proc.start()

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self._conn.send((name, args))
            return self._conn.recv()

        return call

    def __enter__(self) -> _RemoteKube:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.send(("stop", ()))
        self._proc.join(10)


def _cpu() -> float:
    return time.process_time()


async def run(pods: int, ranks: int, flips: int) -> dict[str, float]:
    with _RemoteKube() as kube, tempfile.TemporaryDirectory() as tmp:
        kube.create(objects.inference_pool(NS, [8000 + r for r in range(ranks)]))
        for i in range(pods):
            kube.create(_pod(i))
        api = await api_client(str(kube.write_kubeconfig(Path(tmp) / "kubeconfig")))
        store = EndpointStore()
        discovery = PoolDiscovery(api, NS, pool_name="pool")
        try:
            wall0, cpu0 = time.perf_counter(), _cpu()
            await discovery.start(store)
            await _until(lambda: discovery.ready)
            sync_wall, sync_cpu = time.perf_counter() - wall0, _cpu() - cpu0
            assert len(store) == pods * ranks, len(store)

            await _until(lambda: kube.open_watches("Pod") >= 1)
            # readiness flips: each event removes (or re-adds) all of a pod's ranks
            cpu0 = _cpu()
            for n in range(flips):
                kube.patch(
                    "v1",
                    "Pod",
                    NS,
                    f"vllm-{n % pods}",
                    {
                        "status": {
                            "conditions": [{"type": "Ready", "status": "False" if n < pods else "True"}]
                        }
                    },
                )
            expected = pods * ranks - min(flips, pods) * ranks
            await _until(lambda: len(store) == expected)
            event_cpu = (_cpu() - cpu0) / flips

            reflector = discovery.pod_reflector
            assert reflector is not None
            lists = reflector.lists
            cpu0, wall0 = _cpu(), time.perf_counter()
            # a change the pod watch never sees moves the version on; compacting then expires ours
            kube.create(_pod(0) | {"metadata": {"name": "elsewhere", "namespace": "other"}})
            kube.compact()
            kube.drop_watches()
            await _until(lambda: reflector.lists > lists)
            relist_wall, relist_cpu = time.perf_counter() - wall0, _cpu() - cpu0
        finally:
            await discovery.stop()
            await api.close()
    return {
        "sync_wall_ms": sync_wall * 1e3,
        "sync_cpu_ms": sync_cpu * 1e3,
        "sync_cpu_us_per_pod": sync_cpu / pods * 1e6,
        "event_cpu_us": event_cpu * 1e6,
        "relist_wall_ms": relist_wall * 1e3,
        "relist_cpu_ms": relist_cpu * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--ranks", type=int, default=1, help="target ports per pod (data-parallel ranks)")
    parser.add_argument("--flips", type=int, default=500)
    args = parser.parse_args()
    logs.configure("warning")
    print(
        f"Kubernetes discovery (fake API server in a child process, {args.ranks} rank(s) per pod), "
        "EPP-side CPU:"
    )
    print(
        f"{'pods':>6} {'sync wall':>10} {'sync CPU':>9} {'CPU/pod':>8} {'CPU/event':>10} {'relist CPU':>11}"
    )
    for pods in args.pods:
        r = asyncio.run(run(pods, args.ranks, min(args.flips, pods)))
        print(
            f"{pods:>6} {r['sync_wall_ms']:>8.0f}ms {r['sync_cpu_ms']:>7.0f}ms "
            f"{r['sync_cpu_us_per_pod']:>6.0f}µs {r['event_cpu_us']:>8.0f}µs {r['relist_cpu_ms']:>9.0f}ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
