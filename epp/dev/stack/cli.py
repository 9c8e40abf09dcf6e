"""``epp run``: the local stack in the foreground.

Starts N ``epp sim`` (127.0.0.1:8000..), ``epp serve`` (ext_proc on a Unix socket for Envoy and
9002, health 9003, metrics 9090) and Envoy (8081, admin 19000), every one on 127.0.0.1 only, waits
until ``GET /v1/models`` through Envoy answers 200, prints how to use it and supervises: a
simulator that exits is restarted on its port (backoff, a bounded number of times); the EPP or
Envoy exiting, or a simulator over its budget, stops everything (exit 1). Ctrl-C or SIGTERM stops
every process it started (exit 0). ``--replicas N``: N ``epp serve`` (replica i on each port + 100i)
sharing their routing state through a private ``redis-server`` on a free port, Envoy's ext_proc
cluster spread over them with health checks; a replica or Redis that exits is restarted.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from epp.dev.envoy.bootstrap import DEFAULT_BODY_MODE
from epp.dev.stack import engines
from epp.dev.stack.files import precise_config, uses_kv_events, vllm_engines_config
from epp.dev.stack.local import LocalStack, StackOptions
from epp.dev.stack.pd import PDStack
from epp.dev.stack.probes import READY_TIMEOUT, Interrupted
from epp.dev.stack.supervisor import SIM_MAX_RESTARTS, SIM_RESTART_WINDOW, Child, ChildExited


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``epp run``."""
    add = parser.add_argument
    add("--sims", type=int, default=3, help="number of simulated vLLM servers (default 3)")
    add(
        "--pools",
        type=_positive_int,
        default=1,
        help="pools (default 1); above 1 the simulators are split round robin into pool-1..N served "
        "by the one EPP, each pool behind its own Envoy virtual host (curl -H 'Host: pool-1' ...)",
    )
    add("--sim-base-port", type=int, default=8000, help="port of the first simulator (default 8000)")
    add("--model", default="demo", help="model name the simulators serve (default demo)")
    add(
        "--sim-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra flag for every simulator (--sim-arg --max-num-seqs=2, or --sim-arg=--max-num-seqs=2); "
        "repeat it for several",
    )
    add(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="what --sims starts: epp sim (default) or real vLLM engines from `make engines` (the tiny "
        "model; prefix caching, KV events on --kv-events ports, default 5557; routed on them)",
    )
    add(
        "--endpoints",
        default="",
        metavar="URL[,URL...]",
        help="put the stack in front of engines already running (http://host:port, comma-separated) "
        "instead of starting any",
    )
    add("--port", type=int, default=8081, help="Envoy listener port (default 8081)")
    add("--admin-port", type=int, default=19000, help="Envoy admin port (default 19000)")
    add("--grpc-port", type=int, default=9002, help="EPP ext_proc port (default 9002)")
    add("--grpc-health-port", type=int, default=9003, help="EPP gRPC health port (default 9003)")
    add("--metrics-port", type=int, default=9090, help="EPP metrics port (default 9090)")
    add(
        "--replicas",
        type=_positive_int,
        default=1,
        help="EPP replicas (default 1); above 1 they share their routing state through a private "
        "redis-server (the redis-syncer, merged into --config-file) and Envoy's ext_proc cluster is "
        "spread over them with health checks; replica i listens on --grpc-port, --grpc-health-port "
        "and --metrics-port + 100i",
    )
    add(
        "--redis-port",
        type=_non_negative_int,
        default=0,
        help="with --replicas above 1: the private redis-server's port on 127.0.0.1 (default 0: a free one)",
    )
    add(
        "--body-mode",
        choices=("BUFFERED", "FULL_DUPLEX_STREAMED", "STREAMED"),
        default=DEFAULT_BODY_MODE,
        help=f"ext_proc request body mode (default {DEFAULT_BODY_MODE}, the leanest exchange; "
        "FULL_DUPLEX_STREAMED is what gateways configure); the response phases follow the "
        "--config-file plugins",
    )
    add("--fail-open", action="store_true", help="Envoy forwards to the simulators when the EPP is down")
    add(
        "--config-file",
        default=None,
        help="EndpointPickerConfig for the EPP (the file-discovery plugin is injected)",
    )
    add(
        "--epp-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra flag for epp serve (--epp-arg --log-level=debug, or --epp-arg=--log-level=debug); "
        "repeat it for several",
    )
    add("--envoy-log-level", default="warning", help="Envoy --log-level (default warning)")
    add(
        "--sim-max-restarts",
        type=_non_negative_int,
        default=SIM_MAX_RESTARTS,
        help=f"restarts of one simulator allowed within --sim-restart-window; one more exit stops the"
        f" stack; 0 never restarts (default {SIM_MAX_RESTARTS})",
    )
    add(
        "--sim-restart-window",
        type=_positive_float,
        default=SIM_RESTART_WINDOW,
        metavar="SECONDS",
        help=f"window of --sim-max-restarts (default {SIM_RESTART_WINDOW:g})",
    )
    add(
        "--kv-events",
        type=int,
        nargs="?",
        const=5557,
        default=0,
        metavar="BASE_PORT",
        help="the simulators publish vLLM KV events: simulator i on BASE_PORT + 2i, its replay socket on"
        " BASE_PORT + 2i + 1 (default base 5557), announced to the EPP as endpoint labels; without"
        " --config-file the EPP routes on them (precise-prefix-cache-producer with the simulators'"
        " tokenizer, epp-bpe-8k)",
    )
    add(
        "--response-phases",
        action="store_true",
        help="Envoy also sends the EPP the response headers and body, so that the response metrics "
        "(TTFT, TPOT/ITL, token counts, response sizes) get samples (a streamed completion's TPOT "
        "and token counts only with the client's stream_options.include_usage); costs ext_proc "
        "messages per response chunk (default: only what the loaded plugins read)",
    )
    add(
        "--pd",
        type=_positive_int,
        nargs="?",
        const=1,
        default=0,
        metavar="PREFILL_SIMS",
        help="prefill/decode disaggregation: the first PREFILL_SIMS simulators (default 1) prefill, the "
        "others decode, each behind an epp pd-sidecar (on the ports after the simulators'); the EPP "
        "runs the P/D example config (deploy/kubernetes/pd/) unless --config-file is given",
    )
    add("--keep-workdir", action="store_true", help="keep the temporary directory (logs) on exit")
    parser.epilog = (
        "Supervision: a simulator that exits on its own is started again on its port after a backoff "
        "(0.5 s, doubling up to 8 s) while the others keep serving; each restart is logged on stderr. "
        "If one simulator exits more than --sim-max-restarts times within --sim-restart-window seconds, "
        "or if the EPP or Envoy exits (they are not restarted), every process is stopped and epp run "
        "exits with status 1. With --replicas above 1 an EPP replica or the redis-server that exits is "
        "restarted like a simulator (the other replicas serve meanwhile; Redis comes back empty and "
        "the replicas refill it). Ctrl-C or SIGTERM stops everything (status 0)."
    )


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (``what`` names it in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what} integer")
        return value

    return parse


