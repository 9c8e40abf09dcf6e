"""Three EPP replicas behind one Envoy share their routing state through a real ``redis-server``:
the approximate prefix index, in-flight load and a dead replica's expiry; session pins and the
utilization detector's in-flight credit (flow control gating on what every replica dispatched)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from epp.dev import stack
from epp.dev.envoy import bootstrap as envoy_config
from epp.dev.stack.redis_server import RedisServer
from epp.dev.stack.replicas import Replica, spread_ext_proc
from tests.integration.harness import MODEL, SUBSET_HEADER, Envoy, Epp, Rig, request
from tests.redis_fixture import redis_server as redis_server

pytestmark = pytest.mark.integration

INTERVAL_S = 0.05
STATE_TTL = "1s"
PREFIX = "llm-d-epp:default/epp:"  # keyPrefix : pool namespace / pool name
INFLIGHT_FIELD = "inflight-load-producer/inflight-load-producer|default/{}"
DETECTOR_FIELD = "utilization-detector/utilization-detector|default/{}"
SESSION_LOG = "log:session-affinity-scorer/session-affinity-scorer"
SESSION_HEADER = "x-session-id"


def _config(address: str) -> dict[str, Any]:
    return {
        "plugins": [
            {
                "name": "shared",
                "type": "redis-syncer",
                "parameters": {"address": address, "stateTTL": STATE_TTL},
            },
            {"type": "approx-prefix-cache-producer", "parameters": {"autoTune": False, "blockSizeTokens": 4}},
            {"type": "inflight-load-producer"},
            {"type": "prefix-cache-scorer"},
            {"type": "active-request-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "active-request-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
        "dataLayer": {
            "crossReplica": {"syncerPluginRef": "shared", "syncInterval": f"{int(INTERVAL_S * 1000)}ms"},
            "discovery": {"peers": {"pluginRef": "shared"}},
        },
    }


def _metric(epp: Epp, name: str) -> float:
    for line in epp.metrics().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait(what: str, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def _synced(epps: list[Epp], rounds: int = 2) -> None:
    """Until every live replica has run ``rounds`` more sync rounds (it has read what is in Redis)."""
    start = {e.grpc_port: _metric(e, "llm_d_epp_cross_replica_syncs_total") for e in epps}
    _wait(
        "sync rounds",
        lambda: all(
            _metric(e, "llm_d_epp_cross_replica_syncs_total") >= start[e.grpc_port] + rounds for e in epps
        ),
    )


def _served_by(envoy: Envoy) -> dict[int, int]:
    """ext_proc streams per replica port (Envoy's per-host ``rq_total``)."""
    text = request(f"http://127.0.0.1:{envoy.admin_port}/clusters").body.decode()
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "ext_proc" and parts[2] == "rq_total":
            out[int(parts[1].rsplit(":", 1)[1])] = int(parts[3])
    return out


def _chat(
    envoy: Envoy, text: str, *, max_tokens: int = 1, pin: str = "", session: str = ""
) -> tuple[int | None, int]:
    """One chat request: (the sim port that answered, the EPP replica port that routed it)."""
    before = _served_by(envoy)
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    )
    headers = {SUBSET_HEADER: pin} if pin else {}
    if session:
        headers[SESSION_HEADER] = session
    resp = envoy.post("/v1/chat/completions", body.encode(), headers or None)
    assert resp.status == 200, resp
    after = _served_by(envoy)
    (replica,) = [p for p, n in after.items() if n > before.get(p, 0)]
    return resp.port, replica


