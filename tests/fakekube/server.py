"""``FakeKube``: an in-process fake Kubernetes API server speaking the real REST list/watch protocol.

It runs an aiohttp server on 127.0.0.1 (ephemeral port) in its own thread with its own event loop, so
synchronous tests (driving subprocesses) and async tests (on their own loop) can both use it. Clients
talk to it exactly as to a real cluster, through a kubeconfig (:meth:`FakeKube.write_kubeconfig`) or
in-cluster service-account files (:meth:`FakeKube.write_incluster_files`, TLS mode).

Served resources (all namespaced): core/v1 ``Pod`` (also cluster-wide ``/api/v1/pods``),
``inference.networking.k8s.io/v1`` ``InferencePool``, ``inference.networking.x-k8s.io/v1alpha2``
``InferencePool``, ``InferenceObjective`` and ``InferenceModelRewrite``, ``llm-d.ai/v1alpha2``
``InferenceObjective`` and ``InferenceModelRewrite``, and ``coordination.k8s.io/v1`` ``Lease``
(a group's CRDs can be uninstalled and reinstalled: :meth:`FakeKube.set_group_installed`); plus
``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/apis/{group}[/{version}]``, and TokenReview /
SubjectAccessReview creation for the tokens and non-resource grants a test declares.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from aiohttp import web

from ._http import ApiServer, FailRule, RequestRecord
from ._patch import merge_patch
from ._resources import Registry
from ._status import ApiError
from ._store import HISTORY_LIMIT, ObjectStore
from ._tls import TlsMaterial, make_tls_material

Obj = dict[str, Any]


class FakeKube:
    """A fake Kubernetes API server in a background thread. Public methods are sync and thread-safe.

    Objects are plain dicts as Kubernetes serialises them. The synchronous helpers (:meth:`create`,
    :meth:`apply`, :meth:`patch`, :meth:`delete`) write straight to the store and emit the same watch
    events REST writes do; unlike REST writes they may set ``status`` and always make a new
    resourceVersion (no no-op detection).
    """

    def __init__(
        self,
        *,
        tls: bool = False,
        bookmark_interval: float = 1.0,
        token: str = "test-token",
        history_limit: int = HISTORY_LIMIT,
    ) -> None:
        self.tls = tls
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.url = ""
        self.port = 0
        self.registry = Registry()
        self._store = ObjectStore(history_limit)
        self._api = ApiServer(self._store, self.registry, token, bookmark_interval)
        self._tls: TlsMaterial | None = make_tls_material() if tls else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def requests(self) -> list[RequestRecord]:
        """``(method, path, query)`` of every request received (authorised or not), in arrival order.

        The query values are exactly as sent: ``kubernetes_asyncio`` sends booleans as ``"True"``.
        The list is live; ``requests.clear()`` resets it.
        """
        return self._api.requests

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> FakeKube:
        """Serve on 127.0.0.1 on an ephemeral port (see :attr:`url`, :attr:`port`); returns ``self``."""
        if self._thread is not None:
            raise RuntimeError("FakeKube already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="fakekube", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise RuntimeError("FakeKube failed to start") from failure[0]
        return self

    async def _serve(self) -> None:
        ssl_context = None
        if self._tls is not None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fakekube-")
            cert, key = Path(self._tmp.name, "tls.crt"), Path(self._tmp.name, "tls.key")
            cert.write_bytes(self._tls.server_cert_pem)
            key.write_bytes(self._tls.server_key_pem)
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(cert, key)
        self._runner = web.AppRunner(
            self._api.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"{'https' if self._tls else 'http'}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Break every open watch and stop serving (idempotent)."""
        loop, thread, runner = self._loop, self._thread, self._runner
        if thread is None or loop is None:
            return
        self.drop_watches()
        if runner is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = self._loop = self._runner = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------ client config

    @property
    def ca_pem(self) -> bytes | None:
        """The PEM CA certificate clients must trust (TLS mode), else ``None``."""
        return self._tls.ca_pem if self._tls else None

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig for this server: its URL, the bearer token and (TLS) the CA data."""
        self._require_started()
        cluster: Obj = {"server": self.url}
        if self._tls is not None:
            cluster["certificate-authority-data"] = base64.b64encode(self._tls.ca_pem).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fakekube", "cluster": cluster}],
            "users": [{"name": "fakekube", "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": "fakekube",
                    "context": {"cluster": "fakekube", "user": "fakekube", "namespace": namespace},
                }
            ],
            "current-context": "fakekube",
            "preferences": {},
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def write_incluster_files(self, directory: Path) -> tuple[Path, Path]:
        """Write the service-account ``token`` and ``ca.crt`` files (TLS mode only).

        Point the in-cluster loader at them with ``KUBERNETES_SERVICE_HOST=127.0.0.1`` and
        ``KUBERNETES_SERVICE_PORT=<port>``.
        """
        if self._tls is None:
            raise RuntimeError("in-cluster config needs https: create FakeKube(tls=True)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        token, ca = directory / "token", directory / "ca.crt"
        token.write_text(self.token)
        ca.write_bytes(self._tls.ca_pem)
        return token, ca

    def _require_started(self) -> None:
        if not self.url:
            raise RuntimeError("FakeKube is not started")

    # ------------------------------------------------------------------------------------ objects

    def create(self, obj: Obj) -> Obj:
        """Store a new object (``KeyError`` if it exists), filling uid, resourceVersion, timestamps."""
        resource = self.registry.by_kind(obj.get("apiVersion", ""), obj.get("kind", ""))
        try:
            return self._store.create(resource, obj)
        except ApiError as err:
            raise KeyError(str(err)) from err

    def apply(self, obj: Obj) -> Obj:
        """Create ``obj``, or replace the stored one (new resourceVersion; generation if spec changed)."""
        resource = self.registry.by_kind(obj.get("apiVersion", ""), obj.get("kind", ""))
        meta = obj.get("metadata") or {}
        with self._store.lock:
            if self._store.get(resource, meta.get("namespace") or "default", meta.get("name", "")) is None:
                return self._store.create(resource, obj)
            obj = {**obj, "metadata": {**meta, "namespace": meta.get("namespace") or "default"}}
            return self._store.update(resource, obj, force=True)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, changes: Obj) -> Obj:
        """Apply a JSON merge patch (RFC 7386) to a stored object (``KeyError`` if missing)."""
        resource = self.registry.by_kind(api_version, kind)
        with self._store.lock:
            current = self._store.get(resource, namespace, name)
            if current is None:
                raise KeyError(f"{kind} {namespace}/{name} not found")
            patched = merge_patch(current, changes)
            patched["metadata"].update(namespace=namespace, name=name)
            return self._store.update(resource, patched, force=True)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete a stored object (``KeyError`` if missing); watches get DELETED, with a new RV."""
        resource = self.registry.by_kind(api_version, kind)
        try:
            self._store.delete(resource, namespace, name)
        except ApiError as err:
            raise KeyError(str(err)) from err

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        """A copy of one stored object, or ``None``."""
        return self._store.get(self.registry.by_kind(api_version, kind), namespace, name)

    def list(self, api_version: str, kind: str, namespace: str | None) -> list[Obj]:
        """Copies of the stored objects of a kind in ``namespace`` (``None``: all namespaces)."""
        return self._store.list_objects(self.registry.by_kind(api_version, kind), namespace)

    @property
    def resource_version(self) -> str:
        """The current global resourceVersion."""
        with self._store.lock:
            return str(self._store.rv)

    # ------------------------------------------------------------------------------------ faults

    def compact(self) -> None:
        """Forget the event history: watches and continue tokens from older resourceVersions get 410."""
        self._store.compact()

    def drop_watches(self) -> int:
        """Abort every open watch connection mid-stream (no final chunk); returns how many."""
        return self._store.close_watches(self._store.watchers(), "abort")

    def fail_next(self, method: str, path_contains: str, status: int = 500, count: int = 1) -> None:
        """Answer the next ``count`` requests with ``method`` (``"*"``: any) whose path and query string
        contain ``path_contains`` with a ``status`` error Status (after the auth check)."""
        self._api.add_fail_rule(FailRule(method.upper(), path_contains, status, count))

    def add_user(self, token: str, username: str, groups: tuple[str, ...] = ()) -> None:
        """Another client's bearer token, which TokenReviews authenticate as ``username``."""
        self._api.add_user(token, username, groups)

    def grant_non_resource(self, username: str, verb: str, path: str) -> None:
        """SubjectAccessReviews allow ``verb`` on the non-resource URL ``path`` for ``username``."""
        self._api.grant_non_resource(username, verb, path)

    @property
    def reviews(self) -> list[str]:
        """``"token"`` (TokenReview) or ``"access"`` (SubjectAccessReview) for each review served."""
        return self._api.reviews

    def set_group_installed(self, group: str, installed: bool) -> None:
        """Simulate a CRD group being absent: 404 on all its paths, gone from ``/apis``.

        Uninstalling also ends (cleanly) the open watches on the group's resources. Stored objects are
        kept and reappear when the group is installed again.
        """
        self._api.set_group_installed(group, installed)
        if not installed:
            self._store.close_watches(self._store.watchers(lambda w: w.resource.group == group), "end")

    def open_watches(self, kind: str | None = None) -> int:
        """How many watches (of ``kind``, or any) are open."""
        return len(self._store.watchers(lambda w: kind is None or w.resource.kind == kind))

    # ------------------------------------------------------------------------------------ waiting

    @staticmethod
    def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Poll ``predicate`` until it is true; ``AssertionError`` after ``timeout`` seconds.

        This blocks the calling thread: from async tests use :meth:`wait_for_async`.
        """
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout}s")
            time.sleep(0.01)

    @staticmethod
    async def wait_for_async(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """:meth:`wait_for` for async tests: polls without blocking the caller's event loop."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout}s")
            await asyncio.sleep(0.01)
