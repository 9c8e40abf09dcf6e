"""``file-discovery``: endpoints from a YAML or JSON file, for running without Kubernetes."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
import yaml

from epp.background import BackgroundTask
from epp.framework import ConfigError, EndpointDiscovery, EndpointMetadata, EndpointNotifier, register
from epp.framework.interfaces import Handle, Plugin
from epp.framework.wire import POOL_LABEL
from epp.plugins.discovery._metrics import FILE_INVALID_ENTRIES, FILE_LOAD_FAILURES, FILE_REJECTED

log = structlog.get_logger("epp.discovery.file")

MAX_FILE_SIZE = 1 << 20
POLL_INTERVAL = 0.2
_RECENT_WRITE = 2.0  # seconds within which an unchanged stat signature still triggers a re-read
_PATH_REQUIRED = "file-discovery: 'path' parameter is required"

_Signature = tuple[int, int, int, int]

try:
    _YamlLoader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML without libyaml
    _YamlLoader = yaml.SafeLoader


class FileDiscoveryError(Exception):
    """A rejected endpoints file: unreadable, too large, unparsable, bad shape, no valid entry.

    ``reason`` is one of ``_metrics.LOAD_FAILURE_REASONS``.
    """

    def __init__(self, message: str, reason: str = "read_error") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True, frozen=True)
class FileDiscoveryParams:
    path: str = ""
    watch_file: bool = False

    def validate(self) -> str | None:
        if not self.path:
            return f"path: {_PATH_REQUIRED}"
        return None


@dataclass(slots=True, frozen=True)
class LoadResult:
    """A successfully read file: the valid endpoints by key (last entry wins) and entry errors.

    ``entries`` is the number of entries listed, valid or not.
    """

    endpoints: Mapping[str, EndpointMetadata]
    invalid: tuple[str, ...]
    entries: int = 0

    @property
    def rejected(self) -> bool:
        """Entries were listed but none is valid: the file is rejected, not applied as empty."""
        return self.entries > 0 and not self.endpoints


@register
class FileDiscovery(EndpointDiscovery):
    """Loads the endpoints file at ``start`` and, with ``watchFile``, polls it for changes.

    Change detection stats the path (not an open file) every 0.2 s, so in-place writes, atomic
    replacement, symlink swaps and delete-then-recreate are all seen. A rejected reload keeps the last
    good set. Notifier calls come from ``start``'s caller, then from the one watch task, in order.
    """

    type_name = "file-discovery"
    Params = FileDiscoveryParams
    hostnames: bool = False  # addresses may be DNS names (multicluster-file-discovery), not only IPv4

    def __init__(self, name: str, params: FileDiscoveryParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        if not params.path:
            raise ConfigError("path", _PATH_REQUIRED)
        self.params: FileDiscoveryParams = params
        self.path = params.path
        self.poll_interval = POLL_INTERVAL
        self._notifier: EndpointNotifier | None = None
        self._loaded: frozenset[str] = frozenset()
        self._content: bytes | None = None  # of the last applied load
        self._rejected: bytes | None = None  # the last rejected content (reported once)
        self._read_error = ""  # the last read error (reported once)
        self._serving_last_good = False  # the file on disk is rejected
        self._signature: _Signature | None = None
        self._task = BackgroundTask(f"watch {self.path}", self._watch)

    def config_warnings(self, plugins: Mapping[str, Plugin]) -> Sequence[tuple[str, str]]:
        """A file that is not there now: ``epp serve`` would fail at start (it may appear later,
        in the container or before the EPP starts, so it is not an error)."""
        if os.path.exists(self.path):
            return ()
        where = "" if os.path.isabs(self.path) else f" (relative to {os.getcwd()})"
        return (
            (
                "path",
                f"the endpoints file {self.path} does not exist{where}: `epp serve` cannot start without it",
            ),
        )

    @property
    def loaded_keys(self) -> frozenset[str]:
        """Keys of the endpoints applied by the last successful load."""
        return self._loaded

    async def start(self, notifier: EndpointNotifier) -> None:
        """Load the file once (raising ``FileDiscoveryError`` when it is rejected), then watch it."""
        self._notifier = notifier
        signature = _stat(self.path)
        try:
            content, result = await asyncio.to_thread(_load, self.path, self.hostnames)
            self._log_invalid(result)
            if result.rejected:
                raise _no_valid_entries(self.path, result)
        except FileDiscoveryError as e:
            FILE_LOAD_FAILURES.labels(e.reason).inc()
            raise FileDiscoveryError(f"file-discovery: initial load failed: {e}", e.reason) from e
        self._apply(result, content, signature)
        if self.params.watch_file:
            self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    # --- loading --------------------------------------------------------------------------------

    def _apply(self, result: LoadResult, content: bytes, signature: _Signature | None) -> None:
        notifier = self._notifier
        assert notifier is not None
        for metadata in result.endpoints.values():
            notifier.upsert(metadata)
        current = frozenset(result.endpoints)
        for key in sorted(self._loaded - current):
            notifier.delete(key)
        log.info(
            "endpoints file loaded",
            path=self.path,
            endpoints=len(current),
            invalid=len(result.invalid),
            removed=len(self._loaded - current),
        )
        self._loaded = current
        self._content = content
        self._signature = signature
        self._rejected = None
        self._read_error = ""
        self._serving_last_good = False
        FILE_REJECTED.set(0)
        n = len(result.invalid)
        entries = "entry" if n == 1 else "entries"
        self._problem(f"{n} invalid endpoint {entries} skipped in {self.path}" if n else "")

    def _log_invalid(self, result: LoadResult) -> None:
        FILE_INVALID_ENTRIES.set(len(result.invalid))
        for reason in result.invalid:
            log.error("skipping invalid endpoint entry", path=self.path, reason=reason)

    def _reject(self, error: FileDiscoveryError) -> None:
        """Keep the current endpoints; count and report the rejection."""
        FILE_LOAD_FAILURES.labels(error.reason).inc()
        FILE_REJECTED.set(1)
        self._serving_last_good = True
        log.error(
            "reloading endpoints file failed; keeping the current endpoints",
            path=self.path,
            reason=error.reason,
            error=str(error),
            endpoints=len(self._loaded),
        )
        self._problem(
            f"endpoints file rejected ({error}); serving the last good set of {len(self._loaded)} endpoints"
        )

    def _problem(self, text: str) -> None:
        callback = self.on_problem
        if callback is not None:
            try:
                callback(text)
            except Exception:
                log.exception("reporting a discovery problem failed")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            signature = _stat(self.path)
            if signature == self._signature and not _recently_modified(signature):
                continue
            self._signature = signature
            try:
                await self._reload()
            except Exception:
                log.exception("reloading endpoints file crashed; keeping the current endpoints")

    async def _reload(self) -> None:
        try:
            content = await asyncio.to_thread(_read, self.path)
        except FileDiscoveryError as e:
            if str(e) != self._read_error:  # report once per distinct failure, not every poll
                self._read_error = str(e)
                self._rejected = None
                self._reject(e)
            return
        self._read_error = ""
        if content == self._content:  # back to (or still) the content in use
            if self._serving_last_good:
                self._rejected = None
                self._serving_last_good = False
                FILE_REJECTED.set(0)
                self._problem("")
                log.info("endpoints file is back to the content in use", path=self.path)
            return
        if content == self._rejected:
            return
        try:
            result = await asyncio.to_thread(parse_endpoints, content, self.path, self.hostnames)
            self._log_invalid(result)
            if result.rejected:
                raise _no_valid_entries(self.path, result)
        except FileDiscoveryError as e:
            self._rejected = content
            self._reject(e)
            return
        self._apply(result, content, self._signature)


def _no_valid_entries(path: str, result: LoadResult) -> FileDiscoveryError:
    n = result.entries
    return FileDiscoveryError(
        f"{path}: none of its {n} endpoint entr{'y is' if n == 1 else 'ies is'} valid "
        f"(first: {result.invalid[0] if result.invalid else '?'})",
        "no_valid_entries",
    )


def _stat(path: str) -> _Signature | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


def _recently_modified(signature: _Signature | None) -> bool:
    # abs(): a file dated in the future (clock skew) must not be re-read forever
    return signature is not None and abs(time.time_ns() - signature[0]) < _RECENT_WRITE * 1e9


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            content = f.read(MAX_FILE_SIZE + 1)
    except OSError as e:
        raise FileDiscoveryError(f"reading {path}: {e.strerror or e}") from e
    if len(content) > MAX_FILE_SIZE:
        raise FileDiscoveryError(f"endpoints file {path} exceeds 1 MiB limit", "too_large")
    return content


def _load(path: str, hostnames: bool = False) -> tuple[bytes, LoadResult]:
    """Read and validate the file (runs in a worker thread)."""
    content = _read(path)
    return content, parse_endpoints(content, path, hostnames)


def parse_endpoints(content: bytes, path: str = "<endpoints>", hostnames: bool = False) -> LoadResult:
    """Decode an endpoints file; raises ``FileDiscoveryError`` on a file-level problem.

    ``hostnames``: an address may also be an IP of either family or an RFC 1123 DNS name, and the
    labels ``metricsAddress`` / ``metricsPort`` set where the endpoint's metrics are scraped."""
    try:
        stripped = content.lstrip()
        if stripped[:1] in (b"{", b"["):
            doc = orjson.loads(content)
        else:
            doc = yaml.load(content, Loader=_YamlLoader)  # CSafeLoader or SafeLoader
    except (orjson.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise FileDiscoveryError(f"unmarshalling {path}: {e}", "parse_error") from e
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise FileDiscoveryError(
            f"unmarshalling {path}: the top level must be a mapping, got {_kind(doc)}", "invalid_shape"
        )
    entries = doc.get("endpoints")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise FileDiscoveryError(
            f"unmarshalling {path}: 'endpoints' must be a list, got {_kind(entries)}", "invalid_shape"
        )
    grouped = _pool_entries(doc.get("pools"), path)
    endpoints: dict[str, EndpointMetadata] = {}
    invalid: list[str] = []
    pool_of: dict[str, str] = {}  # "ip:port" -> pool (an endpoint belongs to one pool)
    listed = [(entry, index, None) for index, entry in enumerate(entries)] + grouped
    for entry, index, pool in listed:
        try:
            metadata = _endpoint(entry, index, hostnames, pool)
            _one_pool(metadata, endpoints, pool_of)
        except ValueError as e:
            invalid.append(str(e))
            continue
        endpoints.pop(metadata.key, None)  # last wins, and keeps file order of the winners
        endpoints[metadata.key] = metadata
    return LoadResult(endpoints=endpoints, invalid=tuple(invalid), entries=len(listed))


def _pool_entries(pools: Any, path: str) -> list[tuple[Any, int, str | None]]:
    """``pools: [{name: P, endpoints: [...]}]``: each entry with its pool's name."""
    if pools is None:
        return []
    if not isinstance(pools, list):
        raise FileDiscoveryError(
            f"unmarshalling {path}: 'pools' must be a list, got {_kind(pools)}", "invalid_shape"
        )
    out: list[tuple[Any, int, str | None]] = []
    for n, group in enumerate(pools):
        name = group.get("name") if isinstance(group, dict) else None
        members = group.get("endpoints") if isinstance(group, dict) else None
        if not isinstance(name, str) or not name or not isinstance(members, list):
            raise FileDiscoveryError(
                f"unmarshalling {path}: pools[{n}] must be a mapping with a 'name' and an 'endpoints' list",
                "invalid_shape",
            )
        out.extend((entry, index, name) for index, entry in enumerate(members))
    return out


def _one_pool(
    metadata: EndpointMetadata, endpoints: Mapping[str, EndpointMetadata], pool_of: dict[str, str]
) -> None:
    """An endpoint (its key, its address) listed in two pools is an error: the later entry is invalid."""
    pool = metadata.labels.get(POOL_LABEL, "")
    earlier = endpoints.get(metadata.key)
    if earlier is not None and earlier.labels.get(POOL_LABEL, "") != pool:
        raise ValueError(
            f"endpoint {metadata.key!r} is listed in pools {earlier.labels.get(POOL_LABEL, '')!r} and "
            f"{pool!r}: an endpoint belongs to one pool"
        )
    hostport = f"{metadata.address}:{metadata.port}"
    other = pool_of.setdefault(hostport, pool)
    if other != pool:
        raise ValueError(
            f"endpoint {metadata.key!r}: {hostport} is listed in pools {other!r} and {pool!r}: "
            "an endpoint belongs to one pool"
        )


def _endpoint(entry: Any, index: int, hostnames: bool = False, pool: str | None = None) -> EndpointMetadata:
    """One validated entry; raises ``ValueError`` with the reference's message style.

    ``pool``: the pool the entry is listed under (``pools``), else its own ``pool`` field if any."""
    if not isinstance(entry, dict):
        where = f"pool {pool!r} endpoints" if pool else "endpoints"
        raise ValueError(f"{where}[{index}]: expected a mapping, got {_kind(entry)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"endpoints[{index}]: missing or invalid name {name!r}")
    namespace = entry.get("namespace")
    if namespace is None or namespace == "":
        namespace = "default"
    if not isinstance(namespace, str):
        raise ValueError(f"endpoint {name!r}: invalid namespace {namespace!r}")
    address = entry.get("address")
    if hostnames:
        if not _host_or_ip(address):
            raise ValueError(f'endpoint "{name}": invalid host "{address}"')
    else:
        try:
            ipaddress.IPv4Address(address)  # rejects hostnames, IPv6 and leading zeros
        except (ipaddress.AddressValueError, ValueError):
            raise ValueError(f'endpoint "{name}": invalid IPv4 address "{address}"') from None
    port = _port(entry.get("port"))
    if port is None:
        raise ValueError(f'endpoint "{name}": invalid port "{entry.get("port")}"')
    labels = _labels(entry.get("labels"))
    if labels is None:
        raise ValueError(f'endpoint "{name}": labels must be a mapping of strings to scalars')
    own = entry.get("pool")
    if own is not None and (not isinstance(own, str) or (pool and own != pool)):
        raise ValueError(f'endpoint "{name}": invalid pool {own!r}')
    if pool or own:
        labels[POOL_LABEL] = str(pool or own)
    metrics_host = _join_host(str(address), str(port))
    if hostnames and labels.get("metricsAddress"):
        metrics_host = _join_host(labels["metricsAddress"], labels.get("metricsPort") or str(port))
    return EndpointMetadata(
        name=name,
        address=str(address),
        port=port,
        namespace=namespace,
        labels=labels,
        metrics_host=metrics_host,
    )


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _host_or_ip(address: Any) -> bool:
    """An IP address of either family, or an RFC 1123 subdomain (lower case, at most 253 chars)."""
    if not isinstance(address, str) or not address:
        return False
    try:
        ipaddress.ip_address(address)
        return True
    except ValueError:
        pass
    return len(address) <= 253 and all(
        len(part) <= 63 and _DNS_LABEL.fullmatch(part) for part in address.split(".")
    )


def _join_host(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _port(value: Any) -> int | None:
    # An integer or a string holding one (the reference accepts only strings).
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.isdigit()):
            return None
        value = int(text)
    if isinstance(value, int) and 1 <= value <= 65535:
        return value
    return None


def _labels(value: Any) -> dict[str, str] | None:
    if value is None:
        return {}
    if not isinstance(value, dict):
        return None
    labels: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            return None
        if isinstance(item, bool):
            labels[key] = "true" if item else "false"
        elif isinstance(item, str | int | float):
            labels[key] = str(item)
        elif item is None:
            labels[key] = ""
        else:
            return None
    return labels


def _kind(value: Any) -> str:
    return type(value).__name__
