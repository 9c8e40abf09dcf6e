"""Real vLLM engines behind epp and a real Envoy: routing, streaming, the engines' metrics,
precise prefix routing confirmed by vLLM's own prefix-cache counters, LoRA adapters routed by the
events, the render endpoint and cached tokens."""

from __future__ import annotations

import json
import threading
import uuid
from http.client import HTTPConnection

from tests.engines.harness import (
    UPSTREAM_HEADER,
    Engine,
    Front,
    Pool,
    http,
    prompt,
    start_front,
    total,
    wait_for,
)
from tests.integration.harness import Rig


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def test_chat_completions_and_streaming_through_envoy(pool: Pool, rig: Rig) -> None:
    front = start_front(rig, pool)
    status, headers, body = front.post(
        "/v1/chat/completions",
        {"model": pool.model, "messages": [{"role": "user", "content": f"{_tag()} hello"}], "max_tokens": 4},
    )
    assert status == 200, body[:300]
    answer = json.loads(body)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] >= 1
    pool.by_address(headers[UPSTREAM_HEADER])
    # streamed: server-sent events to the end
    status, headers, body = front.post(
        "/v1/completions",
        {"model": pool.model, "prompt": f"{_tag()} once", "max_tokens": 5, "stream": True, "temperature": 0},
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 2
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])
    # every engine serves some of a few distinct prompts (load spread by the EPP's scorers)
    served = {front.complete(prompt(_tag(), blocks=1))[0].name for _ in range(12)}
    assert served == {e.name for e in pool.engines}


def test_engine_metrics_read_as_the_engine_reports_them(pool: Pool, rig: Rig) -> None:
    """While one engine runs long requests, the EPP's pool averages (recomputed every 5 s, from
    scrapes every 50 ms) equal the mean of the engines' own ``vllm:num_requests_running`` /
    ``vllm:num_requests_waiting``, with every engine counted."""
    front = start_front(rig, pool)
    busy = pool.engines[0]
    stop = threading.Event()
    threads = [threading.Thread(target=_generate_until, args=(busy, pool.model, stop)) for _ in range(2)]
    for t in threads:
        t.start()
    try:

        def same() -> bool:
            engines = [
                (
                    total(e.metrics(), "vllm:num_requests_running"),
                    total(e.metrics(), "vllm:num_requests_waiting"),
                )
                for e in pool.engines
            ]
            page = front.epp_metrics()
            running = sum(r for r, _ in engines) / len(engines)
            waiting = sum(w for _, w in engines) / len(engines)
            seen[:] = [
                ("engines (running, waiting)", engines),
                ("ready", total(page, "llm_d_epp_ready_endpoints")),
                ("EPP running, queue", total(page, "llm_d_epp_average_running_requests")),
                ("", total(page, "llm_d_epp_average_queue_size")),
            ]
            return (
                running > 0
                and total(page, "llm_d_epp_ready_endpoints") == len(pool.engines)
                and total(page, "llm_d_epp_average_running_requests") == running
                and total(page, "llm_d_epp_average_queue_size") == waiting
            )

        # the requests run until stopped: the averages settle once a refresh follows their start
        seen: list[tuple[str, object]] = []
        try:
            wait_for(
                "the EPP's pool averages equal to the engines' own gauges", same, timeout=90, interval=0.5
            )
        except AssertionError as e:
            raise AssertionError(f"{e}; last seen: {seen}; generations: {_GENERATIONS}") from None
    finally:
        stop.set()
        for t in threads:
            t.join()


def _generate_until(engine: Engine, model: str, stop: threading.Event) -> None:
    """Completions of 1,500 tokens, one after the other until ``stop`` is set (the tiny model
    finishes one in seconds: the engine keeps a request running only while a new one follows). Not
    streamed: a stream's thousands of events a second would take the CPUs the EPP's scrapes need."""
    body = {"model": model, "prompt": f"{_tag()} go", "max_tokens": 1500, "ignore_eos": True}
    while not stop.is_set():
        conn = HTTPConnection(engine.host, engine.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            resp = conn.getresponse()
            _GENERATIONS.append((resp.status, resp.read()[:120]))
            if resp.status != 200:
                return
        finally:
            conn.close()


_GENERATIONS: list[tuple[int, bytes]] = []  # each long generation's status and first line (for failures)


def _precise_hit(front: Front, pool: Pool, model: str) -> None:
    """Each engine holds a prompt it was sent directly; the same prompt with a new tail through
    Envoy goes to that engine, and that engine's vLLM counts the prefix as a cache hit."""
    for target in pool.engines:
        text = prompt(_tag(), blocks=4)
        indexed = front.admissions()
        target.complete(text, model)  # the engine stores the blocks and publishes them
        front.wait_indexed(indexed, 3, f"{target.name}'s blocks of the prompt in the EPP's index")
        before = {e.name: e.counter("vllm:prefix_cache_hits_total") for e in pool.engines}
        engine, answer = front.complete(text + " and then some more", model=model)
        assert engine.name == target.name, f"routed to {engine.name}, the prefix is on {target.name}"
        hits = target.counter("vllm:prefix_cache_hits_total") - before[target.name]
        assert hits >= 3 * pool.block_size, f"{target.name} counted {hits} prefix-hit tokens"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * pool.block_size


def test_precise_routing_confirmed_by_vllm_prefix_cache_hits(pool: Pool, rig: Rig) -> None:
    front = start_front(rig, pool)
    for _ in range(2):
        _precise_hit(front, pool, pool.model)


def test_lora_adapter_routed_by_its_events(pool: Pool, rig: Rig) -> None:
    if not pool.lora:
        import pytest

        pytest.skip("no LoRA adapter (EPP_ENGINE_LORA)")
    front = start_front(rig, pool)
    _precise_hit(front, pool, pool.lora)


def test_render_endpoint_serves_the_token_producer(pool: Pool, rig: Rig) -> None:
    """vLLM 0.32 answers its render endpoints only with ``--enable-scale-out`` (what the engines are
    started with): the token-producer's vllm backend gets tokens, no render fails."""
    status, _, body = http(
        f"{pool.engines[0].url}/v1/completions/render", {"model": pool.model, "prompt": "hello"}
    )
    assert status == 200, body[:300]
    rendered = json.loads(body)
    assert isinstance(rendered, list) and rendered[0]["token_ids"]
    front = start_front(rig, pool)
    for _ in range(3):
        front.complete(prompt(_tag(), blocks=1))
    page = front.epp_metrics()
    assert total(page, "llm_d_epp_token_producer_render_failures_total") == 0
    assert total(page, "llm_d_epp_token_producer_render_cache_total", 'result="miss"') >= 3


def test_cached_tokens_reported_and_recorded(pool: Pool, rig: Rig) -> None:
    """The engines report ``prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``)
    and the EPP's ``llm_d_epp_request_cached_tokens`` records them."""
    front = start_front(rig, pool, response_phases=True)
    text = prompt(_tag(), blocks=4)
    indexed = front.admissions()
    front.complete(text)
    front.wait_indexed(indexed, 3, "the prompt's blocks in the EPP's index")  # the second follows
    _, answer = front.complete(text)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 3 * pool.block_size
    wait_for(
        "llm_d_epp_request_cached_tokens samples",
        lambda: total(front.epp_metrics(), "llm_d_epp_request_cached_tokens_sum") >= cached,
        timeout=10,
    )
