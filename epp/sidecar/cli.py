"""``epp pd-sidecar``: flags (the reference sidecar's names where one exists), environment, entry point."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Mapping

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.sidecar import connectors
from epp.sidecar.allowlist import AllowList, AllowListSource, from_file, from_pool
from epp.sidecar.metrics import SidecarMetrics
from epp.sidecar.proxy import Sidecar, SidecarConfig

log = structlog.get_logger("epp.sidecar")

_D = SidecarConfig()
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--port", type=_port, default=_D.port, help="listen port (default %(default)s)")
    add("--host", default=_D.host, help="listen address (default %(default)s)")
    add(
        "--vllm-port",
        "--model-server-port",
        dest="vllm_port",
        type=_port,
        default=8200,
        help="port of the local decode engine (default %(default)s)",
    )
    add("--decoder-host", default="127.0.0.1", help="host of the decode engine (default %(default)s)")
    add(
        "--connector",
        "--kv-connector",
        dest="connector",
        choices=connectors.CONNECTORS,
        default=_D.connector,
        help="KV transfer protocol between prefiller and decoder (default %(default)s)",
    )
    add(
        "--enable-ssrf-protection",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="call only prefill endpoints of the pool (InferencePool or --endpoints-file); others get 403",
    )
    add(
        "--enable-prefiller-sampling",
        type=_bool,
        nargs="?",
        const=True,
        default=os.environ.get("ENABLE_PREFILLER_SAMPLING", "").lower() in ("1", "true"),
        help="pick the prefill endpoint at random among those the header lists (default: the first)",
    )
    add(
        "--inference-pool",
        default=os.environ.get("INFERENCE_POOL", ""),
        metavar="[NAMESPACE/]NAME",
        help="the InferencePool whose pods are the allow-list (env INFERENCE_POOL, or "
        "INFERENCE_POOL_NAMESPACE and INFERENCE_POOL_NAME)",
    )
    add("--kubeconfig", default=None, help="kubeconfig (default: in-cluster, then KUBECONFIG)")
    add(
        "--endpoints-file",
        default="",
        metavar="PATH",
        help="the allow-list from an endpoints file (file-discovery's format), watched",
    )
    add("--metrics-port", type=_port, default=0, help="port of /metrics (0, the default: none)")
    add(
        "--prefill-timeout",
        type=_positive_float,
        default=_D.prefill_timeout,
        metavar="SECONDS",
        help="whole prefill exchange; beyond it the request is served decode-only (default %(default)s)",
    )
    add(
        "--connect-timeout",
        type=_positive_float,
        default=_D.connect_timeout,
        metavar="SECONDS",
        help="TCP connect to an engine (default %(default)s)",
    )
    add(
        "--decode-read-timeout",
        type=_positive_float,
        default=_D.decode_read_timeout,
        metavar="SECONDS",
        help="longest silence of the decode engine within a request (default %(default)s)",
    )
    add(
        "--sglang-bootstrap-port",
        type=_port,
        default=int(os.environ.get("SGLANG_BOOTSTRAP_PORT", connectors.DEFAULT_SGLANG_BOOTSTRAP_PORT)),
        help="bootstrap port of the SGLang prefill engines (env SGLANG_BOOTSTRAP_PORT; default %(default)s)",
    )
    add("--log-level", default="info", help="log level (default %(default)s)")


def pool_of(flag: str, environ: Mapping[str, str], namespace_file: str = NAMESPACE_FILE) -> tuple[str, str]:
    """``(namespace, name)`` of the InferencePool, ``("", "")`` when none is named.

    ``--inference-pool``/``INFERENCE_POOL`` as ``namespace/name`` or ``name``; else
    ``INFERENCE_POOL_NAME``. A missing namespace is ``INFERENCE_POOL_NAMESPACE``, ``POD_NAMESPACE``, the
    pod's own namespace, then ``default``.
    """
    namespace, _, name = flag.rpartition("/") if flag else ("", "", environ.get("INFERENCE_POOL_NAME", ""))
    if not name:
        return "", ""
    if not namespace:
        namespace = environ.get("INFERENCE_POOL_NAMESPACE") or environ.get("POD_NAMESPACE") or ""
    if not namespace:
        try:
            with open(namespace_file) as f:
                namespace = f.read().strip()
        except OSError:
            namespace = ""
    return namespace or "default", name


def config_of(args: argparse.Namespace) -> SidecarConfig:
    return SidecarConfig(
        host=args.host,
        port=args.port,
        decoder_url=f"http://{_bracketed(args.decoder_host)}:{args.vllm_port}",
        connector=args.connector,
        prefiller_sampling=args.enable_prefiller_sampling,
        prefill_timeout=args.prefill_timeout,
        connect_timeout=args.connect_timeout,
        decode_read_timeout=args.decode_read_timeout,
        sglang_bootstrap_port=args.sglang_bootstrap_port,
    )


def main(args: argparse.Namespace) -> int:
    from epp import logs

    logs.configure(args.log_level, "console")
    namespace, pool = pool_of(args.inference_pool, os.environ)
    if args.enable_ssrf_protection and not pool and not args.endpoints_file:
        raise SystemExit(
            "epp pd-sidecar: --enable-ssrf-protection needs the pool: --inference-pool (or "
            "INFERENCE_POOL_NAME) or --endpoints-file"
        )
    try:
        asyncio.run(_serve(config_of(args), args, namespace, pool))
    except KeyboardInterrupt:
        pass
    return 0


async def _serve(config: SidecarConfig, args: argparse.Namespace, namespace: str, pool: str) -> None:
    metrics = SidecarMetrics()
    allow: AllowList | None = None
    source: AllowListSource | None = None
    if args.enable_ssrf_protection:
        allow = AllowList()
        if args.endpoints_file:
            source = await from_file(allow, args.endpoints_file)
        else:
            source = await from_pool(allow, namespace, pool, args.kubeconfig)
    sidecar = Sidecar(config, allow=allow, metrics=metrics)
    runner = web.AppRunner(sidecar.app(), access_log=None)
    metrics_runner: web.AppRunner | None = None
    try:
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        if args.metrics_port:
            metrics_runner = web.AppRunner(_metrics_app(metrics), access_log=None)
            await metrics_runner.setup()
            await web.TCPSite(metrics_runner, config.host, args.metrics_port).start()
        await _run_until_signalled(config, args, source)
    finally:
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await runner.cleanup()
        if source is not None:
            await source.stop()


async def _run_until_signalled(
    config: SidecarConfig, args: argparse.Namespace, source: AllowListSource | None
) -> None:
    log.info(
        "pd-sidecar serving",
        port=config.port,
        decoder=config.decoder_url,
        connector=config.connector,
        ssrf_protection=source.description if source else "off",
        metrics_port=args.metrics_port or None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _metrics_app(metrics: SidecarMetrics) -> web.Application:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", handle)
    return app


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port in 0..65535")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value