def _hold(envoy: Envoy, pin: str, max_tokens: int = 400) -> threading.Thread:
    """A long streamed request pinned (subset hint) to ``pin``, in flight until its replica dies
    or its ``max_tokens`` are out (50 ms each)."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"hold {time.time()}"}],
            "stream": True,
            "max_tokens": max_tokens,
        }
    ).encode()

    def run() -> None:
        try:
            request(
                envoy.url + "/v1/chat/completions",
                "POST",
                body,
                {"content-type": "application/json", SUBSET_HEADER: pin},
                60,
            )
        except (OSError, http.client.HTTPException):
            pass  # its replica was killed, or the rig stopped

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _charged(raw: redis.Redis, sim_name: str, field: str = INFLIGHT_FIELD) -> list[str]:
    """The replica hashes in Redis holding an in-flight charge on ``sim_name``."""
    keys = [k.decode() for k in raw.scan_iter(f"{PREFIX}v:*")]
    name = field.format(sim_name)
    return [k for k in keys if raw.hexists(k, name)]


def _envoy_over(rig: Rig, epps: list[Epp], name: str) -> Envoy:
    """One Envoy (one worker: streams go round robin) whose ext_proc cluster spreads over ``epps``,
    once it sees every replica healthy and every replica sees its peers."""
    base = envoy_config.envoy_bootstrap(
        listen_port=stack.free_port(), admin_port=stack.free_port(), subset_hint_header=SUBSET_HEADER
    )
    spread = spread_ext_proc(base, [Replica("127.0.0.1", e.grpc_port, e.health_port) for e in epps])
    listen = spread["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    admin = spread["admin"]["address"]["socket_address"]["port_value"]
    child = rig.stack.start_envoy(name, spread, concurrency=1)
    envoy = Envoy(child, listen, admin, envoy_config.DEFAULT_BODY_MODE, False)
    rig.stack.wait_envoy(child, admin)
    n = len(epps)
    _wait("every replica healthy in Envoy", lambda: envoy.health_flags("ext_proc") == ["healthy"] * n)
    _wait(
        f"every replica sees its {n - 1} peers",
        lambda: all(_metric(e, "llm_d_epp_cross_replica_peers") == n - 1 for e in epps),
    )
    return envoy


def test_three_replicas_behind_one_envoy_share_prefix_index_and_in_flight_load(
    rig: Rig, redis_server: RedisServer
) -> None:
    # Output at 50 ms a token: a request of 1 token is quick, one of 400 stays in flight.
    sims = rig.start_sims(2, extra=["--inter-token-latency", "50"])
    config = _config(redis_server.address)
    epps = [rig.start_epp(sims, name=f"epp-{i}", config=config) for i in range(3)]
    by_port = {e.grpc_port: e for e in epps}
    envoy = _envoy_over(rig, epps, "envoy-replicas")
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)

    # 1. A block routed by one replica steers the same prompt to the same endpoint through the others.
    log_key = f"{PREFIX}log:approx-prefix-cache-producer/approx-prefix-cache-producer"
    for n in range(3):
        prompt = f"conversation {n}: " + "a long shared system prompt for the whole fleet " * 12
        first_sim, first_replica = _chat(envoy, prompt)
        _wait(
            "the routed blocks in Redis",
            lambda n=n: raw.xlen(log_key) > n,  # type: ignore[misc]
        )
        _synced(epps)
        replicas = {first_replica}
        for _ in range(2):
            sim, replica = _chat(envoy, prompt)
            assert sim == first_sim, (
                f"prompt {n}: replica {replica} sent it elsewhere than {first_replica} did"
            )
            replicas.add(replica)
        assert len(replicas) >= 2, "the repeats went through the replica that routed the first one"

    # 2. In-flight counts are summed: one replica holds a long request on X, the others avoid X.
    x, y = sims
    _hold(envoy, x.address)
    _wait("the charge on X in Redis", lambda: len(_charged(raw, x.name)) == 1)
    (holder_key,) = _charged(raw, x.name)
    _synced(epps)
    (holder,) = [p for p, e in by_port.items() if _holds(e, x.name)]
    others = 0
    for i in range(12):
        sim, replica = _chat(envoy, f"unique {i} {time.time()}")
        if replica != holder:
            others += 1
            assert sim == y.port, f"replica {replica} ignored the request another replica holds on X"
    assert others >= 6

    # 3. A killed replica's charges expire within stateTTL; the survivors then count only their own.
    by_port[holder].child.kill()  # SIGKILL: no goodbye, its hash just stops being refreshed
    survivors = [e for p, e in by_port.items() if p != holder]
    _wait(
        "the dead replica unhealthy in Envoy",
        lambda: sorted(envoy.health_flags("ext_proc")).count("healthy") == 2,
    )
    _hold(envoy, y.address)  # now Y has one request in flight, X none once the dead charge expires
    _wait("the dead replica's hash expired", lambda: raw.exists(holder_key) == 0, timeout=5.0)
    _wait(
        "the survivors see 1 peer",
        lambda: all(_metric(e, "llm_d_epp_cross_replica_peers") == 1 for e in survivors),
    )
    _wait("the charge on Y in Redis", lambda: len(_charged(raw, y.name)) == 1)
    _synced(survivors)
    for i in range(6):
        sim, _ = _chat(envoy, f"after {i} {time.time()}")
        assert sim == x.port, "a dead replica's charge on X still counts"
    raw.close()


def _holds(epp: Epp, sim_name: str) -> bool:
    """Whether ``epp`` itself has a request in flight on ``sim_name`` (its endpoint in-flight gauge)."""
    for line in epp.metrics().splitlines():
        if line.startswith("llm_d_epp_endpoint_inflight_requests{") and f'name="{sim_name}"' in line:
            return float(line.rsplit(" ", 1)[1]) > 0
    return False


def _session_config(address: str) -> dict[str, Any]:
    """Routing by session alone (unbound sessions: a random endpoint), and flow control gated by
    the utilization detector: one request queued per endpoint saturates it."""
    return {
        "featureGates": ["flowControl"],
        "plugins": [
            {
                "name": "shared",
                "type": "redis-syncer",
                "parameters": {"address": address, "stateTTL": STATE_TTL},
            },
            {"type": "session-affinity-scorer", "parameters": {"strategy": "session_id"}},
            {"type": "utilization-detector", "parameters": {"queueDepthThreshold": 1}},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "session-affinity-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
        "flowControl": {"saturationDetector": {"pluginRef": "utilization-detector"}},
        "dataLayer": {
            "crossReplica": {"syncerPluginRef": "shared", "syncInterval": f"{int(INTERVAL_S * 1000)}ms"}
        },
    }


def _queued(epp: Epp) -> float:
    total = 0.0
    for line in epp.metrics().splitlines():
        if line.startswith("llm_d_epp_flow_control_queue_size{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _started(envoy: Envoy, before: dict[int, int]) -> int:
    """The replica port whose ext_proc stream count rose since ``before`` (exactly one)."""
    changed: list[int] = []

    def one() -> bool:
        changed[:] = [p for p, n in _served_by(envoy).items() if n > before.get(p, 0)]
        return len(changed) == 1

    _wait("one new ext_proc stream", one)
    return changed[0]


def test_three_replicas_share_session_pins_and_the_detectors_credit(
    rig: Rig, redis_server: RedisServer
) -> None:
    sims = rig.start_sims(2, extra=["--inter-token-latency", "50"])
    config = _session_config(redis_server.address)
    # one scrape at start-up, then none for 30 s: the detector works on the in-flight credit
    extra = ["--refresh-metrics-interval", "30s", "--allow-experimental-plugins"]
    epps = [rig.start_epp(sims, name=f"epp-{i}", config=config, extra=extra) for i in range(3)]
    by_port = {e.grpc_port: e for e in epps}
    envoy = _envoy_over(rig, epps, "envoy-sessions")
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)

    # 1. A session pinned through one replica is routed to the same endpoint through the others
    # (without sharing each of them would pick at random: 10 coin flips).
    first_sims = set()
    for n in range(5):
        session = f"conversation-{n}-{time.time()}"
        first_sim, first_replica = _chat(envoy, f"turn 0 of {n}", session=session)
        first_sims.add(first_sim)
        _wait("the binding in Redis", lambda n=n: raw.xlen(PREFIX + SESSION_LOG) > n)  # type: ignore[misc]
        _synced(epps)
        replicas = {first_replica}
        for turn in (1, 2):
            sim, replica = _chat(envoy, f"turn {turn} of {n}", session=session)
            assert sim == first_sim, f"session {n}: replica {replica} did not honour {first_replica}'s pin"
            replicas.add(replica)
        assert replicas == set(by_port), "the turns did not go through every replica"

    # 2. Requests dispatched by two replicas saturate the pool for the third: its detector counts
    # them (their in-flight credit since its scrape), so it queues a request until one ends.
    x, y = sims
    holds = []
    holders = []
    for sim in (x, y):
        before = _served_by(envoy)
        holds.append(_hold(envoy, sim.address, max_tokens=60))  # 3 s in flight
        holders.append(_started(envoy, before))
        _wait(
            "the charge in Redis",
            lambda sim=sim: len(_charged(raw, sim.name, DETECTOR_FIELD)) == 1,  # type: ignore[misc]
        )
    _synced(epps)
    before = _served_by(envoy)
    answers: list[tuple[int | None, int]] = []
    probe = threading.Thread(target=lambda: answers.append(_chat(envoy, "probe")), daemon=True)
    probe.start()
    prober = _started(envoy, before)
    assert prober not in holders, f"round robin sent the probe to a holder ({prober} in {holders})"
    _wait("the probe queued by the third replica", lambda: _queued(by_port[prober]) >= 1, timeout=2.5)
    assert all(h.is_alive() for h in holds) and probe.is_alive()
    probe.join(timeout=15)
    assert answers and answers[0][1] == prober, "the probe was not answered"
    assert not all(h.is_alive() for h in holds), "the probe went before the holds let it"
    for h in holds:
        h.join(timeout=10)
    raw.close()
