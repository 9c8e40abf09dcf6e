"""Benchmark one scheduling cycle as the director runs it: producers, ``Scheduler.schedule``, PreRequest.

Run: ``.venv/bin/python bench/sched.py [--iterations N] [--endpoints 10,100,1000] [--seed S]
[--churn K]``; median and p99 µs per configuration and endpoint count, with a per-stage breakdown.
Configs: ``default`` (epp's shipped default document through the config loader), ``ref-default``
(the reference's default profile, built by hand), ``pd``, ``precise``.
``--churn K``: before each request (outside the timed part) K random endpoints get a new ``Metrics``
object, as scrapes landing between requests do (the bulk path then recomputes its columns).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from epp.config import load_config
from epp.framework import (
    ApiKind,
    CycleState,
    DataProducer,
    Endpoint,
    EndpointMetadata,
    LLMRequest,
    Metrics,
    NoParams,
    PreRequest,
    ProfileRunResult,
    RequestBody,
    SchedulingResult,
    registry,
)
from epp.plugins.pickers._common import PickerParams
from epp.plugins.pickers.max_score import MaxScorePicker
from epp.plugins.producers.approx_prefix_cache import ApproxPrefixCacheParams, ApproxPrefixCacheProducer
from epp.plugins.profile_handlers.single import SingleProfileHandler
from epp.plugins.scorers.kv_cache_utilization import KVCacheUtilizationScorer
from epp.plugins.scorers.prefix_cache import PrefixCacheScorer, PrefixCacheScorerParams
from epp.plugins.scorers.queue import QueueScorer
from epp.scheduling import Scheduler, SchedulerProfile, WeightedScorer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SYSTEM_PROMPT = (
    "You are a meticulous assistant for a logistics company. Answer questions about shipments, "
    "customs paperwork, carrier schedules and warehouse capacity. Always cite the document you relied "
    "on, state your confidence, and never invent tracking numbers. If a question is ambiguous, ask one "
    "clarifying question before answering. Keep answers under two hundred words unless the user asks "
    "for detail. Use metric units, ISO dates and 24-hour times. When you list options, number them and "
    "put the recommended option first, followed by a one-sentence justification for each choice made. "
)


@dataclass(slots=True)
class Setup:
    """One benchmark configuration: what the director would hold after loading a config."""

    name: str
    producers: list[DataProducer]
    scheduler: Scheduler
    pre_request: list[PreRequest]


def chat_payload(user_text: str) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_text},
        ],
        "max_tokens": 256,
    }


def make_request(payload: dict[str, object], raw: bytes, i: int) -> LLMRequest:
    body = RequestBody(ApiKind.CHAT_COMPLETIONS, payload, raw)
    return LLMRequest(f"req-{i}", body, {}, MODEL, MODEL, request_size_bytes=len(raw))


def make_endpoints(n: int, rnd: random.Random) -> list[Endpoint]:
    return [
        Endpoint(
            EndpointMetadata(
                f"vllm-{i // 2}-rank-{i % 2}",
                f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}",
                8000,
                labels={"llm-d.ai/role": "prefill" if i % 2 == 0 else "decode"},
            ),
            Metrics(
                waiting_queue_size=rnd.randint(0, 20),
                running_requests_size=rnd.randint(0, 64),
                kv_cache_usage_percent=rnd.random(),
                update_time=time.monotonic(),
                fresh_until=math.inf,  # scraped metrics, known for the whole run
            ),
        )
        for i in range(n)
    ]


def build_default() -> Setup:
    """epp's shipped default: ``default_document()`` through the config loader, as ``epp serve``
    with only discovery (no config) loads it."""
    cfg = load_config(None, "default", allow_experimental=False)
    return Setup("default", list(cfg.producers), cfg.scheduler, list(cfg.pre_request))


def build_ref_default() -> Setup:
    """The reference's default profile, built by hand: queue (2), KV-cache utilization (2) and
    prefix-cache (3) scorers with the approximate prefix producer (epp's default before
    ``prefix-spread-scorer``)."""
    producer = ApproxPrefixCacheProducer("approx-prefix-cache-producer", ApproxPrefixCacheParams())
    profile = SchedulerProfile(
        "default",
        scorers=[
            WeightedScorer(QueueScorer("queue-scorer", NoParams()), 2.0),
            WeightedScorer(KVCacheUtilizationScorer("kv-cache-utilization-scorer", NoParams()), 2.0),
            WeightedScorer(PrefixCacheScorer("prefix-cache-scorer", PrefixCacheScorerParams()), 3.0),
        ],
        picker=MaxScorePicker("max-score-picker", PickerParams()),
    )
    scheduler = Scheduler(SingleProfileHandler("single-profile-handler", NoParams()), {"default": profile})
    return Setup("ref-default", [producer], scheduler, [producer])


PD_CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 16}}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: prefix-based-pd-decider}}}
- {type: prefill-filter}
- {type: decode-filter}
- {type: prefix-cache-scorer}
- {type: queue-scorer}
- {type: kv-cache-utilization-scorer}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: prefix-cache-scorer, weight: 3},
            {pluginRef: queue-scorer, weight: 2}, {pluginRef: kv-cache-utilization-scorer, weight: 2}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 3},
            {pluginRef: queue-scorer, weight: 2}, {pluginRef: kv-cache-utilization-scorer, weight: 2}]
"""


