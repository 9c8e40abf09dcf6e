"""``redis-syncer`` (alias ``redis-state-store``): EPP replicas share routing state through Redis.

Per pool, under ``<keyPrefix>:<pool>:``, every replica keeps:

- ``v:<replica id>``: a hash of its values, field ``<state key>|<endpoint key>`` → JSON, plus
  ``$alive`` (its publish time), expiring after ``stateTTL``: a replica that dies stops counting
  within ``stateTTL``;
- ``replicas``: a sorted set of replica ids by last publish time (the peer store), members older than
  ``coordinationTTL`` pruned (about once a second);
- ``log:<state key>``: a stream of record batches (``r`` replica, ``t`` time, ``d`` JSON list), capped
  at ``maxLogBatches`` and expiring after ``coordinationTTL``.

One ``sync`` is one command, a Lua script: this replica's changed values, its new log batches and
the heartbeat go in; the registry, the hashes of the peers whose digest (SHA-1 of the fields, the
heartbeat's time left out) changed since this replica last read them, and the streams' new
entries come back as one string of length-prefixed items. Only the fields whose bytes changed are
decoded again. Reads (``get``, ``peer_values``) are served from the mirror that round refreshed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from epp.framework import Handle, Plugin, register
from epp.framework.cross_replica import Fold
from epp.framework.durations import parse_go_duration
from epp.plugins.syncers import _metrics as m

if TYPE_CHECKING:
    from redis import asyncio as aioredis

    from epp.plugins.syncers import _redis_link

# redis-py is imported where it is used (the plugin at work), not with the plugin registry: its
# import is a quarter of every EPP's start-up, and most configs have no syncer.

log = structlog.get_logger("epp.cross_replica")

ALIVE = b"$alive"
SEPARATOR = "|"
MAX_PENDING_RECORDS = 100_000  # per state key, kept for the next round while the store is unreachable
XREAD_COUNT = 256  # stream entries read per state key and round
PRUNE_INTERVAL_SECONDS = 1.0  # how often a replica prunes the registry of members past coordinationTTL


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


# One round, run by Redis as one script (one command, one reply): the heartbeat and this replica's
# changed values, its new log batches, then the registry, each peer's hash unless its digest is the
# one this replica already holds, and the logs' new entries. The reply is one string of
# length-prefixed items (``<length>:<bytes>``), cheap to split.
_ROUND_SCRIPT = """
local vkey, rkey = KEYS[1], KEYS[2]
local me, ttl, coord, maxlen, prefix, count = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local now, now_ms, full, prune = ARGV[7], tonumber(ARGV[8]), ARGV[9] == '1', ARGV[10] == '1'
local i = 11
local function section()
  local n = tonumber(ARGV[i])
  local items = {}
  for k = 1, n do items[k] = ARGV[i + k] end
  i = i + n + 1
  return items
