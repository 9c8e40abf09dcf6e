"""The aiohttp application: auth, request log, injected failures, discovery, REST and list/watch."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ._patch import PatchError, json_patch, merge_patch
from ._resources import Registry, ResourceType
from ._selectors import (
    FieldSelector,
    LabelSelector,
    SelectorError,
    parse_field_selector,
    parse_label_selector,
)
from ._status import ApiError
from ._store import ObjectStore
from ._watcher import StoredEvent, Watcher

Obj = dict[str, Any]
RequestRecord = tuple[str, str, dict[str, str]]

#: What ``/version`` reports.
VERSION_INFO = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.0-fakekube",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_CONTINUE_TOO_OLD = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new "
    "list without the continue parameter, or use the continue token in this response to retrieve the "
    "remainder of the results. Continuing with the provided token results in an inconsistent list - "
    "objects that were created, modified, or deleted between the time the first chunk was returned and "
    "now may show up in the list."
)
_HEADERS = {"Cache-Control": "no-cache, private"}
_TOKEN_REVIEWS = ["apis", "authentication.k8s.io", "v1", "tokenreviews"]
_ACCESS_REVIEWS = ["apis", "authorization.k8s.io", "v1", "subjectaccessreviews"]


def _parse_bool(value: str | None) -> bool:
    return value in _TRUE


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers={**_HEADERS, **(headers or {})},
    )


def _error_response(err: ApiError) -> web.Response:
    return _json(err.status, err.code, err.headers)


def encode_continue(rv: int, namespace: str, name: str) -> str:
    """A continue token like the API server's: the list's resourceVersion and the last key returned."""
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": f"{namespace}/{name}\x00"})
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, tuple[str, str]]:
    """``(resourceVersion, (namespace, name))`` from a continue token; 400 BadRequest if malformed."""
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        namespace, _, name = raw["start"].rstrip("\x00").partition("/")
        if raw.get("v") != "meta.k8s.io/v1" or not isinstance(raw["rv"], int):
            raise ValueError(raw)
        return raw["rv"], (namespace, name)
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise ApiError.bad_request(f"continue key is not valid: {token!r}") from None


@dataclass
class FailRule:
    """Answer the next ``remaining`` requests whose method and path match with a ``status`` error."""

    method: str
    path_contains: str
    status: int
    remaining: int


@dataclass(frozen=True)
class _Target:
    """What a resource path addresses."""

    resource: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


class ApiServer:
    """The fake API server's request handling (runs on the server loop; its state is thread-safe)."""

    def __init__(self, store: ObjectStore, registry: Registry, token: str, bookmark_interval: float) -> None:
        self.store = store
        self.registry = registry
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.requests: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._fail_rules: list[FailRule] = []
        self._uninstalled: set[str] = set()
        # TokenReview / SubjectAccessReview: bearer tokens of other clients -> (username, groups),
        # and the (username, verb, path) non-resource grants
        self._users: dict[str, tuple[str, list[str]]] = {}
        self._grants: set[tuple[str, str, str]] = set()
        self.reviews: list[str] = []  # "token" / "access" per review served, in order

    # ------------------------------------------------------------------------------------ test hooks

    def add_fail_rule(self, rule: FailRule) -> None:
        """Inject failures (see :class:`FailRule`)."""
        with self._lock:
            self._fail_rules.append(rule)

    def set_group_installed(self, group: str, installed: bool) -> None:
        """Serve or hide (404 everywhere, absent from discovery) a non-core API group."""
        if group not in self.registry.groups():
            raise ValueError(f"fakekube does not serve API group {group!r}")
        with self._lock:
            if installed:
                self._uninstalled.discard(group)
            else:
                self._uninstalled.add(group)

    def add_user(self, token: str, username: str, groups: tuple[str, ...] = ()) -> None:
        """A bearer token TokenReviews authenticate as ``username``."""
        with self._lock:
            self._users[token] = (username, list(groups))

    def grant_non_resource(self, username: str, verb: str, path: str) -> None:
        """Allow ``verb`` on the non-resource URL ``path`` in SubjectAccessReviews for ``username``."""
        with self._lock:
            self._grants.add((username, verb, path))

    def _token_review(self, body: Any) -> Obj:
        token = str(((body or {}).get("spec") or {}).get("token", ""))
        with self._lock:
            self.reviews.append("token")
            user = self._users.get(token)
        status: Obj = {"authenticated": False}
        if user is not None:
            status = {"authenticated": True, "user": {"username": user[0], "uid": user[0], "groups": user[1]}}
        return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}

    def _access_review(self, body: Any) -> Obj:
        spec = (body or {}).get("spec") or {}
        attrs = spec.get("nonResourceAttributes") or {}
        key = (str(spec.get("user", "")), str(attrs.get("verb", "")), str(attrs.get("path", "")))
        with self._lock:
            self.reviews.append("access")
            allowed = key in self._grants
        return {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "status": {"allowed": allowed},
        }

    def group_installed(self, group: str) -> bool:
        """Whether ``group`` is served (the core group always is)."""
        with self._lock:
            return group not in self._uninstalled

    def _take_failure(self, method: str, path_qs: str) -> FailRule | None:
        with self._lock:
            for rule in self._fail_rules:
                if rule.method in ("*", method) and rule.path_contains in path_qs:
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._fail_rules.remove(rule)
                    return rule
        return None

    # ------------------------------------------------------------------------------------ app

    def make_app(self) -> web.Application:
        """The aiohttp application serving every path through :meth:`_dispatch`."""
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        with self._lock:
            self.requests.append((request.method, request.path, dict(request.query)))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _error_response(ApiError(401, "Unauthorized"))
        rule = self._take_failure(request.method, request.path_qs)
        if rule is not None:
            headers = {"Retry-After": "1"} if rule.status == 429 else None
            details = {"retryAfterSeconds": 1} if rule.status == 429 else None
            return _error_response(
                ApiError(rule.status, "injected failure", details=details, headers=headers)
            )
        try:
            response: web.StreamResponse = await handler(request)
        except ApiError as err:
            return _error_response(err)
        return response

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if parts == ["version"]:
            return _json(VERSION_INFO)
        if request.method == "POST" and parts in (_TOKEN_REVIEWS, _ACCESS_REVIEWS):
            try:
                body = json.loads(await request.read() or b"{}")
            except ValueError:
                raise ApiError.bad_request("request body is not JSON") from None
            review = self._token_review if parts == _TOKEN_REVIEWS else self._access_review
            return _json(review(body), 201)
        if len(parts) == 1 and parts[0] in ("healthz", "livez", "readyz"):
            return web.Response(text="ok")
        if not parts or parts[0] not in ("api", "apis"):
            raise ApiError.no_such_path()
        if parts[0] == "api":
            if len(parts) == 1:
                return _json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
            group, version, rest = "", parts[1], parts[2:]
            if version != "v1":
                raise ApiError.no_such_path()
        else:
            if len(parts) == 1:
                return _json(self._group_list())
            group = parts[1]
            versions = self.registry.groups().get(group)
            if versions is None or not self.group_installed(group):
                raise ApiError.no_such_path()
            if len(parts) == 2:
                return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group_entry(group, versions)})
            version, rest = parts[2], parts[3:]
            if version not in versions:
                raise ApiError.no_such_path()
        if not rest:
            return _json(self._resource_list(group, version))
        target = self._target(group, version, rest)
        return await self._serve(request, target)

    # ------------------------------------------------------------------------------------ discovery

    def _group_entry(self, group: str, versions: list[str]) -> Obj:
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": entries, "preferredVersion": entries[0]}

    def _group_list(self) -> Obj:
        groups = [
            self._group_entry(group, versions)
            for group, versions in self.registry.groups().items()
            if self.group_installed(group)
        ]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def _resource_list(self, group: str, version: str) -> Obj:
        resources = [e for r in self.registry.in_group_version(group, version) for e in r.discovery_entries()]
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    # ------------------------------------------------------------------------------------ resources

    def _target(self, group: str, version: str, rest: list[str]) -> _Target:
        if len(rest) == 1:
            namespace, plural, name, sub = None, rest[0], None, None
        elif rest[0] == "namespaces" and 3 <= len(rest) <= 5:
            namespace, plural = rest[1], rest[2]
            name = rest[3] if len(rest) > 3 else None
            sub = rest[4] if len(rest) > 4 else None
        else:
            raise ApiError.no_such_path()
        resource = self.registry.by_path(group, version, plural)
        if resource is None or (sub is not None and (sub != "status" or not resource.has_status)):
            raise ApiError.no_such_path()
        return _Target(resource, namespace, name, sub)

    async def _serve(self, request: web.Request, target: _Target) -> web.StreamResponse:
        method = request.method
        if target.name is None:
            if method == "GET":
                if _parse_bool(request.query.get("watch")):
                    return await self._watch(request, target)
                return _json(self._list(request, target))
            if method == "POST" and target.namespace is not None:
                return _json(self._create(target, await self._body(request)), 201)
        else:
            assert target.namespace is not None
            if method == "GET":
                return _json(self.store.require(target.resource, target.namespace, target.name))
            if method == "PUT":
                return _json(self._replace(target, await self._body(request)))
            if method == "PATCH":
                return _json(self._patch(request, target, await self._body(request)))
            if method == "DELETE" and target.subresource is None:
                return _json(self._delete(target, await self._body(request, optional=True)))
        raise ApiError(405, "the server does not allow this method on the requested resource")

    @staticmethod
    async def _body(request: web.Request, optional: bool = False) -> Any:
        raw = await request.read()
        if not raw and optional:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError.bad_request(
                "the body of the request was in an unknown format - accepted media types include: "
                "application/json"
            ) from None

    def _check_object(self, target: _Target, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise ApiError.bad_request("the body of the request must be a JSON object")
        resource = target.resource
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if (api_version and api_version != resource.api_version) or (kind and kind != resource.kind):
            raise ApiError.bad_request(
                f"the API version in the data ({api_version}) or kind ({kind}) does not match the expected "
                f"API version ({resource.api_version}) and kind ({resource.kind})"
            )
        meta = body.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError.bad_request("metadata must be an object")
        if meta.get("namespace") and meta["namespace"] != target.namespace:
            raise ApiError.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        meta["namespace"] = target.namespace
        if target.name is not None:
            if meta.get("name") and meta["name"] != target.name:
                raise ApiError.bad_request(
                    f"the name of the object ({meta['name']}) does not match the name on the URL "
                    f"({target.name})"
                )
            meta["name"] = target.name
        return body

    def _create(self, target: _Target, body: Any) -> Obj:
        obj = self._check_object(target, body)
        for field in ("resourceVersion", "uid", "creationTimestamp", "generation"):
            obj["metadata"].pop(field, None)
        return self.store.create(target.resource, obj)

    def _update(self, target: _Target, obj: Obj) -> Obj:
        rv = obj["metadata"].get("resourceVersion") or None
        if rv is None and not target.resource.builtin:
            raise ApiError(
                422,
                f'{target.resource.kind}.{target.resource.group} "{target.name}" is invalid: '
                "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
            )
        return self.store.update(
            target.resource,
            obj,
            expect_rv=rv,
            keep_status=target.resource.has_status and target.subresource is None,
            status_only=target.subresource == "status",
        )

    def _replace(self, target: _Target, body: Any) -> Obj:
        return self._update(target, self._check_object(target, body))

    def _patch(self, request: web.Request, target: _Target, body: Any) -> Obj:
        content_type = request.content_type
        assert target.namespace is not None and target.name is not None
        with self.store.lock:
            current = self.store.require(target.resource, target.namespace, target.name)
            try:
                if content_type == "application/merge-patch+json" or (
                    content_type == "application/strategic-merge-patch+json" and target.resource.builtin
                ):
                    patched = merge_patch(current, body)
                elif content_type == "application/json-patch+json":
                    if not isinstance(body, list):
                        raise ApiError.bad_request(
                            "json: cannot unmarshal object into Go value of type jsonpatch.Patch"
                        )
                    patched = json_patch(current, body)
                else:
                    raise ApiError(
                        415,
                        f"the body of the request was in an unknown format - accepted media types include: "
                        f"application/json-patch+json, application/merge-patch+json (got {content_type!r})",
                    )
            except PatchError as err:
                raise ApiError(422, str(err)) from None
            if not isinstance(patched, dict):
                raise ApiError(422, "the patched object is not a JSON object")
            meta = patched.setdefault("metadata", {})
            if meta.get("name") != target.name or meta.get("namespace") != target.namespace:
                raise ApiError.bad_request("a patch may not change metadata.name or metadata.namespace")
            return self._update(target, self._check_object(target, patched))

    def _delete(self, target: _Target, options: Any) -> Obj:
        assert target.namespace is not None and target.name is not None
        preconditions = options.get("preconditions") if isinstance(options, dict) else None
        deleted = self.store.delete(target.resource, target.namespace, target.name, preconditions)
        if target.resource.delete_returns_object:
            return deleted
        meta = deleted["metadata"]
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {
                "name": target.name,
                "group": target.resource.group,
                "kind": target.resource.plural,
                "uid": meta["uid"],
            },
        }

    # ------------------------------------------------------------------------------------ list

    def _selectors(self, request: web.Request, resource: ResourceType) -> tuple[LabelSelector, FieldSelector]:
        try:
            labels = parse_label_selector(request.query.get("labelSelector"))
            fields = parse_field_selector(request.query.get("fieldSelector"), resource.field_labels)
        except SelectorError as err:
            raise ApiError.bad_request(str(err)) from None
        return labels, fields

    @staticmethod
    def _int_param(request: web.Request, name: str) -> int | None:
        value = request.query.get(name)
        if value in (None, ""):
            return None
        try:
            return int(value)
        except ValueError:
            raise ApiError.bad_request(f"invalid value for {name}: {value!r}") from None

    def _list(self, request: web.Request, target: _Target) -> Obj:
        resource = target.resource
        labels, fields = self._selectors(request, resource)
        limit = self._int_param(request, "limit") or 0
        token = request.query.get("continue")
        rv_param = self._int_param(request, "resourceVersion")
        start: tuple[str, str] | None = None
        if token:
            if rv_param:
                raise ApiError.bad_request("specifying resource version is not allowed when using continue")
            list_rv, start = decode_continue(token)
            try:
                items = self.store.snapshot(resource, target.namespace, list_rv)
            except ApiError as err:
                raise ApiError(410, _CONTINUE_TOO_OLD, reason="Expired") from err
        elif request.query.get("resourceVersionMatch") == "Exact" and rv_param is not None:
            list_rv = rv_param
            items = self.store.snapshot(resource, target.namespace, list_rv)
        else:
            with self.store.lock:
                list_rv = self.store.rv
                items = self.store.list_objects(resource, target.namespace)

        def key(obj: Obj) -> tuple[str, str]:
            return obj["metadata"]["namespace"], obj["metadata"]["name"]

        items = [
            o
            for o in items
            if (start is None or key(o) > start)
            and labels.matches(o["metadata"].get("labels"))
            and fields.matches(o)
        ]
        meta: Obj = {"resourceVersion": str(list_rv)}
        if 0 < limit < len(items):
            remaining = len(items) - limit
            items = items[:limit]
            meta["continue"] = encode_continue(list_rv, *key(items[-1]))
            if labels.empty and fields.empty:
                meta["remainingItemCount"] = remaining
        return {
            "kind": resource.list_kind,
            "apiVersion": resource.api_version,
            "metadata": meta,
            "items": items,
        }

    # ------------------------------------------------------------------------------------ watch

    async def _watch(self, request: web.Request, target: _Target) -> web.StreamResponse:
        resource = target.resource
        labels, fields = self._selectors(request, resource)
        rv_text = request.query.get("resourceVersion", "")
        since = None if rv_text in ("", "0") else self._int_param(request, "resourceVersion")
        bookmarks = _parse_bool(request.query.get("allowWatchBookmarks"))
        send_initial_param = request.query.get("sendInitialEvents")
        if send_initial_param is None:
            send_initial = since is None
        else:  # the "watch list" protocol: initial state, then a bookmark marking its end
            send_initial = _parse_bool(send_initial_param)
            if request.query.get("resourceVersionMatch") != "NotOlderThan" or not bookmarks:
                raise ApiError(
                    422,
                    "sendInitialEvents requires resourceVersionMatch=NotOlderThan and "
                    "allowWatchBookmarks=true",
                )
            if send_initial:
                since = None  # "at least as new as resourceVersion": the current state
        timeout = self._int_param(request, "timeoutSeconds")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout and timeout > 0 else None

        watcher = Watcher(resource, target.namespace, labels, fields, loop, request.transport)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json", **_HEADERS})
        response.enable_chunked_encoding()
        try:
            start_rv, initial, backlog = self.store.open_watch(watcher, since)
        except ApiError as err:
            # As the API server does: 200, then a single ERROR event carrying the Status, then the end.
            await response.prepare(request)
            await self._send(response, "ERROR", err.status)
            await response.write_eof()
            return response
        try:
            await response.prepare(request)
            if send_initial:
                for obj in initial:
                    await self._send(response, "ADDED", obj)
                if send_initial_param is not None:
                    await self._bookmark(response, resource, start_rv, initial_events_end=True)
            for event in backlog:
                await self._send_event(response, watcher, event)
            await self._stream(response, watcher, bookmarks, deadline)
            if watcher.closed == "abort":
                raise asyncio.CancelledError  # the transport is gone: nothing more to write
            await response.write_eof()
            return response
        finally:
            self.store.close_watch(watcher)

    async def _stream(
        self, response: web.StreamResponse, watcher: Watcher, bookmarks: bool, deadline: float | None
    ) -> None:
        loop = asyncio.get_running_loop()
        next_bookmark = loop.time() + self.bookmark_interval
        while True:
            watcher.wakeup.clear()
            while watcher.pending and not watcher.closed:
                await self._send_event(response, watcher, watcher.pending.popleft())
            if watcher.closed:
                return
            transport = watcher.transport
            if transport is not None and transport.is_closing():
                return
            now = loop.time()
            if deadline is not None and now >= deadline:
                return
            if bookmarks and now >= next_bookmark:
                rv = self.store.bookmark_rv(watcher)
                if rv is not None:
                    await self._bookmark(response, watcher.resource, rv)
                    next_bookmark = now + self.bookmark_interval
                continue
            wake_at = min(
                t for t in (deadline, next_bookmark if bookmarks else None, now + 1.0) if t is not None
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wake_at - now):
                    await watcher.wakeup.wait()

    async def _send_event(self, response: web.StreamResponse, watcher: Watcher, event: StoredEvent) -> None:
        translated = watcher.translate(event)
        if translated is not None:
            await self._send(response, *translated)

    async def _bookmark(
        self, response: web.StreamResponse, resource: ResourceType, rv: int, initial_events_end: bool = False
    ) -> None:
        meta: Obj = {"resourceVersion": str(rv)}
        if initial_events_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        await self._send(
            response,
            "BOOKMARK",
            {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": meta},
        )

    @staticmethod
    async def _send(response: web.StreamResponse, type_: str, obj: Obj) -> None:
        await response.write(
            json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n"
        )