def build_pd() -> Setup:
    """The reference's sample P/D configuration with the default scorers, via the loader.

    Endpoints alternate ``llm-d.ai/role`` prefill/decode; the decider disaggregates when at least
    16 prompt tokens are not cached on the chosen decode endpoint, so both profiles usually run.
    """
    cfg = load_config(PD_CONFIG)
    return Setup("pd", list(cfg.producers), cfg.scheduler, list(cfg.pre_request))


PRECISE_CONFIG = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: token-producer, parameters: {modelName: demo, local: {path: "TOKENIZER"}}}
- {type: precise-prefix-cache-producer, parameters: {speculativeIndexing: true, speculativeTTL: 1h}}
- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}}
- {type: queue-scorer}
- {type: kv-cache-utilization-scorer}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: queue-scorer, weight: 2},
            {pluginRef: kv-cache-utilization-scorer, weight: 2}]
"""


def build_precise() -> Setup:
    """The default scorers with precise prefix matching: the shipped tokenizer (``token-producer``
    local backend) and the KV-block index, filled here by the warm-up's speculative entries (what
    the engines' events would put there)."""
    from epp.tokenization import DEFAULT_TOKENIZER_DIR

    cfg = load_config(PRECISE_CONFIG.replace("TOKENIZER", str(DEFAULT_TOKENIZER_DIR)))
    return Setup("precise", list(cfg.producers), cfg.scheduler, list(cfg.pre_request))


BUILDERS: dict[str, tuple[Callable[[], Setup | None], str | None]] = {
    "default": (build_default, None),
    "ref-default": (build_ref_default, None),
    "pd": (build_pd, "disagg-profile-handler"),
    "precise": (build_precise, "precise-prefix-cache-producer"),
}


