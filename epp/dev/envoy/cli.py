"""``python -m epp.dev.envoy``: print an Envoy bootstrap for the EPP, or regenerate the checked-in ones."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from epp.dev.envoy.bootstrap import (
    BODY_MODES,
    DEFAULT_BODY_MODE,
    HEADER_MODES,
    SDS_HEADER,
    EppTls,
    envoy_bootstrap,
    render,
    sds_files,
)
from epp.dev.envoy.exchange import modes_for_file
from epp.dev.envoy.reference import reference_files

_DESCRIPTION = "Envoy bootstrap generator for running Envoy in front of the EPP."


def main(argv: Sequence[str] | None = None, prog: str = "python -m epp.dev.envoy") -> int:
    """CLI: print a bootstrap, or regenerate the checked-in reference files with ``--write DIR``."""
    parser = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION)
    parser.add_argument("--write", metavar="DIR", help="write the reference bootstraps into DIR")
    parser.add_argument(
        "--listen-host", default="127.0.0.1", help="listener address (default 127.0.0.1; 0.0.0.0 in a pod)"
    )
    parser.add_argument("--listen-port", type=int, default=8081, help="listener port (default 8081)")
    parser.add_argument("--admin-port", type=int, default=19000, help="Envoy admin port (default 19000)")
    parser.add_argument("--extproc-host", default="127.0.0.1", help="the EPP address (default 127.0.0.1)")
    parser.add_argument("--extproc-port", type=int, default=9002, help="the EPP ext_proc port (default 9002)")
    parser.add_argument(
        "--extproc-socket",
        default="",
        metavar="PATH",
        help="call the EPP on this Unix socket (its --grpc-socket; Envoy in the EPP's pod) instead of "
        "--extproc-host:--extproc-port",
    )
    parser.add_argument(
        "--body-mode",
        choices=BODY_MODES,
        default=DEFAULT_BODY_MODE,
        help=f"request body mode (default {DEFAULT_BODY_MODE}; FULL_DUPLEX_STREAMED is the reference layout)",
    )
    parser.add_argument(
        "--config-file",
        metavar="FILE",
        help="the EPP's EndpointPickerConfig: the response phases follow its plugins (default: the "
        "default config's, i.e. none)",
    )
    parser.add_argument(
        "--response-header-mode",
        choices=HEADER_MODES,
        help="override: response headers to the EPP (default SEND: the EPP counts the failures that "
        "reach the client by their status, and response sizes; SKIP saves one message pair per request, "
        "and those errors then go uncounted)",
    )
    parser.add_argument(
        "--response-body-mode",
        choices=BODY_MODES,
        help="override: response body mode (default: STREAMED only if a loaded plugin reads bodies)",
    )
    parser.add_argument(
        "--fail-open",
        action="store_true",
        help="when the EPP is down or errs, Envoy still forwards (to --fallback-endpoint) instead of "
        "answering 500/503",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request to stdout")
    parser.add_argument(
        "--fallback-endpoint",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="with --fail-open, where requests go when the EPP cannot answer (repeat the flag for each)",
    )
    parser.add_argument(
        "--subset-hint-header",
        metavar="NAME",
        help="a request header whose value (ip:port,ip:port) becomes the subset hint: the EPP picks only "
        "among those endpoints",
    )
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument(
        "--tls",
        action="store_true",
        help="TLS to the EPP, accepting any certificate (the default: `epp serve` serves TLS with a "
        "self-signed certificate unless --secure-serving=false)",
    )
    transport.add_argument(
        "--plaintext",
        action="store_true",
        help="plain-text HTTP/2 to the EPP: for `epp serve --secure-serving=false` (as `epp run` starts it)",
    )
    parser.add_argument(
        "--tls-cert-dir",
        metavar="DIR",
        help="mutual TLS to the EPP: DIR holds ca.crt (the EPP's CA) and Envoy's tls.crt/tls.key",
    )
    parser.add_argument(
        "--tls-server-name", default="epp", help="SNI and DNS name the EPP's certificate carries"
    )
    parser.add_argument(
        "--tls-sds-dir",
        default="/etc/envoy",
        metavar="DIR",
        help="where the bootstrap finds the SDS files of --tls-cert-dir (default /etc/envoy)",
    )
    parser.add_argument(
        "--write-sds", metavar="DIR", help="also write the SDS files of --tls-cert-dir into DIR"
    )
    parser.add_argument(
        "--extproc-health-port",
        type=int,
        default=None,
        help="EPP gRPC health port to health-check (default: ext_proc port + 1 when --fail-open; 0 = off)",
    )
    parser.add_argument(
        "--no-failover",
        action="store_true",
        help="no retry of a request whose engine cannot be reached on the EPP's fallback endpoint, "
        "and no failed-attempt log to the EPP (passive health)",
    )
    parser.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME",
        help="one EPP for several pools: a virtual host per pool (Host: NAME) whose routes name the pool "
        "to the EPP (ext_proc gRPC metadata x-epp-pool); repeatable",
    )
    args = parser.parse_args(argv)
    if args.write:
        out = Path(args.write)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in reference_files().items():
            (out / name).write_text(text)
            print(f"wrote {out / name}")
        return 0
    modes = modes_for_file(args.config_file)
    tls: bool | EppTls = not args.plaintext
    if args.tls_cert_dir and args.plaintext:
        parser.error("--plaintext and --tls-cert-dir contradict each other")
    if args.tls_cert_dir:
        tls = EppTls(args.tls_cert_dir, args.tls_sds_dir, server_name=args.tls_server_name)
        if args.write_sds:
            out = Path(args.write_sds)
            out.mkdir(parents=True, exist_ok=True)
            for name, doc in sds_files(tls).items():
                (out / name).write_text(SDS_HEADER + render(doc))
    elif args.write_sds:
        parser.error("--write-sds needs --tls-cert-dir")
    sys.stdout.write(_transport_note(tls))
    sys.stdout.write(
        render(
            envoy_bootstrap(
                listen_host=args.listen_host,
                listen_port=args.listen_port,
                access_log=args.access_log,
                failover=not args.no_failover,
                admin_port=args.admin_port,
                extproc_host=args.extproc_host,
                extproc_port=args.extproc_port,
                body_mode=args.body_mode,
                response_body_mode=args.response_body_mode or modes.body,
                response_header_mode=args.response_header_mode or modes.header,
                fail_open=args.fail_open,
                fallback_endpoints=args.fallback_endpoint,
                subset_hint_header=args.subset_hint_header,
                tls=tls,
                extproc_health_port=args.extproc_health_port,
                extproc_socket=args.extproc_socket,
                pools=args.pool,
            )
        )
    )
    return 0


def _transport_note(tls: bool | EppTls) -> str:
    """A comment heading the bootstrap: which ``epp serve`` it connects to (none for mutual TLS,
    which names its certificates)."""
    if isinstance(tls, EppTls):
        return ""
    if tls:
        return (
            "# TLS to the EPP, any certificate accepted: epp serve's default (--secure-serving=true,\n"
            "# self-signed). For epp serve --secure-serving=false generate with --plaintext.\n"
        )
    return "# Plain text to the EPP: for epp serve --secure-serving=false (a TLS EPP refuses it).\n"
