"""EPP CPU per request and requests/s through a real Envoy (``make bench-cpu``).

CPU µs per request = delta(utime + stime of the target) / completed requests, for ``epp serve`` and
for ``bench/extproc_stub.py`` (the gRPC/Envoy floor); the set-up is described in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._workdir import run_in_workdir
from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from epp.dev.stack import Stack

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MODEL = "demo"
SIM_ARGS = [
    "--time-to-first-token",
    "0",
    "--prefill-time-per-token",
    "0",
    "--inter-token-latency",
    "0",
    "--max-tokens",
    "1",
    "--max-num-seqs",
    "1024",
]
PATH = "/v1/chat/completions"
STUB_SCRIPT = Path(__file__).with_name("extproc_stub.py")
READY_TIMEOUT = 60.0


# ------------------------------------------------------------------------------------- measuring


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def total_cpu_seconds(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def machine_ticks() -> tuple[int, int]:
    """(steal, total) clock ticks of all CPUs from ``/proc/stat``: time the hypervisor took away."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[7], sum(fields)


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """CPU seconds per second the process spends with no requests (background work)."""
    if seconds <= 0:
        return 0.0
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - t0)


def chat_body(size: int = 1024) -> bytes:
    """A non-streaming chat request of about ``size`` bytes."""
    base = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    filler = size - len(json.dumps(base))
    base["messages"][0]["content"] = ("The quick brown fox jumps over the lazy dog. " * (size // 40 + 1))[
        : max(filler, 0)
    ]
    return json.dumps(base).encode()


def agentic_body(size: int = 800_000) -> bytes:
    """A long multi-turn agentic conversation of about ``size`` bytes: a system prompt, tool
    definitions, then turns of assistant tool calls and tool results (file contents), streamed."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name} a file of the repository",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path"],
                },
            },
        }
        for name in ("read_file", "write_file", "list_directory", "run_tests")
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in a large repository. " * 40},
        {"role": "user", "content": "Find why the request router drops long prompts, and fix it."},
    ]
    base = {"model": MODEL, "max_tokens": 1, "stream": False, "tools": tools, "messages": messages}
    line = "    def handle(self, request: Request) -> Response:  # routes the request to its endpoint\n"
    turn = 0
    while len(json.dumps(base)) < size:
        turn += 1
        call_id = f"call_{turn:04d}"
        path = f"src/router/module_{turn}.py"
        messages.append(
            {
                "role": "assistant",
                "content": f"Reading {path} next.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": json.dumps({"path": path})},
                    }
                ],
            }
        )
        room = size - len(json.dumps(base)) - 200
        messages.append({"role": "tool", "tool_call_id": call_id, "content": (line * 200)[: max(room, 0)]})
    return json.dumps(base).encode()


# --exchanges: (request body mode, response header mode) of the front Envoy's ext_proc filter. The
# response trailers mode is SEND and the response body mode NONE in all of them (docs/deploy.md).
EXCHANGES: dict[str, tuple[str, str]] = {
    "FULL_DUPLEX_STREAMED": ("FULL_DUPLEX_STREAMED", "SEND"),
    "FULL_DUPLEX_STREAMED-lean": ("FULL_DUPLEX_STREAMED", "SKIP"),
    "BUFFERED": ("BUFFERED", "SEND"),
    "BUFFERED-lean": ("BUFFERED", "SKIP"),
    "STREAMED-lean": ("STREAMED", "SKIP"),
}
BASELINE = "FULL_DUPLEX_STREAMED"
# The exchanges a gateway configures (its Envoy reaches the EPP over TCP); the others are the
# layouts epp generates for an Envoy beside the EPP, which calls it on a Unix socket (--transport).
GATEWAY_EXCHANGES = ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED-lean")


def cpu_count() -> int:
    """What ``nproc`` prints: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 0


@dataclass
class LoadResult:
    completed: int
    errors: int
    seconds: float

    @property
    def rps(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0


# ------------------------------------------------------------------------------- load generators


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = io.open("%(body)s", "rb"):read("*a")
local limit = %(requests)d
local done = 0
function response(status, headers, body)
  done = done + 1
  if done == limit then
    io.open("%(marker)s", "w"):close()
    wrk.thread:stop()
  end
end
"""


class LoadGenerator:
    """``wrk`` (one thread, stopped by its Lua script after N responses) or the Python fallback."""

    def __init__(self, tool: str, body_file: Path, connections: int, workdir: Path) -> None:
        self.tool = tool
        self.body_file = body_file
        self.connections = connections
        self.workdir = workdir

    def argv(self, url: str, requests: int) -> list[str]:
        """The exact command line of one run (for wrk it also writes the Lua script it names)."""
        if self.tool == "wrk":
            script = self.workdir / f"post-{requests}.lua"
            script.write_text(
                WRK_SCRIPT % {"body": self.body_file, "requests": requests, "marker": self._marker}
            )
            c = self.connections
            return ["wrk", "-t1", f"-c{c}", "-d3600s", "--timeout", "30s", "-s", str(script), url]
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            "--loadgen",
            url,
            str(self.body_file),
            str(requests),
            str(self.connections),
        ]

    @property
    def _marker(self) -> Path:
        return self.workdir / "wrk.done"

    def run(self, url: str, requests: int, alive: Callable[[], None]) -> LoadResult:
        """One run; ``alive()`` raises when a process of the stack died (checked while waiting)."""
        argv = self.argv(url, requests)
        timeout = 60.0 + requests / 100.0  # far slower than any healthy stack
        if self.tool == "wrk":
            return self._run_wrk(argv, timeout, alive)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"load generator failed ({proc.returncode}):\n{proc.stderr.strip()}")
        data = json.loads(proc.stdout.strip().splitlines()[-1])
        return LoadResult(data["completed"], data["errors"], data["seconds"])

    def _run_wrk(self, argv: list[str], timeout: float, alive: Callable[[], None]) -> LoadResult:
        """wrk is duration-based: the Lua script stops its thread after N responses and drops a
        marker file; then SIGINT makes wrk print its summary and exit."""
        self._marker.unlink(missing_ok=True)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        try:
            while not self._marker.exists() and proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"wrk did not get its responses within {timeout:.0f} s")
                alive()
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return parse_wrk(out)


def parse_wrk(out: str) -> LoadResult:
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if done is None:
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[done.group(3)]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    if socket_errors:
        errors += sum(int(g) for g in socket_errors.groups())
    total = int(done.group(1))
    return LoadResult(total - (int(bad.group(1)) if bad else 0), errors, float(done.group(2)) * scale)


async def _loadgen(url: str, body: bytes, requests: int, connections: int) -> dict[str, Any]:
    import aiohttp

    remaining = requests
    completed = errors = 0
    headers = {"content-type": "application/json"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, completed, errors
        while remaining > 0:
            remaining -= 1
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status == 200:
                        completed += 1
                    else:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1

    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(connections)))
        seconds = time.perf_counter() - start
    return {"completed": completed, "errors": errors, "seconds": seconds}


def loadgen_main(argv: list[str]) -> int:
    url, body_file, requests, connections = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(_loadgen(url, body_file.read_bytes(), requests, connections))
    print(json.dumps(result))
    return 0


# -------------------------------------------------------------------------------- static backends


CHAT_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi"},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 230, "completion_tokens": 1, "total_tokens": 231},
    },
    separators=(",", ":"),
)
METRICS_PAGE = f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{MODEL}"}} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="{MODEL}"}} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.1
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",num_gpu_blocks="1024"}} 1
"""
MODELS_LIST = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]},
    separators=(",", ":"),
)
_TYPE = "type.googleapis.com/envoy.extensions"


