"""``header-based-testing-filter`` (test only): keep the endpoints a request header names.

Type: ``header-based-testing-filter``. Parameters: none.

Algorithm: the request header ``test-epp-endpoint-selection`` is a comma list of ``IP`` or
``IP:port`` items (IPv6 with or without brackets: ``::1``, ``[::1]``, ``[::1]:8000``). Header
missing or blank → no endpoints. For each item in header order: with a port, the endpoint whose
``ip:port`` matches exactly; without one, the endpoint with that IP (the last such candidate, as the
reference's IP map keeps the last one written). A matched endpoint is kept unless an endpoint with
the same IP was already kept (de-duplicated by IP), so the result follows header order.

Items are split like Go's ``net.SplitHostPort``: an unbracketed item with more than one ``:`` (a bare
IPv6 address) has no port; an unparsable item is taken as a bare IP.
"""

from __future__ import annotations

from epp.framework import CycleState, Endpoint, Filter, LLMRequest, register

HEADER = "test-epp-endpoint-selection"


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
    type_name = "header-based-testing-filter"

    def filter(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        header = request.headers.get(HEADER, "")
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
