"""Leader election on a ``coordination.k8s.io/v1`` Lease (``--ha-enable-leader-election``)."""

from __future__ import annotations

import asyncio
import datetime
import math
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import client

from epp.background import BackgroundTask
from epp.k8s.resources import ApiError, read_json

log = structlog.get_logger("epp.k8s.leader")

ADDRESS_ANNOTATION = "epp.llm-d.ai/replication-address"


def lease_name(namespace: str, pool: str) -> str:
    return f"epp-{namespace}-{pool}.gateway-api-inference-extension.sigs.k8s.io"


def new_identity(pod_name: str = "") -> str:
    return f"{pod_name or 'epp'}_{uuid.uuid4()}"


def _record(spec: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies one state of the Lease; a change of it restarts the expiry clock."""
    return (
        spec.get("holderIdentity") or "",
        spec.get("renewTime"),
        spec.get("leaseDurationSeconds"),
        spec.get("leaseTransitions"),
    )


def _micro_time(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """client-go's lease lock with its defaults (lease 15 s, renew deadline 10 s, retry period 2 s).

    Every replica keeps discovery and scraping warm; only readiness follows leadership.

    * Every ``retry_period`` (plus up to 20 % jitter when not leading) read the Lease, creating it if
      missing. Another holder's Lease is taken only once it has not changed for its duration as seen
      by this replica's monotonic clock (no trust in clock sync); an empty holder is taken at once.
    * Taking or renewing is a ``PUT`` with the read ``resourceVersion``, so of two concurrent writers
      one gets ``409 Conflict``.
    * A renewal counts from when its request was sent and every attempt is cut at the renew
      deadline, so a leader that could not renew steps down before a standby can take the Lease. It
      keeps running and competing (its state stays warm for the next term).
    * Only a replica that can serve (``can_lead``) competes; a leader that stops being able to serve
      releases the Lease, and so does ``stop()`` (graceful shutdown).
    * The leader writes its replication address (``--ha-advertise-address``) into the annotation
      ``epp.llm-d.ai/replication-address``; standbys read it as ``leader_address``.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_change: Callable[[bool], None] | None = None,
        advertise: str = "",
    ) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > retry period > 0, got "
                f"{lease_duration}s, {renew_deadline}s, {retry_period}s"
            )
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.on_change = on_change
        self.can_lead: Callable[[], bool] = lambda: True  # e.g. "the pool has synced"
        self.advertise = advertise
        self.leader_address: str | None = None  # another replica's, while it leads
        self.is_leader = False
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._last_renew = 0.0
        self._task = BackgroundTask("leader-election", self._run)
        self._rng = random.Random()
        self._coord: Any = client.CoordinationV1Api(api)  # raw responses: untyped by the stubs

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        if self.is_leader or self._holds_lease():
            await self._release()
        self._set_leader(False)

    def _holds_lease(self) -> bool:
        """The Lease, as last read or written, names this replica (even after a step-down)."""
        return self._observed is not None and self._observed[0] == self.identity

    # --- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        log.info("leader election started", lease=f"{self.namespace}/{self.name}", identity=self.identity)
        while True:
            if self.is_leader and time.monotonic() - self._last_renew >= self.renew_deadline:
                # e.g. the process was frozen: stop serving before anything else, then compete again
                log.warning("the lease was not renewed within the renew deadline; stepping down")
                self._set_leader(False)
            if not self.can_lead():
                # not ready to serve (pool not synced): never hold the lease while a ready standby waits
                if self.is_leader or self._holds_lease():
                    log.info("not ready to serve; giving up the lease")
                    await self._release()
                self._set_leader(False)
                await asyncio.sleep(self.retry_period)
                continue
            started = time.monotonic()
            try:
                ok = await self._try_acquire_or_renew()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # API server unreachable, 5xx, RBAC, deadline: retry
                log.warning("lease update failed", error=str(e) or type(e).__name__)
                ok = False
            now = time.monotonic()
            if ok:
                self._last_renew = started  # the renewal is as old as its request, not its answer
                self._set_leader(True)
            elif self.is_leader and now - self._last_renew >= self.renew_deadline:
                log.warning("could not renew the lease within the renew deadline; stepping down")
                self._set_leader(False)
            delay = self.retry_period if self.is_leader else self.retry_period * self._rng.uniform(1.0, 1.2)
            await asyncio.sleep(delay)

    def _set_leader(self, leader: bool) -> None:
        if leader == self.is_leader:
            return
        self.is_leader = leader
        log.info("leadership changed", leader=leader, identity=self.identity)
        if self.on_change is not None:
            self.on_change(leader)

    def _timeout(self) -> aiohttp.ClientTimeout:
        """Per request. A leader's requests never outlive its renew deadline (client-go bounds the
        renewal alike): a slow API server must not keep a stale leader serving past it."""
        total = min(self.renew_deadline - self.retry_period, 5.0)
        if self.is_leader:
            total = min(total, self._last_renew + self.renew_deadline - time.monotonic())
        return aiohttp.ClientTimeout(total=max(0.05, total))

    async def _read(self) -> dict[str, Any] | None:
        resp = await self._coord.read_namespaced_lease(
            self.name, self.namespace, _preload_content=False, _request_timeout=self._timeout()
        )
        try:
            return await read_json(resp)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def _try_acquire_or_renew(self) -> bool:
        now = datetime.datetime.now(datetime.UTC)
        lease = await self._read()
        if lease is None:
            self.leader_address = None
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": self._annotate({"name": self.name, "namespace": self.namespace}),
                "spec": self._spec(now, acquire_time=now, transitions=0),
            }
            return await self._write(
                self._coord.create_namespaced_lease(
                    self.namespace, body, _preload_content=False, _request_timeout=self._timeout()
                )
            )
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = _record(spec)
        mono = time.monotonic()
        if record != self._observed:
            self._observed, self._observed_at = record, mono
        if not holder:
            self.leader_address = None  # released: nobody leads until it is taken
        if holder and holder != self.identity:
            annotations = (lease.get("metadata") or {}).get("annotations") or {}
            address = annotations.get(ADDRESS_ANNOTATION) or None
            self.leader_address = address if address != self.advertise else None
            duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
            if mono < self._observed_at + duration:
                if self.is_leader:  # someone else holds it now: we lost it
                    self._set_leader(False)
                return False
        mine = holder == self.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        acquire = spec.get("acquireTime") if mine else None
        lease["spec"] = self._spec(now, acquire_time=acquire or now, transitions=transitions)
        lease["metadata"] = self._annotate(lease.get("metadata") or {})
        return await self._write(
            self._coord.replace_namespaced_lease(
                self.name, self.namespace, lease, _preload_content=False, _request_timeout=self._timeout()
            )
        )

    def _spec(self, now: datetime.datetime, *, acquire_time: Any, transitions: int) -> dict[str, Any]:
        acquire = _micro_time(acquire_time) if isinstance(acquire_time, datetime.datetime) else acquire_time
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, math.ceil(self.lease_duration)),
            "acquireTime": acquire,
            "renewTime": _micro_time(now),
            "leaseTransitions": transitions,
        }

    def _annotate(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """Our replication address on the Lease (or none: never leave a previous holder's there)."""
        annotations = dict(metadata.get("annotations") or {})
        if self.advertise:
            annotations[ADDRESS_ANNOTATION] = self.advertise
        else:
            annotations.pop(ADDRESS_ANNOTATION, None)
        metadata["annotations"] = annotations
        return metadata

    async def _write(self, request: Any) -> bool:
        """True when the create/replace succeeded; a 409 (lost race or stale version) is False."""
        try:
            lease = await read_json(await request)
        except ApiError as e:
            if e.status == 409:
                return False
            raise
        self.leader_address = None  # we hold it now
        self._observed = _record(lease.get("spec") or {})
        self._observed_at = time.monotonic()
        return True

    async def _release(self) -> None:
        try:
            lease = await self._read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            now = _micro_time(datetime.datetime.now(datetime.UTC))
            lease["spec"].update(
                {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": now, "acquireTime": now}
            )
            ((lease.get("metadata") or {}).get("annotations") or {}).pop(ADDRESS_ANNOTATION, None)
            await self._write(
                self._coord.replace_namespaced_lease(
                    self.name, self.namespace, lease, _preload_content=False, _request_timeout=self._timeout()
                )
            )
            log.info("lease released", identity=self.identity)
        except Exception as e:  # shutting down anyway: the lease expires on its own
            log.warning("could not release the lease", error=str(e) or type(e).__name__)
