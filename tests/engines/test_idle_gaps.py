"""Requests after idle gaps longer than vLLM's keep-alive (uvicorn closes an idle connection after
5 s): Envoy must not send a request on a connection the engine is closing (a 503 ``UC``), and no
health-check blip may fail requests closed."""

from __future__ import annotations

import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from tests.engines.harness import Pool, http, prompt, start_front
from tests.integration.harness import Rig

STREAMS = 16
PER_STREAM = 20
# seconds between a stream's requests: around uvicorn's 5 s keep-alive, where Envoy may reuse a
# connection the engine is closing
GAP = (4.9, 5.2)


def test_requests_after_idle_gaps_never_fail(pool: Pool, rig: Rig) -> None:
    front = start_front(rig, pool)

    def stream(seed: int) -> list[tuple[int, str]]:
        rng = random.Random(seed)
        failures = []
        time.sleep(rng.uniform(0, GAP[1]))  # streams out of phase
        for _ in range(PER_STREAM):
            body = {"model": pool.model, "prompt": prompt(uuid.uuid4().hex[:8], blocks=1), "max_tokens": 2}
            status, _, data = http(front.envoy.url + "/v1/completions", body)
            if status != 200:
                failures.append((status, data[:120].decode(errors="replace")))
            time.sleep(rng.uniform(*GAP))
        return failures

    with ThreadPoolExecutor(STREAMS) as ex:
        results = list(ex.map(stream, range(STREAMS)))
    failures = [f for r in results for f in r]
    assert not failures, f"{len(failures)} of {STREAMS * PER_STREAM} requests failed: {failures[:5]}"
