"""``epp run --pd``: the local stack with prefill/decode disaggregation.

The first ``prefill_sims`` simulators run with ``--role prefill``, the others with ``--role decode``,
each decode simulator behind its own ``epp pd-sidecar`` (nixlv2, SSRF protection from the stack's
endpoints file). The EPP discovers the prefill simulators and the sidecars (as the decode endpoints,
labelled ``llm-d.ai/role``) and schedules with :data:`PD_CONFIG_YAML`, the P/D example shipped under
``deploy/kubernetes/pd/``. Envoy sends each request to a sidecar, which prefills on the endpoint the
EPP named and decodes on its simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from epp.dev.envoy.bootstrap import envoy_bootstrap
from epp.dev.envoy.exchange import RESPONSE_BODY_MODE, ResponseModes, modes_for_document
from epp.dev.stack.commands import python_argv
from epp.dev.stack.files import epp_config, write_endpoints
from epp.dev.stack.local import LocalStack, StackOptions
from epp.dev.stack.probes import epp_scraped, free_ports, grpc_serving, http_ok, port_in_use
from epp.dev.stack.supervisor import Child

ROLE_LABEL = "llm-d.ai/role"

# The P/D scheduling of the example (deploy/kubernetes/pd/kustomization.yaml puts the same document
# into the EPP's ConfigMap):
# requests whose uncached prompt is at least nonCachedTokens long are prefilled on a prefill
# endpoint, the others served decode-only; both profiles prefer cache hits, then short queues.
PD_CONFIG_YAML = """\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
- type: prefix-cache-scorer
- type: queue-scorer
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 256
- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: prefix-based-pd-decider
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
"""


def pd_config(non_cached_tokens: int | None = None) -> dict[str, Any]:
    """The example's EndpointPickerConfig, with the decider's threshold changed if given."""
    document: dict[str, Any] = yaml.safe_load(PD_CONFIG_YAML)
    if non_cached_tokens is not None:
        for plugin in document["plugins"]:
            if plugin["type"] == "prefix-based-pd-decider":
                plugin["parameters"]["nonCachedTokens"] = non_cached_tokens
    return document


def free_ports_except(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free ports of 127.0.0.1, none of ``taken`` (ports chosen, not yet bound)."""
    for _ in range(20):
        ports = free_ports(count)
        if not taken.intersection(ports):
            return ports
    raise RuntimeError(f"no {count} free ports outside {sorted(taken)}")


def sidecar_argv(
    port: int,
    decode_port: int,
    *,
    endpoints_file: Path | None = None,
    metrics_port: int = 0,
    extra: list[str] | None = None,
) -> list[str]:
    """``epp pd-sidecar`` on 127.0.0.1:``port`` before the engine on ``decode_port``; with
    ``endpoints_file``, SSRF protection allows that file's prefill endpoints only."""
    argv = python_argv(
        "pd-sidecar",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-port",
        str(decode_port),
        "--connector",
        "nixlv2",
        "--metrics-port",
        str(metrics_port),
        "--log-level",
        "warning",
    )
    if endpoints_file is not None:
        argv += ["--enable-ssrf-protection", "--endpoints-file", str(endpoints_file)]
    return [*argv, *(extra or [])]


@dataclass(frozen=True, slots=True)
class DecodeEndpoint:
    """One decode endpoint of the stack: its sidecar (what the EPP and Envoy see) and its engine."""

    name: str
    sidecar_port: int
    metrics_port: int
    engine_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sidecar_port}"


