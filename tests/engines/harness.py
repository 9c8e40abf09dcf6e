"""Real vLLM engines for the engine tests: started from ``make engines``' venv, or running already.

:func:`engine_pool` starts :data:`ENGINES` vLLM servers on free ports of 127.0.0.1 (the tiny model,
its LoRA adapter, KV events with a replay socket) with :func:`epp.dev.stack.engines.vllm_argv`, the
command line ``epp run --engine vllm`` uses. With ``EPP_ENGINE_URLS`` set the tests run against
those engines instead (a GPU box runs the suite unchanged):

* ``EPP_ENGINE_URLS``  ``http://host:port,...`` (two or more engines of one model)
* ``EPP_ENGINE_KV_PORTS``  ``pub:replay,...`` per engine (their ``--kv-events-config`` ports; the
  topic must start with ``kv@``), ``EPP_ENGINE_MODEL`` (default: the first ``/v1/models`` entry),
  ``EPP_ENGINE_BLOCK_SIZE`` (default 32), ``EPP_ENGINE_LORA`` (an adapter name they serve, if any).

Tests that kill or restart an engine skip against engines they did not start.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from epp.dev.envoy.exchange import RESPONSE_BODY_MODE, ResponseModes
from epp.dev.stack import Child, Supervisor
from epp.dev.stack import engines as eng
from tests.integration.harness import Envoy, Epp, Rig

ENGINES = 2
ENGINE_READY_TIMEOUT = 420.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def http(
    url: str, body: Mapping[str, Any] | None = None, timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: (status, lower-cased headers, body)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def samples(text: str, family: str) -> list[tuple[str, float]]:
    """``(labels, value)`` of every sample named ``family`` in a Prometheus text page."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == family:
            out.append((m.group(2) or "", float(m.group(3))))
    return out


def total(text: str, family: str, label: str = "") -> float:
    """The sum of ``family``'s samples (those whose labels contain ``label``)."""
    return sum(v for labels, v in samples(text, family) if label in labels)