end
local sets, dels, outs, ins, known = section(), section(), section(), section(), section()
local out = {}
local function put(s)
  s = tostring(s)
  out[#out + 1] = #s .. ':' .. s
end
local function failed(r) return type(r) == 'table' and r.err ~= nil end
local function chunked(cmd, key, first, list)
  local args = {cmd, key}
  for _, a in ipairs(first) do args[#args + 1] = a end
  for k = 1, #list do
    args[#args + 1] = list[k]
    if #args >= 1000 and k % 2 == 0 then
      redis.pcall(unpack(args))
      args = {cmd, key}
    end
  end
  if #args > 2 then redis.pcall(unpack(args)) end
end
local had = redis.pcall('PEXPIRE', vkey, ttl)
if failed(had) then had = 1 end
put(had)
if full then redis.pcall('DEL', vkey) end
chunked('HSET', vkey, {'$alive', now}, sets)
if #dels > 0 then chunked('HDEL', vkey, {}, dels) end
if full or had == 0 then redis.pcall('PEXPIRE', vkey, ttl) end
redis.pcall('ZADD', rkey, now_ms, me)
if prune then
  redis.pcall('ZREMRANGEBYSCORE', rkey, '-inf', now_ms - coord)
  redis.pcall('PEXPIRE', rkey, coord)
end
for k = 1, #outs, 2 do
  local lkey = prefix .. 'log:' .. outs[k]
  redis.pcall('XADD', lkey, 'MAXLEN', '~', maxlen, '*', 'r', me, 't', now, 'd', outs[k + 1])
  redis.pcall('PEXPIRE', lkey, coord)
end
local digests = {}
for k = 1, #known, 2 do digests[known[k]] = known[k + 1] end
local members = redis.pcall('ZRANGE', rkey, 0, -1)
if failed(members) then members = {} end
local peers = {}
for _, p in ipairs(members) do
  if p ~= me then peers[#peers + 1] = p end
end
put(#peers)
for _, p in ipairs(peers) do
  put(p)
  local h = redis.pcall('HGETALL', prefix .. 'v:' .. p)
  if failed(h) then
    put('W')
  else
    local alive = false
    for k = 1, #h, 2 do
      if h[k] == '$alive' then
        alive = true
        h[k + 1] = ''  -- the heartbeat moves every round: not part of the digest
      end
    end
    if not alive then
      put('D')
    else
      -- JSON text and field names hold no NUL byte: joined with NULs, different hashes differ
      local digest = redis.sha1hex(table.concat(h, '\0'))
      if digests[p] == digest then
        put('U')
      else
        put('C')
        put(digest)
        put(#h / 2 - 1)
        for k = 1, #h, 2 do
          if h[k] ~= '$alive' then
            put(h[k])
            put(h[k + 1])
          end
        end
      end
    end
  end
end
if #ins > 0 then
  local args = {'XREAD', 'COUNT', count, 'STREAMS'}
  for k = 1, #ins, 2 do args[#args + 1] = prefix .. 'log:' .. ins[k] end
  for k = 2, #ins, 2 do args[#args + 1] = ins[k] end
  local r = redis.pcall(unpack(args))
  if failed(r) then
    put('W')
  elseif not r then
    put(0)
  else
    put(#r)
    for _, s in ipairs(r) do
      put(s[1])
      put(#s[2])
      for _, e in ipairs(s[2]) do
        local f, fields = e[2], {}
        for k = 1, #f, 2 do fields[f[k]] = f[k + 1] end
        put(e[1])
        if fields['r'] == me then put('S') else put('E') end
        put(fields['t'] or '')
        put(fields['d'] or '')
      end
    end
  end
end
return table.concat(out)
"""
_ROUND_SCRIPT_SHA = hashlib.sha1(_ROUND_SCRIPT.encode()).hexdigest()


def _netstrings(reply: bytes) -> list[bytes]:
    """Split ``<length>:<bytes>`` items."""
    items: list[bytes] = []
    find, end, pos = reply.find, len(reply), 0
    while pos < end:
        colon = find(b":", pos)
        if colon < 0:
            break
        start = colon + 1
        pos = start + int(reply[pos:colon])
        items.append(reply[start:pos])
    return items


@dataclass(slots=True)
class _PeerValues:
    """A peer's hash as last read: its digest, its fields' raw bytes with what they decoded to (None:
    skipped), and the decoded (state key, endpoint, value) entries."""

    digest: bytes
    raw: dict[bytes, tuple[bytes, tuple[str, str, Any] | None]]
    entries: list[tuple[str, str, Any]]


def _failure_reason(e: BaseException) -> str:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

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
        self._link: _redis_link.RedisLink | None = None  # shared with the syncers that connect alike
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
        self._fixed_args: list[Any] = []
        self._peer_cache: dict[str, _PeerValues] = {}  # peer id -> its hash as last read
        self._next_prune = 0.0
        self.decoded = 0  # peers' hash fields decoded (an unchanged hash is not read again)
        self._set_fixed_args()

    def _set_fixed_args(self) -> None:
        p = self.params
        self._fixed_args = [
            self.replica_id,
            self._state_ttl_ms,
            self._coord_ms,
            p.max_log_batches,
            self._prefix,
            XREAD_COUNT,
        ]

    # --- CrossReplicaSyncer: local side (never blocks) -------------------------------------------

    def bind(self, pool: str, publish_timeout: float) -> None:
        self._prefix = f"{self.params.key_prefix}:{pool}:"
        self._timeout = publish_timeout
        self._set_fixed_args()
        self._peer_cache = {}

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
        """The same mapping object from round to round while no peer's value for ``key`` changed."""
        return self._mirror.get(key, _NOTHING)

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

    def _settings(self) -> tuple[Any, ...]:
        """What the connection depends on: syncers with the same settings share one connection."""
        p = self.params
        password: str | None = None
        if p.password_env:
            password = os.environ.get(p.password_env) or None
        elif p.password_file:
            with open(p.password_file, encoding="utf-8") as f:
                password = f.read().strip() or None
        tls = (p.ca_cert_path, p.insecure_skip_verify) if p.tls else None
        return (p.address, p.db, p.username, password, tls, self._timeout)

    def _connect(self, settings: tuple[Any, ...]) -> aioredis.Connection:
        """One plain connection (connected on first use, again after a failure): a round is one
        command, so the client's pool, retries and per-command checks would only add work."""
        from redis import asyncio as aioredis

        p = self.params
        host, _, port = p.address.rpartition(":")
        password = settings[3]
        kwargs: dict[str, Any] = {
            "host": host.strip("[]"),
            "port": int(port),
            "db": p.db,
            "username": p.username or None,
            "password": password,
            "socket_timeout": self._timeout,
            "socket_connect_timeout": self._timeout,
            "health_check_interval": 0,
        }
        if p.tls:
            return aioredis.SSLConnection(
                ssl_ca_certs=p.ca_cert_path or None,
                ssl_cert_reqs=ssl.CERT_NONE if p.insecure_skip_verify else ssl.CERT_REQUIRED,
                ssl_check_hostname=not p.insecure_skip_verify,
                **kwargs,
            )
        return aioredis.Connection(**kwargs)

    async def _command(self, *args: Any) -> Any:
        """Send one command and read its reply (an error reply raises; a failure disconnects), over
        the connection this syncer shares with the others that connect alike (one per pool)."""
        from epp.plugins.syncers import _redis_link

        link = self._link
        if link is None:
            settings = self._settings()
            link = self._link = _redis_link.acquire(settings, lambda: self._connect(settings))
        return await link.command(*args)

    async def sync(self) -> None:
        from redis.exceptions import RedisError

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
        from redis.exceptions import NoScriptError

        now = time.time()
        prefix = self._prefix
        full = self._full
        changed = self._own.keys() if full else self._dirty
        sets: list[bytes | str] = []
        for k in changed:
            sets.append(f"{k[0]}{SEPARATOR}{k[1]}")
            sets.append(orjson.dumps(self._own[k]))
        deleted = [] if full else [f"{k[0]}{SEPARATOR}{k[1]}" for k in self._deleted]
        outbox, self._outbox = self._outbox, {}
        outs: list[bytes | str] = []
        for key, records in outbox.items():
            if records:
                outs.append(key)
                outs.append(orjson.dumps(records))
        logs = list(self._inbox)
        ins: list[bytes | str] = []
        for key in logs:
            ins.append(key)
            ins.append(self._cursors.get(key, b"0-0"))
        digests: list[bytes | str] = []
        for peer, cached in self._peer_cache.items():
            digests.append(peer)
            digests.append(cached.digest)
        # the registry's old members are pruned and its TTL renewed about once a second
        prune = full or now >= self._next_prune
        if prune:
            self._next_prune = now + PRUNE_INTERVAL_SECONDS
        args: list[Any] = [*self._fixed_args, str(now), int(now * 1000), 1 if full else 0, 1 if prune else 0]
        for section in (sets, deleted, outs, ins, digests):
            args.append(len(section))
            args.extend(section)
        vkey, rkey = f"{prefix}v:{self.replica_id}", f"{prefix}replicas"
        command = ("EVALSHA", _ROUND_SCRIPT_SHA, 2, vkey, rkey, *args)
        try:
            try:
                reply = await self._command(*command)
            except NoScriptError:  # a new or restarted server: load the script, then run it
                await self._command("SCRIPT", "LOAD", _ROUND_SCRIPT)
                reply = await self._command(*command)
        except BaseException:
            self._requeue(outbox)
            raise
        self._full = False
        self._dirty.clear()
        self._deleted.clear()
        items = _netstrings(reply) if isinstance(reply, bytes) else []
        if len(items) < 2:  # not the answer of our script (its SHA says it is): keep the mirror
            self.skip("wrong_type")
            return
        if items[0] == b"0" and not full:
            # Our hash had expired: the store restarted (data lost) or we were cut off longer than
            # stateTTL. Rewrite everything next round and re-read the logs from their start.
            self._full = True
            self._cursors.clear()
            log.info("cross-replica state was lost in the store; republishing", syncer=self.name)
        pos = self._apply_peers(items, 1)
        if logs and pos < len(items):
            self._apply_logs(items, pos, now)

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

    def _apply_peers(self, items: list[bytes], pos: int) -> int:
        """Read the peers' part of the reply (from ``items[pos]``); rebuild the mirror when a peer's
        values changed, joined or left. Returns the position after it."""
        cache = self._peer_cache
        fresh: dict[str, _PeerValues] = {}
        changed = False
        n = int(items[pos])
        pos += 1
        for _ in range(n):
            peer = items[pos].decode(errors="replace")
            status = items[pos + 1]
            pos += 2
            if status == b"U":  # the same values as the last round's: keep them decoded
                cached = cache.get(peer)
                if cached is not None:
                    fresh[peer] = cached
                    continue
                changed = True  # forgotten meanwhile (a failed round): read again next round
                fresh[peer] = _PeerValues(b"", {}, [])
            elif status == b"C":
                digest, count = items[pos], int(items[pos + 1])
                pos += 2
                fresh[peer] = self._decode_peer(digest, items[pos : pos + 2 * count], cache.get(peer))
                pos += 2 * count
                changed = True
            elif status == b"W":
                self.skip("wrong_type")  # a foreign key under our name: not ours to trust
            # b"D": expired (dead) or foreign without a heartbeat
        if changed or fresh.keys() != cache.keys():
            mirror: dict[str, dict[str, list[Any]]] = {}
            for values in fresh.values():
                for key, endpoint, value in values.entries:
                    mirror.setdefault(key, {}).setdefault(endpoint, []).append(value)
            self._mirror = mirror
        self._peer_cache = fresh
        self._live = frozenset(fresh)
        m.PEERS.set(len(fresh))
        return pos

    def _decode_peer(self, digest: bytes, fields: list[bytes], before: _PeerValues | None) -> _PeerValues:
        """A peer's changed hash: decode the fields whose bytes changed, reuse the others."""
        old = before.raw if before is not None else {}
        raw: dict[bytes, tuple[bytes, tuple[str, str, Any] | None]] = {}
        entries: list[tuple[str, str, Any]] = []
        for i in range(0, len(fields), 2):
            name, data = fields[i], fields[i + 1]
            known = old.get(name)
            if known is not None and known[0] == data:
                entry = known[1]
            else:
                entry = None
                self.decoded += 1
                try:
                    key, sep, endpoint = name.decode().rpartition(SEPARATOR)
                    if not sep or not key or not endpoint:
                        raise ValueError(name)
                    entry = (key, endpoint, orjson.loads(data))
                except (ValueError, UnicodeDecodeError, orjson.JSONDecodeError):
                    self.skip("undecodable")
            raw[name] = (data, entry)
            if entry is not None:
                entries.append(entry)
        return _PeerValues(digest, raw, entries)

    def _apply_logs(self, items: list[bytes], pos: int, now: float) -> None:
        if items[pos] == b"W":
            self.skip("wrong_type")
            return
        plen = len(self._prefix) + len("log:")
        streams = int(items[pos])
        pos += 1
        for _ in range(streams):
            key = items[pos].decode(errors="replace")[plen:]
            entries = int(items[pos + 1])
            pos += 2
            inbox = self._inbox.get(key)
            for _ in range(entries):
                entry_id, kind, sent_text, data = items[pos : pos + 4]
                pos += 4
                if inbox is None:
                    continue
                self._cursors[key] = entry_id
                if kind == b"S":  # our own
                    continue
                try:
                    records = orjson.loads(data)
                    sent = float(sent_text)
                    if not isinstance(records, list):
                        raise ValueError("not a list")
                except (ValueError, orjson.JSONDecodeError):
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
            self._peer_cache = {}
            self._live = frozenset()
            m.PEERS.set(0)

    async def close(self) -> None:
        from redis.exceptions import RedisError

        from epp.plugins.syncers import _redis_link

        link, self._link = self._link, None
        if link is not None:
            try:
                await _redis_link.release(link)
            except (RedisError, OSError):
                pass


register(RedisSyncer, "redis-state-store")
_MISSING: Any = object()
_NOTHING: Mapping[str, Sequence[Any]] = MappingProxyType({})
