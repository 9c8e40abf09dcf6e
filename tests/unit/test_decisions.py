"""Explained decisions: what a profile records (the scores it picked by, weighted and clamped as it
summed them), the ring and the sampled log, and the metrics port's paths."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from typing import Any

from epp.framework import CycleState, Endpoint, LLMRequest, Scorer
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.scheduling import SchedulerProfile, WeightedScorer
from epp.scheduling.decision import DECISION_KEY, RUNNERS_UP, Decision, Recorded
from epp.server.decisions import DecisionLog
from epp.server.health import Health
from epp.server.metrics_port import MetricsPort
from tests.unit.factories import endpoint, request


class _Fixed(Scorer):
    type_name = "fixed"

    def __init__(self, name: str, scores: Sequence[float]) -> None:
        super().__init__(name, None)
        self.scores = scores

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        return self.scores


def _run(scorers: list[WeightedScorer], n: int) -> tuple[list[Endpoint], Decision]:
    eps = [endpoint(f"e{i}", f"10.0.0.{i}") for i in range(n)]
    profile = SchedulerProfile("p", scorers=scorers, picker=MaxScorePicker("m", PickerParams()), decide=True)
    cycle = CycleState()
    profile.run(cycle, request(), eps)
    (recorded,) = cycle[DECISION_KEY]
    return eps, recorded.decision()


def test_the_decision_shows_the_pick_the_best_runners_up_and_the_weighted_scores() -> None:
    a = _Fixed("a", [0.2, 5.0, 0.5, -1.0, math.nan])  # clamped to [0, 1] as the profile sums
    b = _Fixed("b", [0.9, 0.1, 0.6, 0.3, 0.0])
    eps, decision = _run([WeightedScorer(a, 2.0), WeightedScorer(b, 1.0)], 5)
    # totals: e0 1.3, e1 2.1, e2 1.6, e3 0.3, e4 0
    assert decision.scorers == (("a", 2.0), ("b", 1.0))
    assert decision.candidates == 5
    rows = decision.rows
    assert len(rows) == 1 + RUNNERS_UP
    assert [(r.name, r.picked) for r in rows] == [("e1", True), ("e2", False), ("e0", False)]
    assert rows[0].scores == (2.0, 0.1) and math.isclose(rows[0].total, 2.1)
    assert rows[1].scores == (1.0, 0.6) and math.isclose(rows[1].total, 1.6)
    for r in rows:
        assert math.isclose(sum(r.scores), r.total)
    assert rows[0].address == eps[1].hostport
    assert decision.summary().startswith(f"p: *{eps[1].hostport}=2.100(a=2.000,b=0.100) ")
    shown = decision.to_dict()["endpoints"][0]
    assert shown == {
        "name": "e1",
        "address": eps[1].hostport,
        "picked": True,
        "total": 2.1,
        "scores": {"a": 2.0, "b": 0.1},
    }


def test_one_endpoint_has_no_runner_up_and_no_decision_without_decide() -> None:
    _, decision = _run([WeightedScorer(_Fixed("a", [0.5]), 1.0)], 1)
    assert [r.picked for r in decision.rows] == [True]
    profile = SchedulerProfile("p", scorers=[], picker=MaxScorePicker("m", PickerParams()))
    cycle = CycleState()
    profile.run(cycle, request(), [endpoint("e0", "10.0.0.1")])
    assert DECISION_KEY not in cycle


def test_the_ring_keeps_the_last_n_newest_first_and_the_log_is_sampled(capsys: Any) -> None:
    _, decision = _run([WeightedScorer(_Fixed("a", [0.5, 0.2]), 1.0)], 2)
    ring = DecisionLog(size=3, sample_rate=0.0)
    for i in range(5):
        ring.record(f"r{i}", "m", [Recorded.built(decision)])
    assert [e.request_id for e in ring.recent()] == ["r4", "r3", "r2"]
    assert [e.request_id for e in ring.recent(1)] == ["r4"]
    assert DecisionLog(size=0).recent() == []
    sampled = DecisionLog(size=0, sample_rate=0.5, rng=random.Random(7))
    draws = random.Random(7)
    expected = sum(draws.random() < 0.5 for _ in range(200))
    for i in range(200):
        sampled.record(f"s{i}", "m", [Recorded.built(decision)])
    lines = [line for line in capsys.readouterr().out.splitlines() if "request.decision" in line]
    assert len(lines) == expected and 60 < expected < 140


def _get(app: Any, path: str, method: str = "GET") -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    path, _, query = path.partition("?")
    body = b"".join(app({"PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": method}, start_response))
    return seen["status"], seen["headers"], body


def _metrics(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"# metrics\n"]


def test_the_metrics_port_serves_its_paths_and_404_elsewhere() -> None:
    health = Health()
    ring = DecisionLog(size=10, sample_rate=0.0)
    _, decision = _run([WeightedScorer(_Fixed("a", [0.5, 0.2]), 1.0)], 2)
    ring.record("rid-1", "m", [Recorded.built(decision)])
    app = MetricsPort(health, lambda: ring).wrap(_metrics)
    assert _get(app, "/metrics")[2] == b"# metrics\n"
    assert _get(app, "/healthz")[0] == "200 OK"
    status, _, body = _get(app, "/readyz")
    assert status.startswith("503") and b"not serving" in body and b"pool" in body
    health._published = True  # what the gRPC health service says
    assert _get(app, "/readyz")[:3:2] == ("200 OK", b"serving\n")
    for path in ("/", "/metricsx", "/foo", "/status"):  # no status page given here
        assert _get(app, path)[0] == "404 Not Found", path
    assert _get(app, "/healthz", "POST")[0].startswith("405")
    status, headers, body = _get(app, "/debug/decisions?limit=5")
    assert status == "200 OK" and headers["Content-Type"] == "application/json"
    (entry,) = json.loads(body)["decisions"]
    assert entry["request_id"] == "rid-1" and entry["profiles"][0]["endpoints"][0]["picked"]
    assert _get(app, "/debug/decisions?limit=x")[0].startswith("400")


def test_authentication_guards_all_but_the_probes() -> None:
    def deny(app: Any) -> Any:
        def guarded(environ: Any, start_response: Any) -> list[bytes]:
            start_response("401 Unauthorized", [])
            return [b""]

        return guarded

    app = MetricsPort(Health(), lambda: None, status=lambda: {}, protect=deny).wrap(_metrics)
    for path in ("/metrics", "/debug/decisions", "/status", "/status.json"):
        assert _get(app, path)[0] == "401 Unauthorized", path
    assert _get(app, "/healthz")[0] == "200 OK"
    assert _get(app, "/readyz")[0].startswith("503")


class _Reusing(Scorer):
    """Returns the same list every time, rewritten per call (a scorer may keep a buffer)."""

    type_name = "reusing"

    def __init__(self) -> None:
        super().__init__("reusing", None)
        self.buffer = [0.0, 0.0]
        self.calls = 0

    def score(self, cycle: CycleState, request: LLMRequest, endpoints: list[Endpoint]) -> Sequence[float]:
        self.calls += 1
        self.buffer[:] = [1.0, 0.0] if self.calls == 1 else [0.0, 1.0]
        return self.buffer


def test_a_decision_is_built_when_shown_from_the_scores_as_they_were() -> None:
    eps = [endpoint(f"e{i}", f"10.0.0.{i}") for i in range(2)]
    scorer = _Reusing()
    profile = SchedulerProfile(
        "p", scorers=[WeightedScorer(scorer, 1.0)], picker=MaxScorePicker("m", PickerParams()), decide=True
    )
    first, second = CycleState(), CycleState()
    profile.run(first, request(), eps)
    profile.run(second, request(), eps)  # rewrites the scorer's list
    (recorded,) = first[DECISION_KEY]
    assert recorded._decision is None  # nothing built until something shows it
    decision = recorded.decision()
    assert [(r.name, r.picked, r.scores) for r in decision.rows] == [
        ("e0", True, (1.0,)),
        ("e1", False, (0.0,)),
    ]
    assert recorded.decision() is decision and recorded._args is None