async def warm(
    setup: Setup, endpoints: list[Endpoint], prompt_payload: dict[str, object], rnd: random.Random
) -> None:
    """Fill the prefix index: background prompts everywhere, the benchmark prefix on a few endpoints."""

    async def route(payload: dict[str, object], target: Endpoint, i: int) -> None:
        raw = orjson.dumps(payload)
        req = make_request(payload, raw, i)
        cycle = CycleState()
        for p in setup.producers:
            await p.produce(cycle, req, endpoints)
        result = SchedulingResult({"default": ProfileRunResult([target])}, "default")
        for plugin in setup.pre_request:
            plugin.pre_request(cycle, req, result)

    i = 0
    for e in endpoints:  # unrelated traffic: 20 distinct prompts per endpoint
        for _ in range(20):
            words = " ".join(f"w{rnd.randrange(10**6)}" for _ in range(120))
            await route(chat_payload(words), e, i)
            i += 1
    messages = prompt_payload["messages"]
    assert isinstance(messages, list)
    user = messages[1]["content"]
    half = dict(
        prompt_payload, messages=[messages[0], {"role": "user", "content": user[: len(user) // 2] + "!"}]
    )
    holders = rnd.sample(endpoints, k=max(2, len(endpoints) // 10))
    for j, e in enumerate(holders):  # 10 % of the endpoints share the prefix: half hold it all
        await route(prompt_payload if j % 2 == 0 else half, e, i)
        i += 1


async def measure(
    setup: Setup, n_endpoints: int, iterations: int, seed: int, churn: int = 0
) -> dict[str, list[float]]:
    rnd = random.Random(seed)
    endpoints = make_endpoints(n_endpoints, rnd)
    user_text = "Shipment 4471 left Rotterdam on 2025-03-02. " * 7  # system + user ~ 1 KB of JSON
    payload = chat_payload(user_text)
    raw = orjson.dumps(payload)
    await warm(setup, endpoints, payload, rnd)
    producers, scheduler, pre_request = setup.producers, setup.scheduler, setup.pre_request
    times: dict[str, list[float]] = {"total": [], "produce": [], "schedule": [], "pre_request": []}
    perf = time.perf_counter
    warmup = min(200, iterations // 5)
    for i in range(warmup + iterations):
        req = make_request(dict(payload), raw, i)
        for e in rnd.sample(endpoints, k=min(churn, n_endpoints)):
            e.metrics = Metrics(
                waiting_queue_size=rnd.randint(0, 20),
                running_requests_size=rnd.randint(0, 64),
                kv_cache_usage_percent=rnd.random(),
                update_time=time.monotonic(),
                fresh_until=math.inf,
            )
        candidates = list(endpoints)
        cycle = CycleState()
        t0 = perf()
        for p in producers:
            await p.produce(cycle, req, candidates)
        t1 = perf()
        result, err = scheduler.schedule(cycle, req, candidates)
        t2 = perf()
        if result is None:
            raise SystemExit(f"{setup.name}: scheduling failed: {err}")
        for plugin in pre_request:
            plugin.pre_request(cycle, req, result)
        t3 = perf()
        if i >= warmup:
            times["total"].append(t3 - t0)
            times["produce"].append(t1 - t0)
            times["schedule"].append(t2 - t1)
            times["pre_request"].append(t3 - t2)
    return times


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--endpoints", default="10,100,1000")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--configs", default=",".join(BUILDERS), help="which of: " + ", ".join(BUILDERS))
    ap.add_argument("--churn", type=int, default=0, help="endpoints whose metrics change before each request")
    args = ap.parse_args()
    counts = [int(x) for x in args.endpoints.split(",")]

    print(
        f"{'config':<11} {'endpoints':>9} {'median µs':>10} {'p99 µs':>9}   "
        "produce / schedule / pre_request (median µs)"
    )
    for name, (build, needs_type) in BUILDERS.items():
        if name not in args.configs.split(","):
            continue
        if needs_type is not None and registry.lookup(needs_type) is None:
            print(f"{name:<11} skipped: '{needs_type}' is not registered")
            continue
        for n in counts:
            setup = build()  # a fresh index per row
            if setup is None:
                print(f"{name:<11} skipped: no configuration yet (see build_{name})")
                break
            t = await measure(setup, n, args.iterations, args.seed, args.churn)
            us = {k: [v * 1e6 for v in vs] for k, vs in t.items()}
            print(
                f"{name:<11} {n:>9} {statistics.median(us['total']):>10.1f} {p99(us['total']):>9.1f}   "
                f"{statistics.median(us['produce']):.1f} / {statistics.median(us['schedule']):.1f} / "
                f"{statistics.median(us['pre_request']):.1f}"
            )


if __name__ == "__main__":
    asyncio.run(main())
