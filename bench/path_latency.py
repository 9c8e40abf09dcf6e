"""Latency the epp path adds: client → Envoy → EPP (ext_proc) → simulator, against the simulator direct.

One ``epp run`` stack per exchange (its generated bootstrap, or the gateways' full-duplex layouts),
two simulators, light load: one request at a time from one client, each request sent once through
Envoy and once straight to the simulator Envoy picked, alternating, so that the machine's load
falls on both alike. Per exchange and kind (streaming: time to the first SSE data line;
non-streaming: time to the whole response), p50 and p90 of each path and of the per-pair
difference. Set-up and figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._workdir import run_in_workdir
from epp.dev import stack
from epp.dev.envoy.bootstrap import (
    _TYPE,
    DEFAULT_BODY_MODE,
    data_listener,
    envoy_bootstrap,
    http_connection_manager,
    static_cluster,
)
from epp.dev.envoy.exchange import ResponseModes

PATH = "/v1/chat/completions"
MODEL = "demo"


@dataclass(frozen=True)
class Exchange:
    name: str
    what: str
    body_mode: str
    modes: ResponseModes | None  # None: the generated bootstrap's (from the EPP config)


EXCHANGES = {
    "envoy": Exchange(
        "envoy", "Envoy alone: round robin over the simulators, no ext_proc", DEFAULT_BODY_MODE, None
    ),
    "default": Exchange("default", "epp run's generated bootstrap", DEFAULT_BODY_MODE, None),
    "lean": Exchange(
        "lean",
        "the generated bootstrap with the response headers skipped (--response-header-mode SKIP)",
        DEFAULT_BODY_MODE,
        ResponseModes("SKIP", "NONE"),
    ),
    "fd": Exchange(
        "fd", "FULL_DUPLEX_STREAMED, response headers, no response body", "FULL_DUPLEX_STREAMED", None
    ),
    "fd-body": Exchange(
        "fd-body",
        "FULL_DUPLEX_STREAMED request and response bodies, response headers (bench-overload's)",
        "FULL_DUPLEX_STREAMED",
        ResponseModes("SEND", "FULL_DUPLEX_STREAMED"),
    ),
    "fd-body-skip": Exchange(
        "fd-body-skip",
        "FULL_DUPLEX_STREAMED request and response bodies, response headers skipped",
        "FULL_DUPLEX_STREAMED",
        ResponseModes("SKIP", "FULL_DUPLEX_STREAMED"),
    ),
}


class PathStack(stack.LocalStack):
    """``epp run``'s stack with the exchange's response modes instead of the generated ones."""

    def __init__(
        self, opts: stack.StackOptions, workdir: Path, modes: ResponseModes | None, *, plain: bool = False
    ) -> None:
        super().__init__(opts, workdir)
        self.modes = modes
        self.plain = plain

    def _plain_bootstrap(self) -> dict[str, Any]:
        """The generated bootstrap's listener and connection manager, without ext_proc: a route to
        a static cluster of the simulators (what Envoy itself costs)."""
        o = self.opts
        router = {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": f"{_TYPE}.filters.http.router.v3.Router",
                "suppress_envoy_headers": True,
            },
        }
        route = {"match": {"prefix": "/"}, "route": {"cluster": "sims", "timeout": "0s"}}
        routes = {"name": "plain", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]}
        return {
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": o.admin_port}}},
            "static_resources": {
                "listeners": [data_listener("127.0.0.1", o.port, http_connection_manager([router], routes))],
                "clusters": [static_cluster("sims", o.upstreams)],
            },
        }

    def bootstrap(self) -> dict[str, Any]:
        if self.plain:
            return self._plain_bootstrap()
        if self.modes is None:
            return super().bootstrap()
        o = self.opts
        first = o.epps()[0]
        return envoy_bootstrap(
            response_header_mode=self.modes.header,
            response_body_mode=self.modes.body,
            listen_port=o.port,
            admin_port=o.admin_port,
            extproc_port=first.grpc,
            extproc_socket=first.socket,
            body_mode=o.body_mode,
            fallback_endpoints=o.upstreams,
        )


@dataclass
class Series:
    through: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)

    def diffs(self) -> list[float]:
        return [a - b for a, b in zip(self.through, self.direct, strict=True)]


def _body(i: int, *, stream: bool, max_tokens: int) -> bytes:
    doc = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: say something short"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return json.dumps(doc).encode()


class Client:
    """Keep-alive HTTP/1.1 connections, one per host:port."""

    def __init__(self) -> None:
        self.conns: dict[tuple[str, int], http.client.HTTPConnection] = {}

    def send(self, host: str, port: int, body: bytes, *, stream: bool) -> tuple[float, str]:
        """Seconds to the first SSE data line (stream) or the whole body; the x-inference-port header."""
        conn = self.conns.get((host, port))
        if conn is None:
            conn = self.conns[(host, port)] = http.client.HTTPConnection(host, port, timeout=30)
        t0 = time.perf_counter()
        conn.request("POST", PATH, body, {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status} from {host}:{port}: {resp.read()[:200]!r}")
        first = 0.0
        if stream:
            while line := resp.readline():
                if not first and line.startswith(b"data:"):
                    first = time.perf_counter() - t0
        else:
            resp.read()
            first = time.perf_counter() - t0
        return first, resp.headers.get("x-inference-port", "")

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


def measure(url_port: int, args: argparse.Namespace) -> dict[str, Series]:
    client = Client()
    out = {"stream": Series(), "non-stream": Series()}
    try:
        for i in range(args.warmup + args.requests):
            for kind, series in out.items():
                stream = kind == "stream"
                body = _body(i, stream=stream, max_tokens=args.max_tokens)
                through, port = client.send("127.0.0.1", url_port, body, stream=stream)
                direct, _ = client.send("127.0.0.1", int(port), body, stream=stream)
                if i >= args.warmup:
                    series.through.append(through)
                    series.direct.append(direct)
            time.sleep(args.gap)
    finally:
        client.close()
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))]


def run_exchange(
    ex: Exchange, args: argparse.Namespace, workdir: Path
) -> tuple[dict[str, Series], list[str]]:
    opts = stack.StackOptions.on_free_ports(
        args.sims,
        sim_args=shlex.split(args.sim_args),
        body_mode=ex.body_mode,
        epp_args=["--log-level", "warning"],
    )
    with PathStack(opts, workdir / ex.name, ex.modes, plain=ex.name == "envoy") as st:
        out = measure(st.opts.port, args)
        return out, [] if ex.name == "envoy" else _epp_time(st.opts.metrics_port)


def _epp_time(metrics_port: int) -> list[str]:
    """The EPP's own time per request from its metrics: request headers to the routing reply, and
    its handler time of the response messages (means over the run, warm-up included)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    lines = []
    for name in ("request_processing_duration_seconds", "response_processing_duration_seconds"):
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(f"llm_d_epp_{name}_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"llm_d_epp_{name}_count"):
                count += float(line.rsplit(" ", 1)[1])
        mean = f"{total / count * 1e6:.0f} µs" if count else "n/a"
        lines.append(f"  EPP {name}: mean {mean} over {count:.0f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--exchanges", nargs="+", choices=list(EXCHANGES), default=["default", "fd-body"])
    add("--requests", type=int, default=300, help="measured requests per kind and path (default 300)")
    add("--warmup", type=int, default=20, help="requests first sent and not counted (default 20)")
    add("--sims", type=int, default=2, help="simulators (default 2)")
    add("--max-tokens", type=int, default=8, help="max_tokens of every request (default 8)")
    add("--gap", type=float, default=0.01, help="seconds between two rounds (default 0.01)")
    add(
        "--sim-args",
        default="--time-to-first-token 20 --inter-token-latency 5 --prefill-time-per-token 0 "
        "--time-factor-under-load 0",
        help="flags for every simulator, one shell-quoted string",
    )
    add("--keep-logs", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-path-"))
    print(f"command: {shlex.join([sys.executable, *sys.argv])}", flush=True)
    results: dict[str, tuple[dict[str, Series], list[str]]] = {}

    def run() -> int:
        for name in args.exchanges:
            results[name] = run_exchange(EXCHANGES[name], args, workdir)
            _print(EXCHANGES[name], *results[name])
        return 0

    return run_in_workdir(
        workdir,
        run,
        errors=(RuntimeError, TimeoutError, OSError),
        keep_logs=args.keep_logs,
    )


def _print(ex: Exchange, res: dict[str, Series], epp_lines: list[str]) -> None:
    print(f"\n{ex.name}: {ex.what}")
    print("  kind         n   direct p50/p90 ms   through p50/p90 ms   added p50/p90 ms")
    for kind, s in res.items():
        d = s.diffs()

        def ms(v: Sequence[float]) -> str:
            return f"{percentile(v, 50) * 1000:7.1f} / {percentile(v, 90) * 1000:6.1f}"

        print(f"  {kind:<10} {len(d):4d}  {ms(s.direct)}  {ms(s.through)}  {ms(d)}", flush=True)
    for line in epp_lines:
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
