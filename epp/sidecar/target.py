"""The ``x-prefiller-host-port`` header: one or more ``host:port`` prefill endpoints, comma separated."""

from __future__ import annotations

import ipaddress
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

PREFILL_HEADER = "x-prefiller-host-port"
MAX_CANDIDATES = 64

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


class TargetError(ValueError):
    """A malformed prefill header; the message names the bad value and why."""


@dataclass(frozen=True, slots=True)
class Target:
    """One prefill endpoint: ``host`` without brackets, ``hostport`` as written in the pool
    (IPv6 bracketed)."""

    host: str
    port: int

    @property
    def hostport(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.hostport}"


def parse_target(text: str) -> Target:
    """``host:port`` (IPv4, ``[IPv6]`` or a DNS name; port 1..65535) or ``TargetError``."""
    value = text.strip()
    if not value:
        raise TargetError("empty prefill endpoint")
    if "/" in value or "@" in value:
        raise TargetError(f"{value!r}: expected host:port, not a URL")
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise TargetError(f"{value!r}: an IPv6 endpoint is written [address]:port")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise TargetError(f"{value!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep or not host:
            raise TargetError(f"{value!r}: expected host:port")
        if ":" in host:
            raise TargetError(f"{value!r}: an IPv6 endpoint is written [address]:port")
        if not _is_ipv4(host) and not _HOSTNAME.match(host):
            raise TargetError(f"{value!r}: {host!r} is neither an IPv4 address nor a host name")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise TargetError(f"{value!r}: port must be a number in 1..65535")
    return Target(host, int(port_text))


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def parse_header(values: Sequence[str]) -> list[Target]:
    """Every endpoint named by the header's values (each may list several, comma separated); an
    empty list when the header is absent or blank. ``TargetError`` on any malformed entry."""
    entries = [part for value in values for part in value.split(",")]
    if not any(e.strip() for e in entries):
        return []
    if len(entries) > MAX_CANDIDATES:
        raise TargetError(f"{len(entries)} prefill endpoints; at most {MAX_CANDIDATES}")
    return [parse_target(e) for e in entries]


def choose(targets: Sequence[Target], *, sample: bool, rng: random.Random) -> Target:
    """The first candidate, or a random one with ``--enable-prefiller-sampling``."""
    return rng.choice(targets) if sample and len(targets) > 1 else targets[0]