def _direct(match: dict[str, Any], body: str, content_type: str, status: int = 200) -> dict[str, Any]:
    route: dict[str, Any] = {"match": match, "direct_response": {"status": status}}
    if body:
        route["direct_response"]["body"] = {"inline_string": body}
        route["response_headers_to_add"] = [
            {
                "header": {"key": "content-type", "value": content_type},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    return route


def backend_routes() -> dict[str, Any]:
    post = {"name": ":method", "string_match": {"exact": "POST"}}
    get = {"name": ":method", "string_match": {"exact": "GET"}}
    routes = [
        _direct({"prefix": "/v1/", "headers": [post]}, CHAT_COMPLETION, "application/json"),
        _direct({"path": "/metrics", "headers": [get]}, METRICS_PAGE, "text/plain; version=0.0.4"),
        _direct({"path": "/v1/models", "headers": [get]}, MODELS_LIST, "application/json"),
        _direct({"path": "/health"}, "", ""),
        _direct({"prefix": "/"}, "", "", status=404),
    ]
    return {"name": "backend", "virtual_hosts": [{"name": "backend", "domains": ["*"], "routes": routes}]}


def backend_bootstrap(ports: Sequence[int], admin_port: int) -> dict[str, Any]:
    """One Envoy, one listener per backend port, every answer a ``direct_response``.

    A buffer filter holds each request until its body is complete, so the answer never comes
    before the request has ended (an HTTP/1.1 connection would then be closed, not reused).
    """
    hcm = {
        "@type": f"{_TYPE}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "backend",
        "codec_type": "AUTO",
        "route_config": backend_routes(),
        "http_filters": [
            {
                "name": "envoy.filters.http.buffer",
                "typed_config": {
                    "@type": f"{_TYPE}.filters.http.buffer.v3.Buffer",
                    "max_request_bytes": 16 << 20,
                },
            },
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_TYPE}.filters.http.router.v3.Router"},
            },
        ],
    }
    listeners = [
        {
            "name": f"backend-{i}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [
                {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
            ],
        }
        for i, port in enumerate(ports)
    ]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "overload_manager": envoy_config.overload_manager(),
        "static_resources": {"listeners": listeners},
    }


