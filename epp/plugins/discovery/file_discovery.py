"""``file-discovery``: endpoints from a YAML or JSON file, for running without Kubernetes.

Type: ``file-discovery`` (an ``EndpointDiscovery``, selected by ``dataLayer.discovery.pluginRef``).
Parameters:

* ``path`` (required): the endpoints file; missing → ``file-discovery: 'path' parameter is required``;
* ``watchFile`` (false): reload the file when it changes; false = read once at startup.

File format (at most 1 MiB)::

    endpoints:
    - name: vllm-0             # required
      namespace: inference     # optional, default "default"
      address: "10.0.0.1"      # IPv4 literal
      port: 8000               # integer or string, 1..65535
      labels: {llm-d.ai/role: decode, llm-d.ai/engine-type: vllm}   # optional

Each valid entry becomes the endpoint ``{namespace}/{name}`` with ``metrics_host = address:port``
(metrics are scraped from the serving port) and the entry's labels (role filters, selectors and the
engine type work as with pods). Entries are processed top to bottom; for a duplicate
``{namespace, name}`` the last entry wins.

Algorithm: ``start(notifier)`` loads the file once and upserts every valid entry. A file-level
error (cannot read, over 1 MiB → ``endpoints file <path> exceeds 1 MiB limit``, bad YAML/JSON or
shape → ``unmarshalling <path>: ...``) raises ``FileDiscoveryError("file-discovery: initial load
failed: ...")`` and the EPP exits. With ``watchFile`` a background task then polls the path every
0.2 s; on change it reloads: a file-level error is logged and the current endpoints stay; otherwise
valid entries are upserted (identical metadata is a no-op in the store) and every endpoint of the
previous load missing from the new valid set is deleted. All notifier calls come from the caller of
``start`` and then from the single watch task, in causal order. ``stop()`` cancels the watch.

Change detection: ``os.stat`` of the path (following symlinks) every 0.2 s, comparing
``(st_mtime_ns, st_size, st_ino, st_dev)``. Stating the path rather than an open file picks up
in-place writes, atomic replacement (write a temporary file + ``os.replace``: a new inode), a
ConfigMap ``..data`` symlink swap (the target changes), and delete-then-recreate (the path is
missing for a while, which is a file-level error that keeps the endpoints, then reappears). This is
the effect of watching the parent directory without an inotify dependency; 0.2 s of latency is
irrelevant for endpoint lists. Content identical to the last load is not re-applied. Because
file-system timestamps are coarse, a file modified in the last 2 s is re-read on every poll (and
compared) so that a second write within the same timestamp tick is not missed.

Differences from the reference (quirk D20), deliberately following what users expect:

* ``port`` may be an integer or a string holding 1..65535 (the reference rejects YAML integers,
  failing the whole file);
* invalid entries (``endpoint "<n>": invalid IPv4 address "<a>"``, ``invalid port "<p>"``, a
  missing name...) are logged and skipped on the initial load too (the reference aborts start-up,
  but skips them on reload), so one bad line never takes the EPP down;
* the watch survives delete-and-recreate of the file (the reference may lose its fsnotify watch);
* label values that are YAML scalars other than strings (``8``, ``true``) are accepted as their
  string form (``"8"``, ``"true"``) instead of failing the file.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
import yaml

from epp.background import BackgroundTask
from epp.framework import ConfigError, EndpointDiscovery, EndpointMetadata, EndpointNotifier, register
from epp.framework.interfaces import Handle

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
    """A file-level error of the endpoints file (unreadable, too large, unparsable, bad shape)."""


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
    """A successfully read file: the valid endpoints by key (last entry wins) and entry errors."""

    endpoints: Mapping[str, EndpointMetadata]
    invalid: tuple[str, ...]


@register
class FileDiscovery(EndpointDiscovery):
    type_name = "file-discovery"
    Params = FileDiscoveryParams

    def __init__(self, name: str, params: FileDiscoveryParams, handle: Handle | None = None) -> None:
        super().__init__(name, params, handle)
        if not params.path:
            raise ConfigError("path", _PATH_REQUIRED)
        self.params: FileDiscoveryParams = params
        self.path = params.path
        self.poll_interval = POLL_INTERVAL
        self._notifier: EndpointNotifier | None = None
        self._loaded: frozenset[str] = frozenset()
        self._content: bytes | None = None
        self._signature: _Signature | None = None
        self._task = BackgroundTask(f"watch {self.path}", self._watch)

    @property
    def loaded_keys(self) -> frozenset[str]:
        """Keys of the endpoints applied by the last successful load."""
        return self._loaded

    async def start(self, notifier: EndpointNotifier) -> None:
        """Load the file once (raising ``FileDiscoveryError`` on a file-level error), then watch it."""
        self._notifier = notifier
        signature = _stat(self.path)
        try:
            content, result = await asyncio.to_thread(_load, self.path)
        except FileDiscoveryError as e:
            raise FileDiscoveryError(f"file-discovery: initial load failed: {e}") from e
        self._apply(result, content, signature)
        if self.params.watch_file:
            self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    # --- loading --------------------------------------------------------------------------------

    def _apply(self, result: LoadResult, content: bytes, signature: _Signature | None) -> None:
        notifier = self._notifier
        assert notifier is not None
        for reason in result.invalid:
            log.error("skipping invalid endpoint entry", path=self.path, reason=reason)
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

    async def _watch(self) -> None:
        last_error = ""
        while True:
            await asyncio.sleep(self.poll_interval)
            signature = _stat(self.path)
            if signature == self._signature and not _recently_modified(signature):
                continue
            try:
                content, result = await asyncio.to_thread(_reload, self.path, self._content)
            except FileDiscoveryError as e:
                if str(e) != last_error:  # log once per distinct failure, not every poll
                    last_error = str(e)
                    log.error("reloading endpoints file failed; keeping the current endpoints", error=str(e))
                self._signature = signature
                continue
            except Exception:
                log.exception("reloading endpoints file crashed; keeping the current endpoints")
                self._signature = signature
                continue
            last_error = ""
            if result is None:  # same bytes as the last successful load
                self._signature = signature
                continue
            self._apply(result, content, signature)


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
        raise FileDiscoveryError(f"endpoints file {path} exceeds 1 MiB limit")
    return content


def _load(path: str) -> tuple[bytes, LoadResult]:
    """Read and validate the file (runs in a worker thread)."""
    content = _read(path)
    return content, parse_endpoints(content, path)


def _reload(path: str, previous: bytes | None) -> tuple[bytes, LoadResult | None]:
    """Like ``_load``, with ``None`` as the result when the bytes equal ``previous``."""
    content = _read(path)
    if content == previous:
        return content, None
    return content, parse_endpoints(content, path)


def parse_endpoints(content: bytes, path: str = "<endpoints>") -> LoadResult:
    """Decode an endpoints file; raises ``FileDiscoveryError`` on a file-level problem."""
    try:
        stripped = content.lstrip()
        if stripped[:1] in (b"{", b"["):
            doc = orjson.loads(content)
        else:
            doc = yaml.load(content, Loader=_YamlLoader)  # CSafeLoader or SafeLoader
    except (orjson.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise FileDiscoveryError(f"unmarshalling {path}: {e}") from e
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise FileDiscoveryError(f"unmarshalling {path}: the top level must be a mapping, got {_kind(doc)}")
    entries = doc.get("endpoints")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise FileDiscoveryError(f"unmarshalling {path}: 'endpoints' must be a list, got {_kind(entries)}")
    endpoints: dict[str, EndpointMetadata] = {}
    invalid: list[str] = []
    for index, entry in enumerate(entries):
        try:
            metadata = _endpoint(entry, index)
        except ValueError as e:
            invalid.append(str(e))
            continue
        endpoints.pop(metadata.key, None)  # last wins, and keeps file order of the winners
        endpoints[metadata.key] = metadata
    return LoadResult(endpoints=endpoints, invalid=tuple(invalid))


def _endpoint(entry: Any, index: int) -> EndpointMetadata:
    """One validated entry; raises ``ValueError`` with the reference's message style."""
    if not isinstance(entry, dict):
        raise ValueError(f"endpoints[{index}]: expected a mapping, got {_kind(entry)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"endpoints[{index}]: missing or invalid name {name!r}")
    namespace = entry.get("namespace")
    if namespace is None or namespace == "":
        namespace = "default"
    if not isinstance(namespace, str):
        raise ValueError(f"endpoint {name!r}: invalid namespace {namespace!r}")
    address = entry.get("address")
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
    return EndpointMetadata(
        name=name,
        address=str(address),
        port=port,
        namespace=namespace,
        labels=labels,
        metrics_host=f"{address}:{port}",
    )


def _port(value: Any) -> int | None:
    # Quirk D20: the reference demands a string; integers are accepted here too.
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