class PDStack(LocalStack):
    """:class:`LocalStack` with P/D: ``prefill_sims`` prefill simulators, the rest decode ones behind
    sidecars on ``sidecar_ports`` (default: the ports after the simulators'), the example's P/D
    config unless ``opts.config`` is given. One EPP; no KV-events or replicas."""

    def __init__(
        self,
        opts: StackOptions,
        workdir: Path,
        *,
        prefill_sims: int = 1,
        sidecar_ports: list[int] | None = None,
        sidecar_metrics_ports: list[int] | None = None,
    ) -> None:
        if not 1 <= prefill_sims < opts.sims:
            raise ValueError(
                "at least one prefill and one decode simulator are needed "
                f"({prefill_sims} prefill of {opts.sims} simulators)"
            )
        if opts.replicas != 1 or opts.kv_events_base_port:
            raise ValueError("P/D runs one EPP (no --replicas) without --kv-events")
        if opts.config is None:
            opts = replace(opts, config=pd_config())
        super().__init__(opts, workdir)
        self.prefill_sims = prefill_sims
        decode_count = opts.sims - prefill_sims
        ports = sidecar_ports or [opts.sim_base_port + opts.sims + i for i in range(decode_count)]
        metrics = sidecar_metrics_ports or free_ports_except(decode_count, {*opts.all_ports(), *ports})
        engines = opts.sim_ports[prefill_sims:]
        self.decoders = [
            DecodeEndpoint(f"decode-{i}", ports[i], metrics[i], engines[i]) for i in range(decode_count)
        ]
        self.sidecars: list[Child] = []

    @property
    def prefill_ports(self) -> list[int]:
        return self.opts.sim_ports[: self.prefill_sims]

    def sim_name(self, i: int) -> str:
        return f"prefill-{i}" if i < self.prefill_sims else f"decode-{i - self.prefill_sims}-engine"

    def start(self, abort: Callable[[], bool] | None = None) -> None:
        o = self.opts
        o.check()
        busy = o.busy_ports() or ", ".join(
            str(p) for d in self.decoders for p in (d.sidecar_port, d.metrics_port) if port_in_use(p)
        )
        if busy:
            raise RuntimeError(f"ports already in use: {busy}; move them with those epp run flags")
        for i, port in enumerate(o.sim_ports):
            role = "prefill" if i < self.prefill_sims else "decode"
            args = [*o.sim_args, "--role", role]
            self.sims.append(
                self.start_sim(self.sim_name(i), port, model=o.model, args=args, restart=o.sim_restart)
            )
        self.write_endpoints()
        for d in self.decoders:
            argv = sidecar_argv(
                d.sidecar_port, d.engine_port, endpoints_file=self.endpoints_file, metrics_port=d.metrics_port
            )
            self.sidecars.append(self.supervisor.start(f"sidecar-{d.name}", argv, restart=o.sim_restart))
        (ports,) = o.epps()
        self.epp = self.start_epp(
            "epp",
            grpc_port=ports.grpc,
            health_port=ports.health,
            metrics_port=ports.metrics,
            config=self.epp_document(),
            extra=["--grpc-socket", ports.socket, *o.epp_args],
        )
        self.epps.append(self.epp)
        self.envoy = self.start_envoy(
            "envoy", self.bootstrap(), log_level=o.envoy_log_level, concurrency=o.envoy_concurrency
        )
        self.wait_ready(abort)

    def write_endpoints(self, *, prefill: bool = True) -> None:
        """The EPP's endpoints file: the prefill simulators (unless ``prefill`` is false) and the
        decode sidecars, labelled with their role."""
        names = [self.sim_name(i) for i in range(self.prefill_sims)] if prefill else []
        ports = list(self.prefill_ports) if prefill else []
        labels = {n: {ROLE_LABEL: "prefill"} for n in names}
        for d in self.decoders:
            names.append(d.name)
            ports.append(d.sidecar_port)
            labels[d.name] = {ROLE_LABEL: "decode"}
        write_endpoints(self.endpoints_file, ports, names=names, labels=labels)

    def bootstrap(self) -> dict[str, Any]:
        o = self.opts
        modes = modes_for_document(epp_config(self.endpoints_file, o.config))
        if o.response_phases:
            modes = ResponseModes("SEND", RESPONSE_BODY_MODE)
        (first,) = o.epps()
        return envoy_bootstrap(
            response_header_mode=modes.header,
            response_body_mode=modes.body,
            listen_port=o.port,
            admin_port=o.admin_port,
            extproc_port=first.grpc,
            extproc_socket=first.socket,
            body_mode=o.body_mode,
            fail_open=o.fail_open,
            fallback_endpoints=[d.address for d in self.decoders],
            extproc_health_port=first.health if o.fail_open else 0,
        )

    def wait_ready(self, abort: Callable[[], bool] | None = None) -> None:
        o = self.opts
        checks: list[tuple[str, Callable[[], bool]]] = [
            (c.name, http_ok(f"http://127.0.0.1:{p}/health"))
            for c, p in zip(self.sims, o.sim_ports, strict=True)
        ]
        checks += [
            (c.name, http_ok(f"http://{d.address}/health"))
            for c, d in zip(self.sidecars, self.decoders, strict=True)
        ]
        (e,) = o.epps()
        checks.append(("EPP readiness", lambda: grpc_serving(e.health)))
        checks.append(("every endpoint scraped by the EPP", epp_scraped(e.metrics, len(o.sim_ports))))
        checks.append(("Envoy", http_ok(f"http://127.0.0.1:{o.admin_port}/ready")))
        checks.append(("GET /v1/models through Envoy", http_ok(f"{self.url}/v1/models")))
        for what, check in checks:
            self.wait(what, check, abort=abort)

    def roles(self) -> str:
        """The banner's lines saying which endpoint does what."""
        lines = [
            f"  prefill    {self.sim_name(i)}  127.0.0.1:{p}  (epp sim --role prefill)"
            for i, p in enumerate(self.prefill_ports)
        ]
        for d in self.decoders:
            lines.append(
                f"  decode     {d.name}  {d.address}  (epp pd-sidecar, nixlv2, SSRF allow-list; metrics "
                f"http://127.0.0.1:{d.metrics_port}/metrics)\n"
                f"               -> epp sim --role decode on 127.0.0.1:{d.engine_port}"
            )
        return "\n".join(lines)

    def __enter__(self) -> PDStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self
