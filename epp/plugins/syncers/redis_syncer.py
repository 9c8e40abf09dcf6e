"""``redis-syncer`` (alias ``redis-state-store``): EPP replicas share routing state through Redis.

Per pool, under ``<keyPrefix>:<pool>:``, every replica keeps:

- ``v:<replica id>``: a hash of its values, field ``<state key>|<endpoint key>`` → JSON, plus
  ``$alive`` (its publish time), expiring after ``stateTTL``: a replica that dies stops counting
  within ``stateTTL``;
- ``replicas``: a sorted set of replica ids by last publish time (the peer store), members older than
  ``coordinationTTL`` pruned;
- ``log:<state key>``: a stream of record batches (``r`` replica, ``t`` time, ``d`` JSON list), capped
  at ``maxLogBatches`` and expiring after ``coordinationTTL``.

One ``sync`` is one pipelined round trip: this replica's changed values, its new log batches, the
heartbeat, then the peers' hashes and the streams' new entries. Reads (``get``, ``peer_values``) are
served from the mirror that round trip refreshed.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from epp.framework import Handle, Plugin, register
from epp.framework.cross_replica import Fold
from epp.framework.durations import parse_go_duration
from epp.plugins.syncers import _metrics as m

log = structlog.get_logger("epp.cross_replica")

ALIVE = b"$alive"
SEPARATOR = "|"
MAX_PENDING_RECORDS = 100_000  # per state key, kept for the next round while the store is unreachable
XREAD_COUNT = 256  # stream entries read per state key and round


@dataclass(slots=True, frozen=True)
class RedisSyncerParams:
    """Parameters of ``redis-syncer`` (camelCase in YAML)."""

    address: str = "localhost:6379"  # host:port
    username: str = ""
    password_env: str = ""  # the name of an environment variable holding the password
    password_file: str = ""  # a file holding the password (a mounted Secret)
    db: int = 0
    tls: bool = False
    ca_cert_path: str = ""  # CA bundle verifying the server (tls); empty: the system's
    insecure_skip_verify: bool = False
    key_prefix: str = "llm-d-epp"
    state_ttl: str = field(default="2s", metadata={"key": "stateTTL"})
    coordination_ttl: str = field(default="180s", metadata={"key": "coordinationTTL"})
    max_log_batches: int = 2048

    def validate(self) -> str | None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            return f"address: must be host:port, got {self.address!r}"
        if self.password_env and self.password_file:
            return "passwordEnv: passwordEnv and passwordFile are exclusive"
        if self.password_file and not os.path.isfile(self.password_file):
            return f"passwordFile: no such file {self.password_file!r}"
        if self.ca_cert_path and not os.path.isfile(self.ca_cert_path):
            return f"caCertPath: no such file {self.ca_cert_path!r}"
        if self.db < 0:
            return f"db: must be >= 0, got {self.db}"
        if not self.key_prefix or SEPARATOR in self.key_prefix:
            return f"keyPrefix: must be non-empty without {SEPARATOR!r}, got {self.key_prefix!r}"
        for name, text in (("stateTTL", self.state_ttl), ("coordinationTTL", self.coordination_ttl)):
            seconds = parse_go_duration(text)
            if seconds is None or seconds < 0.001:
                return f'{name}: must be a positive duration such as "2s", got {text!r}'
        if self.state_ttl_seconds > self.coordination_ttl_seconds:
            return "stateTTL: must not exceed coordinationTTL"
        if self.max_log_batches < 1:
            return f"maxLogBatches: must be >= 1, got {self.max_log_batches}"
        return None

    @property
    def state_ttl_seconds(self) -> float:
        return parse_go_duration(self.state_ttl) or 2.0

    @property
    def coordination_ttl_seconds(self) -> float:
        return parse_go_duration(self.coordination_ttl) or 180.0


def _failure_reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError | RedisTimeoutError):
        return "timeout"
    if isinstance(e, RedisConnectionError | OSError):
        return "connection"
    return "error"


class RedisSyncer(Plugin):
    """The ``CrossReplicaSyncer`` over one Redis (or Valkey) server; see the module docstring."""

    type_name = "redis-syncer"
    Params = RedisSyncerParams
    params: RedisSyncerParams

    def __init__(
        self, name: str, params: RedisSyncerParams | None = None, handle: Handle | None = None
    ) -> None:
        params = params if params is not None else RedisSyncerParams()
        super().__init__(name, params, handle)
        self.replica_id = uuid.uuid4().hex[:16]
        self._state_ttl_ms = max(1, int(params.state_ttl_seconds * 1000))
        self._coord_ms = max(1, int(params.coordination_ttl_seconds * 1000))
        self._prefix = f"{params.key_prefix}:default:"
        self._timeout = 1.0
        self._client: aioredis.Redis | None = None
        # this replica's values, and what changed since the last successful round
        self._own: dict[tuple[str, str], Any] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._deleted: set[tuple[str, str]] = set()
        self._full = True  # rewrite the whole hash (first round, after a failure or a lost key)
        self._outbox: dict[str, list[Any]] = {}
        # the mirror: state key -> endpoint key -> the live peers' values
        self._mirror: dict[str, dict[str, list[Any]]] = {}
        self._inbox: dict[str, list[Any]] = {}
        self._cursors: dict[str, bytes] = {}  # state key -> last stream id read
        self._known: list[str] = []  # replica ids of the registry (without us)
        self._live: frozenset[str] = frozenset()
        self._last_ok = 0.0
        self._down = False

    # --- CrossReplicaSyncer: local side (never blocks) -------------------------------------------

    def bind(self, pool: str, publish_timeout: float) -> None:
        self._prefix = f"{self.params.key_prefix}:{pool}:"
        self._timeout = publish_timeout

    def skip(self, reason: str, n: int = 1) -> None:
        m.SKIPPED.labels(reason).inc(n)

    def set(self, key: str, endpoint: str, value: Any) -> None:
        k = (key, endpoint)
        if self._own.get(k, _MISSING) != value:
            self._own[k] = value
            self._dirty.add(k)
            self._deleted.discard(k)

    def delete(self, key: str, endpoint: str) -> None:
        k = (key, endpoint)
        if self._own.pop(k, _MISSING) is not _MISSING:
            self._dirty.discard(k)
            self._deleted.add(k)

    def get(self, key: str, endpoint: str, aggregate: Fold, *, include_self: bool = True) -> Any:
        values = list(self._mirror.get(key, {}).get(endpoint, ()))
        if include_self:
            own = self._own.get((key, endpoint), _MISSING)
            if own is not _MISSING:
                values.append(own)
        return aggregate(values) if values else None

    def peer_values(self, key: str) -> Mapping[str, Sequence[Any]]:
        return self._mirror.get(key, {})

    def append(self, key: str, records: list[Any]) -> None:
        box = self._outbox.setdefault(key, [])
        box.extend(records)
        self._inbox.setdefault(key, [])  # reading a log starts with appending to it (or subscribe)
        if len(box) > MAX_PENDING_RECORDS:
            drop = len(box) - MAX_PENDING_RECORDS
            del box[:drop]
            m.DROPPED.inc(drop)

    def subscribe(self, key: str) -> None:
        """Read the log ``key`` from the next round on (its kept records first)."""
        self._inbox.setdefault(key, [])

    def take_records(self, key: str) -> list[Any]:
        records = self._inbox.get(key)
        if not records:
            return []
        self._inbox[key] = []
        return records

    def peers(self) -> frozenset[str]:
        return self._live

    # --- the round trip -------------------------------------------------------------------------

    def _connect(self) -> aioredis.Redis:
        p = self.params
        host, _, port = p.address.rpartition(":")
        password: str | None = None
        if p.password_env:
            password = os.environ.get(p.password_env) or None
        elif p.password_file:
            with open(p.password_file, encoding="utf-8") as f:
                password = f.read().strip() or None
        kwargs: dict[str, Any] = {}
        if p.tls:
            kwargs["ssl"] = True
            kwargs["ssl_ca_certs"] = p.ca_cert_path or None
            kwargs["ssl_cert_reqs"] = ssl.CERT_NONE if p.insecure_skip_verify else ssl.CERT_REQUIRED
            kwargs["ssl_check_hostname"] = not p.insecure_skip_verify
        return aioredis.Redis(
            host=host.strip("[]"),
            port=int(port),
            db=p.db,
            username=p.username or None,
            password=password,
            socket_timeout=self._timeout,
            socket_connect_timeout=self._timeout,
            health_check_interval=0,
            **kwargs,
        )

    async def sync(self) -> None:
        start = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout):
                await self._round()
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)
            raise
        m.SYNC_DURATION.observe(time.monotonic() - start)
        m.SYNCS.inc()
        m.CONNECTED.set(1)
        self._last_ok = time.monotonic()
        if self._down:
            self._down = False
            log.info("cross-replica store reachable again", syncer=self.name, peers=len(self._live))

    async def _round(self) -> None:
        if self._client is None:
            self._client = self._connect()
        now = time.time()
        now_ms = int(now * 1000)
        prefix = self._prefix
        vkey = f"{prefix}v:{self.replica_id}"
        rkey = f"{prefix}replicas"
        full = self._full
        changed = self._own.keys() if full else self._dirty
        fields: dict[str, bytes] = {ALIVE.decode(): str(now).encode()}
        for k in changed:
            fields[f"{k[0]}{SEPARATOR}{k[1]}"] = orjson.dumps(self._own[k])
        deleted = [] if full else [f"{k[0]}{SEPARATOR}{k[1]}" for k in self._deleted]
        outbox, self._outbox = self._outbox, {}
        known = self._known
        logs = list(self._inbox)

        pipe = self._client.pipeline(transaction=False)
        pipe.pexpire(vkey, self._state_ttl_ms)  # 0: our hash was lost (Redis restarted, or we were away)
        if full:
            pipe.delete(vkey)
        pipe.hset(vkey, mapping=fields)  # type: ignore[arg-type]
        if deleted:
            pipe.hdel(vkey, *deleted)
        pipe.pexpire(vkey, self._state_ttl_ms)
        pipe.zadd(rkey, {self.replica_id: now_ms})
        pipe.zremrangebyscore(rkey, "-inf", now_ms - self._coord_ms)
        pipe.pexpire(rkey, self._coord_ms)
        for key, records in outbox.items():
            if records:
                lkey = f"{prefix}log:{key}"
                entry = {"r": self.replica_id, "t": str(now), "d": orjson.dumps(records)}
                pipe.xadd(lkey, entry, maxlen=self.params.max_log_batches, approximate=True)  # type: ignore[arg-type]
                pipe.pexpire(lkey, self._coord_ms)
        pipe.zrange(rkey, 0, -1)
        for peer in known:
            pipe.hgetall(f"{prefix}v:{peer}")
        if logs:
            pipe.xread({f"{prefix}log:{k}": self._cursors.get(k, b"0-0") for k in logs}, count=XREAD_COUNT)
        try:
            results = await pipe.execute(raise_on_error=False)
        except BaseException:
            self._requeue(outbox)
            raise
        for r in results:
            if isinstance(r, RedisConnectionError | RedisTimeoutError):
                self._requeue(outbox)
                raise r
        self._full = False
        self._dirty.clear()
        self._deleted.clear()
        if results[0] == 0 and not full:
            # Our hash had expired: the store restarted (data lost) or we were cut off longer than
            # stateTTL. Rewrite everything next round and re-read the logs from their start.
            self._full = True
            self._cursors.clear()
            log.info("cross-replica state was lost in the store; republishing", syncer=self.name)
        tail = results[len(results) - len(known) - (1 if logs else 0) - 1 :]
        members = tail[0]
        hashes = tail[1 : 1 + len(known)]
        me = self.replica_id.encode()
        registry = [b.decode() for b in members if b != me] if isinstance(members, list) else []
        joined = [p for p in registry if p not in known]
        if joined:  # new replicas: read their values now rather than a round later
            pipe = self._client.pipeline(transaction=False)
            for peer in joined:
                pipe.hgetall(f"{prefix}v:{peer}")
            hashes = [*hashes, *await pipe.execute(raise_on_error=False)]
            known = [*known, *joined]
        self._apply_peers(known, hashes)
        if logs:
            self._apply_logs(tail[-1], now)
        self._known = registry

    def _requeue(self, outbox: dict[str, list[Any]]) -> None:
        """A failed round: its records go out with the next one, its values are rewritten whole."""
        self._full = True
        for key, records in outbox.items():
            if records:
                box = outbox[key] + self._outbox.get(key, [])
                if len(box) > MAX_PENDING_RECORDS:
                    m.DROPPED.inc(len(box) - MAX_PENDING_RECORDS)
                    box = box[-MAX_PENDING_RECORDS:]
                self._outbox[key] = box

    def _apply_peers(self, known: list[str], hashes: list[Any]) -> None:
        mirror: dict[str, dict[str, list[Any]]] = {}
        live: list[str] = []
        for peer, h in zip(known, hashes, strict=True):
            if isinstance(h, Exception):
                self.skip("wrong_type")  # a foreign key under our name: not ours to trust
                continue
            if not isinstance(h, dict) or ALIVE not in h:
                continue  # expired (dead) or foreign without a heartbeat
            live.append(peer)
            for name, raw in h.items():
                if name == ALIVE:
                    continue
                try:
                    key, sep, endpoint = name.decode().rpartition(SEPARATOR)
                    if not sep or not key or not endpoint:
                        raise ValueError(name)
                    value = orjson.loads(raw)
                except (ValueError, UnicodeDecodeError, orjson.JSONDecodeError):
                    self.skip("undecodable")
                    continue
                mirror.setdefault(key, {}).setdefault(endpoint, []).append(value)
        self._mirror = mirror
        self._live = frozenset(live)
        m.PEERS.set(len(live))

    def _apply_logs(self, streams: Any, now: float) -> None:
        if isinstance(streams, Exception):
            self.skip("wrong_type")
            return
        plen = len(self._prefix) + len("log:")
        for stream, entries in streams or ():
            key = (stream.decode() if isinstance(stream, bytes) else str(stream))[plen:]
            inbox = self._inbox.get(key)
            if inbox is None:
                continue
            for entry_id, fields in entries:
                self._cursors[key] = entry_id
                if fields.get(b"r") == self.replica_id.encode():
                    continue
                try:
                    records = orjson.loads(fields[b"d"])
                    sent = float(fields[b"t"])
                    if not isinstance(records, list):
                        raise ValueError("not a list")
                except (KeyError, ValueError, orjson.JSONDecodeError):
                    self.skip("undecodable")
                    continue
                inbox.extend(records)
                m.SYNC_LAG.observe(max(0.0, now - sent))

    def _failed(self, e: BaseException) -> None:
        reason = _failure_reason(e)
        m.FAILURES.labels(reason).inc()
        m.CONNECTED.set(0)
        if not self._down:
            self._down = True
            log.warning(
                "cross-replica store unreachable: routing goes on with local state",
                syncer=self.name,
                address=self.params.address,
                reason=reason,
                error=repr(e),
            )
        if self._live and time.monotonic() - self._last_ok > self._state_ttl_ms / 1000:
            # The peers' values are older than stateTTL: they may be dead. Forget them.
            self._mirror = {}
            self._live = frozenset()
            m.PEERS.set(0)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except (RedisError, OSError):
                pass


register(RedisSyncer, "redis-state-store")
_MISSING: Any = object()