# ------------------------------------------------------------------------------ response exchanges

# ``--response``: the response side of the front Envoy's ext_proc exchange (docs/deploy.md, "The Envoy
# exchange"). ``shipped`` is what epp.dev.envoy generates.
RESPONSE_EXCHANGES = ("shipped", "headers-only", "streamed", "full-duplex", "observer")


def response_exchange(bootstrap: dict[str, Any], exchange: str) -> dict[str, Any]:
    """Rewrite the ext_proc filter's response phases of a generated bootstrap (in place)."""
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    main = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
    mode = main["typed_config"]["processing_mode"]
    if exchange == "headers-only":  # the stream ends at the response headers (full duplex)
        mode.pop("response_trailer_mode", None)
    elif exchange == "streamed":
        mode["response_body_mode"] = "STREAMED"
    elif exchange == "full-duplex":
        mode["response_body_mode"] = "FULL_DUPLEX_STREAMED"
    elif exchange == "observer":  # a second filter that Envoy does not wait for
        mode.pop("response_trailer_mode", None)
        observer = {
            "name": "epp-observer",
            "typed_config": {
                **{k: v for k, v in main["typed_config"].items() if k != "message_timeout"},
                "observability_mode": True,
                "processing_mode": {
                    "request_header_mode": "SKIP",
                    "response_header_mode": "SEND",
                    "request_body_mode": "NONE",
                    "response_body_mode": "STREAMED",
                    "request_trailer_mode": "SKIP",
                    "response_trailer_mode": "SKIP",
                },
            },
        }
        filters.insert(filters.index(main) + 1, observer)
    elif exchange != "shipped":
        raise ValueError(f"unknown response exchange {exchange!r}")
    return bootstrap


# ----------------------------------------------------------------------------------------- stacks


class StartupError(RuntimeError):
    """A process of the benchmark exited or never became ready; carries its log tail."""


free_ports = stack.free_ports


def post_ok(url: str, body: bytes) -> Callable[[], bool]:
    def check() -> bool:
        request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2.0) as resp:
                resp.read()
                return bool(resp.status == 200)
        except (OSError, ValueError):
            return False

    return check


def http_ok(url: str) -> Callable[[], bool]:
    return lambda: stack.http_status(url) == 200


def check_alive(children: Sequence[stack.Child]) -> None:
    for child in children:
        if not child.running():
            raise StartupError(_exit_message(child))


def _exit_message(child: stack.Child) -> str:
    text = f"{child.name} exited with status {child.returncode()}"
    tail = child.tail(20)
    if tail:
        text += f"\n--- last lines of {child.log_path} ---\n{tail}"
    return text


def wait_ready(checks: Sequence[tuple[str, Callable[[], bool]]], children: Sequence[stack.Child]) -> None:
    for what, check in checks:
        try:
            stack.wait_until(what, check, timeout=READY_TIMEOUT, children=children)
        except stack.ChildExited as e:
            raise StartupError(f"{_exit_message(e.child)}\n(while waiting for {what})") from None
        except TimeoutError as e:
            tails = "".join(
                f"\n--- {c.name} ({c.log_path}) ---\n{c.tail(10)}" for c in children if c.tail(10)
            )
            raise StartupError(f"{e}{tails}") from None


