"""``header-based-testing-filter`` (test only): keep the endpoints a request header names."""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, Filter, LLMRequest, register
from epp.framework.wire import TEST_ENDPOINT_SELECTION_HEADER


def _split_host_port(item: str) -> tuple[str, str] | None:
    """``(host, port)`` as Go's ``net.SplitHostPort`` returns them, or None where it fails."""
    i = item.rfind(":")
    if i < 0:
        return None  # missing port
    if item.startswith("["):
        end = item.find("]")
        if end < 0 or end + 1 != i:
            return None  # missing ']', missing port or too many colons
        host, bracket_free_from, closing_free_from = item[1:end], 1, end + 1
    else:
        host, bracket_free_from, closing_free_from = item[:i], 0, 0
        if ":" in host:
            return None  # too many colons: a bare IPv6 address
    if "[" in item[bracket_free_from:] or "]" in item[closing_free_from:]:
        return None
    return host, item[i + 1 :]


@register
class HeaderBasedTestingFilter(Filter):
    """Keeps the ``IP`` / ``IP:port`` items of the header, in header order, de-duplicated by IP.

    An item without a port matches the last candidate with that IP; a missing header keeps nothing.
    """

    type_name = "header-based-testing-filter"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        header = request.headers.get(TEST_ENDPOINT_SELECTION_HEADER, "")
        if not header.strip():
            return []
        by_ip: dict[str, Endpoint] = {}
        by_hostport: dict[str, Endpoint] = {}
        for e in endpoints:
            ip = e.metadata.address.strip().strip("[]")
            if not ip:
                continue
            by_ip[ip] = e
            by_hostport[f"{ip}:{e.metadata.port}"] = e

        out: list[Endpoint] = []
        seen: set[str] = set()
        for raw in header.split(","):
            item = raw.strip()
            if not item:
                continue
            split = _split_host_port(item)
            host, port = split if split is not None else (item, "")
            host = host.strip("[]")
            match = by_hostport.get(f"{host}:{port}") if port else by_ip.get(host)
            if match is None:
                continue
            ip = match.metadata.address.strip().strip("[]")
            if ip not in seen:
                seen.add(ip)
                out.append(match)
        return out
