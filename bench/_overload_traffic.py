"""Load generator for ``bench/overload.py``: tenants of streaming chat requests, each with its headers.

``open`` mode: every traffic class sends Poisson arrivals at its own rate for ``duration`` seconds
(seeded; arrivals do not wait for answers). ``closed`` mode: each class keeps ``concurrency`` requests
in flight until ``duration`` is over, their first sends spread over ``ramp`` seconds so completions
do not come in lockstep batches (the capacity calibration). Per request: the class, start and
end offsets, HTTP status, client-side TTFT (first SSE data line), the ``x-llm-d-request-dropped-reason``
response header and an error kind; one JSON document on ``--output``. The plan is a JSON file:
``{"url", "mode", "duration", "timeout", "seed", "model", "max_tokens", "ramp", "classes": [{"name",
"rate", "concurrency", "headers"}]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._loadgen import sentence

PATH = "/v1/chat/completions"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


@dataclass
class Record:
    cls: str
    index: int
    start: float = 0.0  # seconds after the run's start
    end: float = 0.0
    status: int = 0
    ttft: float | None = None  # seconds, send to the first SSE data line
    output_tokens: int = 0
    dropped_reason: str = ""
    error: str = ""  # "" = completed; "http", "timeout", "connection" or "stream"
    detail: str = ""
    pod: str = ""


def body(cls: str, index: int, rng: random.Random, *, model: str, max_tokens: int) -> bytes:
    """A short chat request, unique from its first characters (no prefix-cache affinity), asking
    for 1 .. 2 x ``max_tokens`` - 1 tokens (mean ``max_tokens``): answers of one length would keep
    the engines' batches in lockstep, every slot freeing at once."""
    text = f"{cls} request {index} ({rng.getrandbits(48):012x}): {sentence(rng)} Answer briefly."
    doc = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": rng.randint(1, max(1, 2 * max_tokens - 1)),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(doc).encode()


async def one(
    session: Any, url: str, rec: Record, payload: bytes, headers: dict[str, str], t0: float, timeout: float
) -> Record:
    import aiohttp

    sent = time.perf_counter()
    rec.start = sent - t0
    tokens = 0
    try:
        async with session.post(
            url,
            data=payload,
            headers={"content-type": "application/json", **headers},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            rec.status = resp.status
            rec.pod = resp.headers.get("x-inference-pod", "")
            rec.dropped_reason = resp.headers.get(DROPPED_REASON_HEADER, "")
            if resp.status != 200:
                rec.error = "http"
                rec.detail = (await resp.text())[:200]
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - sent
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"].get("completion_tokens") or 0)
                if rec.ttft is None:
                    rec.error, rec.detail = "stream", "no data line"
    except TimeoutError as e:
        rec.error, rec.detail = "timeout", str(e)[:200]
    except aiohttp.ClientError as e:
        rec.error, rec.detail = "connection", f"{type(e).__name__}: {e}"[:200]
    except ValueError as e:
        rec.error, rec.detail = "stream", f"{type(e).__name__}: {e}"[:200]
    rec.end = time.perf_counter() - t0
    rec.output_tokens = tokens
    return rec


def arrivals(plan: dict[str, Any]) -> list[tuple[float, int, str]]:
    """``(offset, index, class)`` of every open-loop request, in time order (seeded per class)."""
    out: list[tuple[float, int, str]] = []
    for c in plan["classes"]:
        rate = float(c.get("rate") or 0.0)
        if rate <= 0:
            continue
        rng = random.Random(f"arrivals-{plan['seed']}-{c['name']}")
        at, index = rng.expovariate(rate), 0
        while at < plan["duration"]:
            out.append((at, index, c["name"]))
            at += rng.expovariate(rate)
            index += 1
    out.sort()
    return out


async def run(plan: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    url = plan["url"].rstrip("/") + PATH
    classes = {c["name"]: c for c in plan["classes"]}
    rngs = {name: random.Random(f"prompts-{plan['seed']}-{name}") for name in classes}
    timeout = float(plan["timeout"])
    model, max_tokens = plan["model"], int(plan["max_tokens"])

    def make(name: str, index: int) -> tuple[Record, bytes, dict[str, str]]:
        payload = body(name, index, rngs[name], model=model, max_tokens=max_tokens)
        return Record(name, index), payload, dict(classes[name].get("headers") or {})

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        if plan["mode"] == "closed":
            records: list[Record] = []
            numbers = itertools.count()

            async def worker(name: str, delay: float) -> None:
                await asyncio.sleep(delay)
                while time.perf_counter() - t0 < plan["duration"]:
                    rec, payload, headers = make(name, next(numbers))
                    records.append(await one(session, url, rec, payload, headers, t0, timeout))

            ramp = float(plan.get("ramp") or 0.0)
            starts = [(c["name"], int(c.get("concurrency") or 0)) for c in plan["classes"]]
            await asyncio.gather(*(worker(name, ramp * k / n) for name, n in starts for k in range(n)))
        else:
            tasks = []
            for at, index, name in arrivals(plan):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                rec, payload, headers = make(name, index)
                tasks.append(asyncio.create_task(one(session, url, rec, payload, headers, t0, timeout)))
            records = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0
    return {"wall_seconds": wall, "requests": [asdict(r) for r in records]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="the JSON plan (see the module docstring)")
    parser.add_argument("--output", required=True, help="where to write the JSON result")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    plan = json.loads(Path(args.plan).read_text())
    try:
        import uvloop

        result = uvloop.run(run(plan))
    except ImportError:  # pragma: no cover - uvloop is a dependency of the test extra
        result = asyncio.run(run(plan))
    Path(args.output).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