class _Supervised:
    """Processes started by ``start()`` in ``stack``, all stopped on leaving (or a failed start)."""

    stack: Stack

    def start(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stack.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()


class Backends(_Supervised):
    """The model servers every target routes to: one static Envoy, or ``epp sim`` processes."""

    def __init__(self, kind: str, count: int, workdir: Path) -> None:
        self.kind = kind
        self.ports = free_ports(count)
        self.stack = stack.Stack(workdir, ready_timeout=READY_TIMEOUT)
        self.workdir = workdir

    @property
    def children(self) -> list[stack.Child]:
        return self.stack.children

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.kind == "static":
            admin = free_ports(1)[0]
            self.stack.start_envoy("backend-envoy", backend_bootstrap(self.ports, admin), concurrency=1)
            checks = [("backend Envoy", http_ok(f"http://127.0.0.1:{admin}/ready"))]
            checks += [(f"backend :{p}", http_ok(f"http://127.0.0.1:{p}/metrics")) for p in self.ports]
        else:
            for i, port in enumerate(self.ports):
                self.stack.start_sim(f"sim-{i}", port, model=MODEL, args=SIM_ARGS)
            checks = [(f"sim :{p}", http_ok(f"http://127.0.0.1:{p}/health")) for p in self.ports]
        wait_ready(checks, self.children)

    def describe(self) -> str:
        where = ", ".join(f"127.0.0.1:{p}" for p in self.ports)
        if self.kind == "static":
            return f"{len(self.ports)} direct_response listeners of one Envoy (--concurrency 1): {where}"
        return f"{len(self.ports)} epp sim processes: {where}"


def extract_baseline(ref: str, dest: Path) -> Path:
    """The ``epp`` package of git ``ref`` of this repository, unpacked under ``dest``."""
    repo = Path(__file__).resolve().parent.parent
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", ref, "epp"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise StartupError(f"--baseline {ref}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def baseline_argv(src: Path, grpc_port: int, health_port: int, metrics_port: int, config: Any) -> list[str]:
    """``epp serve`` of the baseline tree ``src`` (imported before the installed package)."""
    argv = stack.serve_argv(
        grpc_port=grpc_port,
        health_port=health_port,
        metrics_port=metrics_port,
        config_text=yaml.safe_dump(dict(config), sort_keys=False),
    )
    code = (
        f"import runpy, sys; sys.path.insert(0, {str(src)!r}); runpy.run_module('epp', run_name='__main__')"
    )
    return [sys.executable, "-c", code, *argv[3:]]  # argv[:3]: python -m epp


class Target(_Supervised):
    """The measured ext_proc server (``epp``; ``stub`` on grpc.aio, ``stub-h2`` on epp's gRPC
    server; or ``base``: the EPP of ``--baseline``) behind its own front Envoy."""

    def __init__(
        self,
        kind: str,
        exchange: str,
        backends: Backends,
        workdir: Path,
        body: bytes,
        front_concurrency: int,
        response: str = "shipped",
        baseline_src: Path | None = None,
        transport: str = "socket",
        epp_args: Sequence[str] = (),
    ) -> None:
        self.kind = kind
        self.epp_args = list(epp_args)  # extra ``epp serve`` flags of kind "epp"
        # Envoy calls the target on a Unix socket in the generated layouts (not the baseline's EPP,
        # which may predate --grpc-socket), else over TCP
        use_socket = transport == "socket" and exchange not in GATEWAY_EXCHANGES and kind != "base"
        self.baseline_src = baseline_src  # kind "base": the source tree whose EPP runs
        self.mode, self.response_header_mode = EXCHANGES[exchange]
        self.backends = backends
        self.workdir = workdir
        self.body = body
        self.front_concurrency = front_concurrency
        self.response = response
        self.port, self.admin_port, self.grpc_port, self.health_port, self.metrics_port = free_ports(5)
        self.socket = stack.epp_socket(self.grpc_port) if use_socket else ""
        self.stack = stack.Stack(workdir, ready_timeout=READY_TIMEOUT)
        self.server: stack.Child | None = None
        self.envoy: stack.Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{PATH}"

    @property
    def children(self) -> list[stack.Child]:
        return [*self.stack.children, *self.backends.children]

    def alive(self) -> None:
        check_alive(self.children)

    def exchange_counters(self) -> tuple[int, int, int, int]:
        """Envoy's (messages to the EPP, messages from it, bytes to it, bytes from it) so far."""
        url = f"http://127.0.0.1:{self.admin_port}/stats?filter=ext_proc"
        with urllib.request.urlopen(url, timeout=5.0) as resp:
            text = resp.read().decode()
        stats: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                stats[name] = int(value)
        prefix = "http.inference.ext_proc."
        cluster = "cluster.ext_proc."
        return (
            stats.get(prefix + "stream_msgs_sent", 0),
            stats.get(prefix + "stream_msgs_received", 0),
            stats.get(cluster + "upstream_cx_tx_bytes_total", 0),
            stats.get(cluster + "upstream_cx_rx_bytes_total", 0),
        )

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        checks: list[tuple[str, Callable[[], bool]]]
        if self.kind in ("epp", "base"):
            endpoints = self.workdir / "endpoints.yaml"
            stack.write_endpoints(endpoints, self.backends.ports)
            if self.kind == "epp":
                self.server = self.stack.start_epp(
                    "epp",
                    grpc_port=self.grpc_port,
                    health_port=self.health_port,
                    metrics_port=self.metrics_port,
                    config=stack.epp_config(endpoints),
                    extra=(["--grpc-socket", self.socket] if self.socket else []) + self.epp_args,
                )
            else:
                assert self.baseline_src is not None
                self.server = self.stack.supervisor.start(
                    "base",
                    baseline_argv(
                        self.baseline_src,
                        self.grpc_port,
                        self.health_port,
                        self.metrics_port,
                        stack.epp_config(endpoints),
                    ),
                )
            checks = [("EPP readiness", lambda: stack.grpc_serving(self.health_port))]
        else:
            destination = f"127.0.0.1:{self.backends.ports[0]}"
            argv = [
                sys.executable,
                str(STUB_SCRIPT),
                "--port",
                str(self.grpc_port),
                "--destination",
                destination,
                "--socket",
                self.socket,
                "--server",
                "h2grpc" if self.kind == "stub-h2" else "grpc",
            ]
            self.server = self.stack.supervisor.start("stub", argv)
            checks = [("ext_proc stub", lambda: stack.port_in_use(self.grpc_port))]
        bootstrap = envoy_config.envoy_bootstrap(
            listen_port=self.port,
            admin_port=self.admin_port,
            extproc_port=self.grpc_port,
            extproc_socket=self.socket,
            body_mode=self.mode,
            response_header_mode=self.response_header_mode,
        )
        response_exchange(bootstrap, self.response)
        self.envoy = self.stack.start_envoy("envoy", bootstrap, concurrency=self.front_concurrency)
        checks += [
            ("front Envoy", http_ok(f"http://127.0.0.1:{self.admin_port}/ready")),
            (f"POST {PATH} through Envoy", post_ok(self.url, self.body)),
        ]
        wait_ready(checks, self.children)


# ------------------------------------------------------------------------------------------ bench


@dataclass
class RunResult:
    rps: float
    cpu_us: float  # the target's CPU per completed request
    net_us: float  # the same minus its idle rate over the run
    envoy_us: float  # the front Envoy's
    backend_us: float  # all backend processes'
    completed: int
    errors: int
    steal: float  # % of the machine's CPU time the hypervisor took during the run
    msgs_in: float  # ext_proc messages Envoy sent to the target, per request
    msgs_out: float  # and received from it
    bytes_in: float  # bytes on the ext_proc connection to the target, per request
    bytes_out: float  # and from it (echoed bodies show here)


@dataclass
class Summary:
    rps: float
    cpu_us: float
    net_us: float
    errors: int
    msgs_in: float
    msgs_out: float
    bytes_in: float
    bytes_out: float

    @classmethod
    def of(cls, results: Sequence[RunResult]) -> Summary:
        med = statistics.median
        return cls(
            med(r.rps for r in results),
            med(r.cpu_us for r in results),
            med(r.net_us for r in results),
            sum(r.errors for r in results),
            med(r.msgs_in for r in results),
            med(r.msgs_out for r in results),
            med(r.bytes_in for r in results),
            med(r.bytes_out for r in results),
        )


@dataclass(frozen=True)
class Workload:
    name: str  # chat / agentic
    body: bytes
    body_file: Path
    requests: int


class _Measured:
    """One running target of a workload, measured run by run (see ``bench_workload``)."""

    def __init__(self, target: Target, label: str, loadgen: LoadGenerator, backends: Backends) -> None:
        self.target = target
        self.label = label
        self.loadgen = loadgen
        self.backends = backends
        self.idle = 0.0
        self.results: list[RunResult] = []

    def prepare(self, args: argparse.Namespace, workload: Workload) -> None:
        target = self.target
        assert target.server is not None
        requests = workload.requests
        print(f"  {self.label} load: {shlex.join(self.loadgen.argv(target.url, requests))}", flush=True)
        if args.warmup > 0:
            self.loadgen.run(
                target.url, max(args.warmup * requests // max(args.requests, 1), 50), target.alive
            )
        self.idle = idle_cpu_rate(target.server.pid, args.idle_seconds)
        print(f"  {self.label} idle CPU (background work): {self.idle * 100:.1f} % of a core", flush=True)

    def run(self, requests: int) -> None:
        target, backends = self.target, self.backends
        assert target.server is not None and target.envoy is not None
        server, envoy = target.server.pid, target.envoy.pid
        c0 = target.exchange_counters()
        t0 = time.monotonic()
        s0, e0, b0 = cpu_seconds(server), cpu_seconds(envoy), total_cpu_seconds(backends.pids)
        steal0, ticks0 = machine_ticks()
        res = self.loadgen.run(target.url, requests, target.alive)
        s1, e1, b1 = cpu_seconds(server), cpu_seconds(envoy), total_cpu_seconds(backends.pids)
        steal1, ticks1 = machine_ticks()
        wall = time.monotonic() - t0
        c1 = target.exchange_counters()
        target.alive()
        n = max(res.completed, 1)
        per = [(after - before) / n for before, after in zip(c0, c1, strict=True)]
        result = RunResult(
            res.rps,
            (s1 - s0) / n * 1e6,
            max(s1 - s0 - self.idle * wall, 0.0) / n * 1e6,
            (e1 - e0) / n * 1e6,
            (b1 - b0) / n * 1e6,
            res.completed,
            res.errors,
            (steal1 - steal0) / max(ticks1 - ticks0, 1) * 100,
            *per,
        )
        self.results.append(result)
        print(
            f"  {self.label} run {len(self.results)}: {result.rps:7.0f} req/s   {target.kind} "
            f"{result.cpu_us:5.0f} µs/req ({result.net_us:.0f} above idle)   front Envoy "
            f"{result.envoy_us:4.0f}   backends {result.backend_us:4.0f} µs/req   messages "
            f"{result.msgs_in:.1f}+{result.msgs_out:.1f}, bytes {result.bytes_in:.0f} / "
            f"{result.bytes_out:.0f} per request  ({res.completed} ok, {res.errors} errors, "
            f"{res.seconds:.1f} s, steal {result.steal:.0f} %)",
            flush=True,
        )


def bench_workload(
    targets: Sequence[tuple[str, str]],
    args: argparse.Namespace,
    backends: Backends,
    workload: Workload,
    workdir: Path,
) -> dict[tuple[str, str], list[RunResult]]:
    """Every (exchange, kind) target of one workload runs side by side; the runs go round-robin
    over them, so that each round compares them under the same machine load."""
    with contextlib.ExitStack() as stack_:
        measured: dict[tuple[str, str], _Measured] = {}
        for exchange, kind in targets:
            target_dir = workdir / workload.name / exchange / kind
            loadgen = LoadGenerator(args.tool, workload.body_file, args.concurrency, target_dir)
            target = stack_.enter_context(
                Target(
                    kind,
                    exchange,
                    backends,
                    target_dir,
                    workload.body,
                    args.front_concurrency,
                    args.response,
                    baseline_src=args.baseline_src,
                    transport=args.transport,
                    epp_args=args.epp_arg,
                )
            )
            label = f"{workload.name:<7} {exchange:<25} {kind:<4}"
            measured[(exchange, kind)] = _Measured(target, label, loadgen, backends)
        for m in measured.values():
            m.prepare(args, workload)
        for _ in range(args.runs):
            for m in measured.values():
                m.run(workload.requests)
        return {key: m.results for key, m in measured.items()}


# workload, exchange, EPP, stub on grpc.aio, stub on epp's gRPC server (h2grpc)
Row = tuple[str, str, Summary, Summary | None, Summary | None]


def _size(n: float) -> str:
    return f"{n / 1000:.0f} KB" if n >= 10_000 else f"{n:.0f} B"


def _via(exchange: str, transport: str) -> str:
    return "unix" if transport == "socket" and exchange not in GATEWAY_EXCHANGES else "tcp"


def print_table(
    rows: Sequence[Row],
    runs: int,
    backend: str,
    nproc: int,
    base: dict[str, Summary],
    ref: str = "",
    base_exchange: str = BASELINE,
    transport: str = "socket",
) -> None:
    print(
        f"\nmedian of {runs} runs, {backend} backends, nproc {nproc} (CPU: utime+stime per completed "
        "request; messages: to the EPP + from it, counted by Envoy; bytes: on the ext_proc connection)"
    )
    header = (
        f"{'body':<8}{'exchange':<27}{'via':<5}{'msgs/req':>10}{'bytes to EPP':>13}{'bytes back':>12}"
        f"{'EPP µs/req':>11}{'x FD':>6}{'stub µs/req':>12}{'EPP/stub':>9}{'EPP req/s':>10}{'stub req/s':>11}"
        f"{'h2 stub µs':>11}{'EPP/h2 stub':>12}"
    )
    print(header)
    baseline = {w: epp.cpu_us for w, x, epp, _, _ in rows if x == BASELINE}
    for workload, exchange, epp, stub, h2_stub in rows:
        ratio = epp.cpu_us / baseline[workload] if baseline.get(workload) else float("nan")
        line = (
            f"{workload:<8}{exchange:<27}{_via(exchange, transport):<5}"
            f"{f'{epp.msgs_in:.0f}+{epp.msgs_out:.0f}':>10}"
            f"{_size(epp.bytes_in):>13}{_size(epp.bytes_out):>12}{epp.cpu_us:>11.0f}{ratio:>6.2f}"
        )
        if stub is None:
            line += f"{'-':>12}{'-':>9}{epp.rps:>10.0f}{'-':>11}"
        else:
            line += f"{stub.cpu_us:>12.0f}{epp.cpu_us / stub.cpu_us:>9.2f}{epp.rps:>10.0f}{stub.rps:>11.0f}"
        if h2_stub is not None:
            line += f"{h2_stub.cpu_us:>11.0f}{epp.cpu_us / h2_stub.cpu_us:>12.2f}"
        print(line)
    for workload, summary in base.items():
        ratios = ", ".join(
            f"{exchange} {epp.cpu_us / summary.cpu_us:.2f}x"
            for w, exchange, epp, _, _ in rows
            if w == workload
        )
        print(
            f"{workload:<8}baseline {ref} ({base_exchange}, tcp): {summary.cpu_us:.0f} µs/req, "
            f"{summary.rps:.0f} req/s; this EPP relative to it: {ratios}"
        )
    errors = sum(epp.errors + sum(s.errors for s in stubs if s is not None) for _, _, epp, *stubs in rows)
    errors += sum(summary.errors for summary in base.values())
    if errors:
        print(f"warning: {errors} failed requests during the measured runs (see the per-run lines)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("-n", "--requests", type=int, default=4000, help="requests per run, chat bodies (default 4000)")
    add(
        "--agentic-requests",
        type=int,
        default=600,
        help="requests per run, agentic bodies (default 600)",
    )
    add("-c", "--concurrency", type=int, default=32, help="concurrent connections (default 32)")
    add(
        "-r",
        "--runs",
        type=int,
        default=3,
        help="rounds; each runs every target once, all targets up side by side; the median is reported (3)",
    )
    add("--warmup", type=int, default=500, help="requests before measuring, chat (default 500; scaled)")
    add(
        "--idle-seconds",
        type=float,
        default=2.0,
        help="idle CPU of the target measured before its runs (default 2 s)",
    )
    add(
        "--backend",
        choices=["static", "sim"],
        default="static",
        help="static: direct_response listeners of one Envoy (default); sim: epp sim processes",
    )
    add("--backends", "--sims", dest="backends", type=int, default=3, help="number of backends (default 3)")
    add(
        "--with-stub",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure bench/extproc_stub.py behind the same Envoy front, on grpc.aio and on epp's "
        "gRPC server (default on)",
    )
    add(
        "--front-concurrency",
        type=int,
        default=0,
        help="front Envoy --concurrency (default: Envoy's own, one worker per CPU)",
    )
    add("--body-bytes", type=int, default=1024, help="chat request body size (default 1024)")
    add("--agentic-bytes", type=int, default=800_000, help="agentic request body size (default 800000)")
    add(
        "--bodies",
        nargs="+",
        default=["chat", "agentic"],
        choices=["chat", "agentic"],
        help="workloads (default both)",
    )
    add(
        "--response",
        choices=RESPONSE_EXCHANGES,
        default="shipped",
        help="response side of the ext_proc exchange (default: the generated bootstrap's)",
    )
    add(
        "--exchanges",
        "--modes",
        dest="exchanges",
        nargs="+",
        default=list(EXCHANGES),
        choices=list(EXCHANGES),
        help="ext_proc exchanges (request body mode, response headers; default all)",
    )
    add(
        "--tool",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="load generator (default: wrk if on PATH)",
    )
    add(
        "--epp-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra `epp serve` flag for the measured EPP (repeatable), "
        "e.g. --epp-arg=--extproc-server=grpcio",
    )
    add(
        "--baseline",
        metavar="GIT_REF",
        default="",
        help="also measure the EPP of this git commit, side by side (e.g. the code an issue's figures "
        "were taken on), in --baseline-exchange; its epp/ is unpacked with git archive",
    )
    add(
        "--baseline-exchange",
        default=BASELINE,
        choices=list(EXCHANGES),
        help=f"the exchange the --baseline EPP is measured in (default {BASELINE})",
    )
    add(
        "--transport",
        choices=["socket", "tcp"],
        default="socket",
        help="socket (default): Envoy calls the EPP and the stub on a Unix socket in the exchanges epp "
        f"generates, over TCP in the gateways' ({', '.join(GATEWAY_EXCHANGES)}); tcp: TCP in all",
    )
    add("--keep-logs", action="store_true", help="keep the work directory (logs, configs) on success")
    args = parser.parse_args(argv)
    if args.backends < 1 or args.requests < 1 or args.runs < 1 or args.agentic_requests < 1:
        parser.error("--backends, --requests, --agentic-requests and --runs must be at least 1")
    if args.tool == "auto":
        args.tool = "wrk" if shutil.which("wrk") else "python"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--loadgen"]:
        return loadgen_main(argv[1:])
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    workloads = []
    for name in args.bodies:
        body = chat_body(args.body_bytes) if name == "chat" else agentic_body(args.agentic_bytes)
        body_file = workdir / f"{name}.json"
        body_file.write_bytes(body)
        requests = args.requests if name == "chat" else args.agentic_requests
        workloads.append(Workload(name, body, body_file, requests))
    nproc = cpu_count()
    targets = ["epp", "stub", "stub-h2"] if args.with_stub else ["epp"]
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    sizes = ", ".join(f"{w.name} {len(w.body)} bytes x {w.requests} requests" for w in workloads)
    print(
        f"nproc: {nproc}; {args.runs} runs per workload, exchange and target ({', '.join(targets)}), "
        f"{args.concurrency} connections, {sizes}, load generator: {args.tool}, work dir: {workdir}",
        flush=True,
    )
    rows: list[Row] = []
    base: dict[str, Summary] = {}
    args.baseline_src = None

    def run() -> int:
        if args.baseline:
            args.baseline_src = extract_baseline(args.baseline, workdir / "baseline")
        with Backends(args.backend, args.backends, workdir / "backends") as backends:
            print(f"backends: {backends.describe()}", flush=True)
            for workload in workloads:
                pairs = [(exchange, kind) for exchange in args.exchanges for kind in targets]
                if args.baseline:
                    pairs.append((args.baseline_exchange, "base"))
                results = bench_workload(pairs, args, backends, workload, workdir)
                if args.baseline:
                    base[workload.name] = Summary.of(results[(args.baseline_exchange, "base")])
                for exchange in args.exchanges:
                    stub, h2_stub = results.get((exchange, "stub")), results.get((exchange, "stub-h2"))
                    rows.append(
                        (
                            workload.name,
                            exchange,
                            Summary.of(results[(exchange, "epp")]),
                            Summary.of(stub) if stub else None,
                            Summary.of(h2_stub) if h2_stub else None,
                        )
                    )
        return 0

    return run_in_workdir(
        workdir,
        run,
        errors=(StartupError, RuntimeError, TimeoutError, OSError, subprocess.SubprocessError),
        keep_logs=args.keep_logs,
        report=lambda: print_table(
            rows, args.runs, args.backend, nproc, base, args.baseline, args.baseline_exchange, args.transport
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