_non_negative_int = _int_at_least(0, "non-negative")
_positive_int = _int_at_least(1, "positive")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number") from None
    if not value > 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def options_from_args(args: argparse.Namespace) -> StackOptions:
    config = None
    if args.config_file:
        try:
            loaded = yaml.safe_load(Path(args.config_file).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"error: --config-file {args.config_file}: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise SystemExit(f"error: --config-file {args.config_file}: not a YAML mapping")
        config = loaded
    endpoints = _endpoints(args.endpoints)
    if args.engine == "vllm" and not endpoints:
        why = engines.missing()
        if why:
            raise SystemExit(f"error: --engine vllm: {why}")
        args.kv_events = args.kv_events or 5557
        if config is None:
            config = vllm_engines_config(str(engines.tiny_model()), engines.VLLM_BLOCK_SIZE)
    if args.kv_events and endpoints:
        raise SystemExit(
            "error: --kv-events starts publishers on the stack's engines; --endpoints starts none"
        )
    if args.kv_events and config is None:
        config = precise_config()  # the events are what --kv-events is for: route on them
    elif args.kv_events and config is not None and not uses_kv_events(config):
        print(
            f"warning: --kv-events: {args.config_file} has no precise-prefix-cache-producer, so the "
            "simulators' KV events are published but not used for routing (without --config-file, "
            "epp run routes on them)",
            file=sys.stderr,
        )
    return StackOptions(
        sims=0 if endpoints else args.sims,
        engine=args.engine,
        endpoints=endpoints,
        ready_timeout=VLLM_READY_TIMEOUT if args.engine == "vllm" else READY_TIMEOUT,
        sim_base_port=args.sim_base_port,
        model=args.model,
        sim_args=list(args.sim_arg),
        port=args.port,
        admin_port=args.admin_port,
        grpc_port=args.grpc_port,
        health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        body_mode=args.body_mode,
        fail_open=args.fail_open,
        config=config,
        epp_args=list(args.epp_arg),
        envoy_log_level=args.envoy_log_level,
        sim_max_restarts=args.sim_max_restarts,
        sim_restart_window=args.sim_restart_window,
        kv_events_base_port=args.kv_events,
        response_phases=args.response_phases,
        replicas=args.replicas,
        redis_port=args.redis_port,
        pools=args.pools,
    )


# vLLM loads torch and warms up for a minute or more on a busy machine.
VLLM_READY_TIMEOUT = 600.0


def _endpoints(text: str) -> list[str]:
    """``host:port`` of each ``http://host:port`` (or bare ``host:port``) of ``--endpoints``."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parsed = urllib.parse.urlsplit(item if "://" in item else f"http://{item}")
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port or parsed.path not in ("", "/"):
            raise SystemExit(f"error: --endpoints: {item!r} is not http://host:port")
        out.append(f"{parsed.hostname}:{parsed.port}")
    return out


class _Stop:
    """SIGINT/SIGTERM set a flag instead of raising inside the supervision loop.

    The handler only assigns an attribute: it takes no lock. CPython runs a handler at the next
    bytecode boundary, also inside a running handler, so a second signal (Ctrl-C twice, or
    ``timeout`` signalling both the process and its group) that arrived while a handler held a
    ``threading.Event``'s lock would deadlock ``epp run`` with its children still up.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def is_set(self) -> bool:
        return self.signal is not None

    def wait(self, timeout: float) -> bool:
        """Whether a stop signal came, sleeping up to ``timeout`` first if none has yet."""
        if self.signal is None:
            time.sleep(timeout)
        return self.signal is not None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal = signum


def _epps(stack: LocalStack) -> str:
    o = stack.opts
    if o.replicas == 1:
        (e,) = o.epps()
        return f"""  EPP        ext_proc unix:{e.socket} (Envoy's) and 127.0.0.1:{e.grpc}
             health 127.0.0.1:{e.health}, metrics http://127.0.0.1:{e.metrics}/metrics"""
    lines = [
        f"  EPPs       {o.replicas} replicas, all serving: Envoy spreads ext_proc streams over them "
        "(health-checked)"
    ]
    for child, e in zip(stack.epps, o.epps(), strict=True):
        lines.append(
            f"    {child.name:<8} ext_proc unix:{e.socket} and 127.0.0.1:{e.grpc}, health "
            f"127.0.0.1:{e.health}, metrics http://127.0.0.1:{e.metrics}/metrics"
        )
    if o.shares_state:
        lines.append(
            f"  Redis      {stack.redis_address}  (private redis-server, no persistence: the replicas' "
            "shared state, redis-syncer)"
        )
    return "\n".join(lines)


def _usage(stack: LocalStack) -> str:
    o = stack.opts
    sims = ", ".join(o.upstreams)
    restarted = "A simulator" if o.replicas == 1 else "A simulator, EPP replica or Redis"
    fatal = "the EPP or Envoy exiting" if o.replicas == 1 else "Envoy exiting"
    return f"""
epp stack ready ({o.body_mode}, fail-{"open" if o.fail_open else "closed"}{_routing(o)})
  Envoy      {stack.url}  (admin http://127.0.0.1:{o.admin_port})
{_epps(stack)}
  {_kind(o):<10} {sims}  (model {o.model!r})
  endpoints  {stack.endpoints_file}  (edit it to add or remove endpoints){_pools(o)}
  config     {stack.config_file}  (the EPP's config: edits apply without a restart)
  logs       {stack.supervisor.log_dir}

Try:
  curl -s {stack.url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{o.model}","messages":[{{"role":"user","content":"Hello!"}}]}}'
  curl -s -N {stack.url}/v1/completions -H 'content-type: application/json' \\
       -d '{{"model":"{o.model}","prompt":"Hello","stream":true}}'

{restarted} that exits is restarted (at most {o.sim_max_restarts} times in \
{o.sim_restart_window:g} s); {fatal} stops the stack.
Ctrl-C stops everything.
"""


def _kind(o: StackOptions) -> str:
    return "engines" if o.endpoints else ("vLLM" if o.engine == "vllm" else "simulators")


def _pools(o: StackOptions) -> str:
    if not o.pool_names:
        return ""
    return (
        f"\n  pools      {', '.join(o.pool_names)} (one EPP; send -H 'Host: pool-1' ... to choose one: "
        "a request naming no pool is a 404)"
    )


def _routing(o: StackOptions) -> str:
    if not o.kv_events_base_port:
        return ""
    if o.config is not None and uses_kv_events(o.config):
        return ", precise prefix routing on the simulators' KV events"
    return ", KV events published but not used for routing"


def main(args: argparse.Namespace) -> int:
    """Run the stack until Ctrl-C/SIGTERM (exit 0) or until a child's exit is fatal (exit 1).

    Simulators that exit are restarted (see :meth:`Supervisor.poll`); the EPP or Envoy exiting, or a
    simulator exceeding its restart budget, is fatal.
    """
    opts = options_from_args(args)
    workdir = Path(tempfile.mkdtemp(prefix="epp-run-"))
    try:
        stack = _pd_stack(opts, workdir, args.pd) if args.pd else LocalStack(opts, workdir)
    except ValueError as e:
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"error: --pd: {e}", file=sys.stderr)
        return 2
    stop = _Stop()
    stop.install()
    failed = False
    try:
        try:
            epps = "the EPP" if opts.replicas == 1 else f"{opts.replicas} EPP replicas, Redis"
            what = f"{opts.sims} {_kind(opts)}, " if opts.sims else ""
            print(f"starting {what}{epps} and Envoy (work dir {workdir}) ...", flush=True)
            stack.start(abort=stop.is_set)
        except Interrupted:
            return 0
        except ChildExited as e:
            failed = True
            return _report_exit(e.child)
        except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as e:
            failed = True
            print(f"error: {e}", file=sys.stderr)
            _print_tails(stack)
            return 1
        print(_usage(stack), flush=True)
        if isinstance(stack, PDStack):
            print(f"Prefill/decode disaggregation:\n{stack.roles()}\n", flush=True)
        while not stop.wait(0.2):
            child = stack.poll()
            if child is not None:
                failed = True
                return _report_exit(child)
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()
        stop.restore()
        if (failed and stack.supervisor.children) or args.keep_workdir:  # logs of what ran
            print(f"logs kept in {stack.supervisor.log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _pd_stack(opts: StackOptions, workdir: Path, prefill_sims: int) -> PDStack:
    return PDStack(opts, workdir, prefill_sims=prefill_sims)


def _report_exit(child: Child) -> int:
    print(f"error: {child.name} exited unexpectedly with status {child.returncode()}", file=sys.stderr)
    tail = child.tail()
    if tail:
        print(f"--- last lines of {child.log_path} ---\n{tail}", file=sys.stderr)
    return 1


def _print_tails(stack: LocalStack) -> None:
    for child in stack.supervisor.children:
        tail = child.tail(15)
        if tail:
            print(f"--- {child.name} ({child.log_path}) ---\n{tail}", file=sys.stderr)