@dataclass
class Engine:
    name: str
    port: int
    host: str = "127.0.0.1"
    kv_pub: int = 0
    kv_replay: int = 0
    child: Child | None = None  # None: not ours (EPP_ENGINE_URLS)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def metrics(self) -> str:
        return http(f"{self.url}/metrics")[2].decode()

    def counter(self, family: str) -> float:
        return total(self.metrics(), family)

    def complete(self, prompt: str, model: str, max_tokens: int = 1) -> dict[str, Any]:
        """A completion sent to this engine directly (not through Envoy)."""
        status, _, body = http(
            f"{self.url}/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
        assert status == 200, (self.name, status, body[:300])
        return json.loads(body)

    def healthy(self) -> bool:
        try:
            return http(f"{self.url}/health", timeout=2)[0] == 200
        except OSError:
            return False


@dataclass
class Pool:
    """The engines of a test session and what the EPP needs to know about them."""

    engines: list[Engine]
    model: str
    block_size: int
    lora: str = ""
    supervisor: Supervisor | None = None
    ours: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def labels(self) -> dict[str, dict[str, str]]:
        return {e.name: stack.kv_events_labels(e.kv_pub, e.kv_replay) for e in self.engines if e.kv_pub}

    def write_endpoints(self, path: Path, engines: Sequence[Engine] | None = None) -> None:
        chosen = self.engines if engines is None else engines
        labels = self.labels()
        document = {
            "endpoints": [
                {
                    "name": e.name,
                    "namespace": "default",
                    "address": e.host,
                    "port": str(e.port),
                    "labels": labels.get(e.name, {}),
                }
                for e in chosen
            ]
        }
        stack.write_atomic(path, json.dumps(document))

    def by_address(self, address: str) -> Engine:
        for e in self.engines:
            if e.address == address:
                return e
        raise AssertionError(f"no engine at {address!r}")

    def kill(self, engine: Engine) -> None:
        assert engine.child is not None
        engine.child.kill()

    def restart(self, engine: Engine) -> None:
        """Start a killed engine again on its ports and wait until it serves."""
        assert engine.child is not None
        engine.child.respawn()
        wait_healthy([engine])

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop_all()


def wait_healthy(engines: Sequence[Engine], timeout: float = ENGINE_READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    for e in engines:
        while not e.healthy():
            if e.child is not None and not e.child.running():
                raise RuntimeError(f"{e.name} exited:\n{e.child.tail(30)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{e.name} not healthy after {timeout:.0f} s")
            time.sleep(1.0)


def external_pool() -> Pool | None:
    """The engines named by ``EPP_ENGINE_URLS`` (None when unset)."""
    urls = [u.strip().rstrip("/") for u in os.environ.get("EPP_ENGINE_URLS", "").split(",") if u.strip()]
    if not urls:
        return None
    kv = [p.strip() for p in os.environ.get("EPP_ENGINE_KV_PORTS", "").split(",") if p.strip()]
    engines = []
    for i, url in enumerate(urls):
        parsed = urllib.parse.urlsplit(url)
        pub, replay = (int(x) for x in kv[i].split(":")) if i < len(kv) else (0, 0)
        engines.append(Engine(f"engine-{i}", parsed.port or 80, parsed.hostname or "", pub, replay))
    model = os.environ.get("EPP_ENGINE_MODEL", "")
    if not model:
        model = json.loads(http(f"{engines[0].url}/v1/models")[2])["data"][0]["id"]
    block = int(os.environ.get("EPP_ENGINE_BLOCK_SIZE", str(eng.VLLM_BLOCK_SIZE)))
    return Pool(engines, model, block, lora=os.environ.get("EPP_ENGINE_LORA", ""))


def engine_pool(log_dir: Path, count: int = ENGINES) -> Pool:
    """``count`` vLLM engines from ``make engines`` (started together, waited for)."""
    supervisor = Supervisor(log_dir)
    engines = []
    pool = Pool(engines, eng.TINY_MODEL_NAME, eng.VLLM_BLOCK_SIZE, eng.TINY_LORA_NAME, supervisor, ours=True)
    try:
        for i in range(count):
            port, pub, replay = stack.free_ports(3)
            argv = eng.vllm_argv(
                port, kv_pub=pub, kv_replay=replay, loras={eng.TINY_LORA_NAME: eng.tiny_lora()}
            )
            child = supervisor.start(f"vllm-{i}", argv, env=eng.vllm_env())
            engines.append(Engine(f"vllm-{i}", port, kv_pub=pub, kv_replay=replay, child=child))
        wait_healthy(engines)
    except BaseException:
        pool.close()
        raise
    return pool


# ------------------------------------------------------------------------------ EPP + Envoy in front

UPSTREAM_HEADER = "x-test-upstream"  # the engine Envoy sent the request to (%UPSTREAM_HOST%)
PRECISE = "precise-prefix-cache-producer"


def precise_config(pool: Pool, *, prefix_weight: int = 5) -> dict[str, Any]:
    """Default-style scheduling with the prefix scorer fed by the engines' KV events and the tokens
    from the first engine's render endpoint (``token-producer``'s vllm backend)."""
    return {
        "apiVersion": "llm-d.ai/v1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {
                "type": "token-producer",
                "parameters": {"modelName": pool.model, "vllm": {"url": pool.engines[0].url}},
            },
            {
                "type": PRECISE,
                "parameters": {
                    "tokenProcessorConfig": {"blockSizeTokens": pool.block_size},
                    # the index counters (admissions): what tests wait on before routing
                    "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
                },
            },
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": PRECISE}},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                    {"pluginRef": "prefix-cache-scorer", "weight": prefix_weight},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


@dataclass
class Front:
    """An EPP and its Envoy over a pool."""

    rig: Rig
    pool: Pool
    epp: Epp
    envoy: Envoy
    config: dict[str, Any]

    def post(
        self, path: str, body: Mapping[str, Any], timeout: float = 60.0
    ) -> tuple[int, dict[str, str], bytes]:
        return http(self.envoy.url + path, body, timeout=timeout)

    def complete(
        self, prompt: str, *, model: str = "", max_tokens: int = 1, **extra: Any
    ) -> tuple[Engine, dict[str, Any]]:
        """A completion through Envoy: the engine that served it and its answer."""
        body = {
            "model": model or self.pool.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        status, headers, data = self.post("/v1/completions", {**body, **extra})
        assert status == 200, (status, headers, data[:300])
        return self.pool.by_address(headers[UPSTREAM_HEADER]), json.loads(data)

    def epp_metrics(self) -> str:
        return self.epp.metrics()

    def admissions(self) -> float:
        """Blocks the EPP's KV-block index admitted so far (every engine's)."""
        return total(self.epp_metrics(), "llm_d_epp_kv_cache_index_admissions_total")

    def wait_indexed(self, before: float, blocks: int, what: str) -> None:
        """Until the index admitted ``blocks`` more than ``before``: an engine's batch reached the
        EPP (live, or by a replay after a restart). Tests send one engine's traffic at a time."""
        wait_for(what, lambda: self.admissions() >= before + blocks, timeout=EVENTS_TIMEOUT, interval=0.1)

    def replays(self, engine: Engine, outcome: str) -> float:
        """The EPP's replays of ``engine``'s KV events with ``outcome`` (since the EPP started)."""
        who = f'pod_identifier="default/{engine.name}"'
        page = self.epp_metrics()
        return sum(
            v
            for labels, v in samples(page, "llm_d_epp_kv_cache_events_replays_total")
            if who in labels and f'outcome="{outcome}"' in labels
        )

    def wait_replayed(self, engines: Sequence[Engine] | None = None) -> None:
        """Until the EPP has rebuilt each engine's blocks from its replay socket (what it does on
        subscribing): before that, a prompt an engine holds may not be indexed yet."""
        for engine in self.pool.engines if engines is None else engines:
            if engine.kv_replay:
                wait_for(
                    f"the EPP's replay of {engine.name}'s KV events",
                    lambda e=engine: self.replays(e, "complete") >= 1,
                    timeout=EVENTS_TIMEOUT,
                    interval=0.25,
                )

    def restart_epp(self) -> None:
        """Stop the EPP and start it again with the same command line, ports and config."""
        self.epp.child.respawn()
        self.rig.stack.wait_epp(self.epp.child, self.epp.health_port)


EVENTS_TIMEOUT = 120.0  # an engine's batch, or a replay, reaching a busy EPP (normally milliseconds)


def start_front(
    rig: Rig,
    pool: Pool,
    config: Mapping[str, Any] | None = None,
    *,
    response_phases: bool = False,
    epp_extra: Sequence[str] = (),
    engines: Sequence[Engine] | None = None,
) -> Front:
    """``epp serve`` over ``engines`` (default: the whole pool; file discovery) and a real Envoy from
    the generated bootstrap, which also answers with :data:`UPSTREAM_HEADER`."""
    document = dict(config if config is not None else precise_config(pool))
    epp = rig.start_epp([], config=document, extra=epp_extra, labels=None)
    pool.write_endpoints(epp.endpoints_file, engines)
    port, admin_port = stack.free_port(), stack.free_port()
    modes = ResponseModes("SEND", RESPONSE_BODY_MODE) if response_phases else epp.response_modes
    bootstrap = envoy_config.envoy_bootstrap(
        listen_port=port,
        admin_port=admin_port,
        extproc_port=epp.grpc_port,
        extproc_socket=epp.socket,
        response_header_mode=modes.header,
        response_body_mode=modes.body,
    )
    _tag_upstream(bootstrap)
    child = rig.stack.start_envoy("envoy", bootstrap, concurrency=1)
    envoy = Envoy(child, port, admin_port, envoy_config.DEFAULT_BODY_MODE, False)
    rig.stack.wait_envoy(child, admin_port)
    rig.stack.wait(
        "GET /v1/models through Envoy",
        lambda: http(envoy.url + "/v1/models")[0] == 200,
        children=[child, epp.child],
    )
    front = Front(rig, pool, epp, envoy, document)
    if any(p.get("type") == PRECISE for p in document.get("plugins", [])):
        front.wait_replayed(engines)
    return front


def _tag_upstream(bootstrap: dict[str, Any]) -> None:
    """Every virtual host of ``bootstrap`` answers with the upstream host it used."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                route_config = f.get("typed_config", {}).get("route_config")
                for vhost in (route_config or {}).get("virtual_hosts", []):
                    vhost.setdefault("response_headers_to_add", []).append(
                        {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"}}
                    )


def wait_for(what: str, check: Any, timeout: float = 20.0, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def prompt(tag: str, blocks: int = 4) -> str:
    """A prompt of about ``blocks`` x 32 tokens or more, unique by ``tag`` from its first token on."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf"]
    words += ["hotel", "india", "juliet", "kilo", "lima", "mike"]
    body = " ".join(words[(i * 7 + len(tag)) % len(words)] for i in range(blocks * 32))
    return f"{tag} {body}"
