"""Load generator for ``bench/routing.py`` (and the routing-quality integration test).

``--scenario groups`` (open loop): seeded groups of streaming chat requests sharing a system prompt,
Poisson arrivals. ``--scenario sessions`` (closed loop per session): multi-turn conversations, each
with its own long system prompt, whose history grows every turn; a session sends its next turn a
think time after the previous answer, sessions start at Poisson times and interleave. Per request the
TTFT, output tokens, serving pod and error, as one JSON document on ``--output`` (default stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PATH = "/v1/chat/completions"

# A small vocabulary: the system prompts are random sentences over it (varied text, not one
# repeated phrase, so every group's prompt is distinct from its first characters on).
_VOCABULARY = (
    "account adapter admission affinity allocate analysis answer archive arrival attention backend "
    "balance batch block boundary budget buffer cache capacity channel chunk cluster compute config "
    "context counter decode default deploy detail device digest document domain endpoint engine "
    "estimate event evict expert factor feature filter fleet format gateway gradient graph group "
    "handler header health history index input kernel latency layer ledger limit listener memory "
    "metric model module network node number object operator output packet pipeline policy pool "
    "prefill prefix priority profile prompt protocol queue quota range ratio record region replica "
    "request resource response route runtime sample schedule scorer segment sequence server session "
    "shard signal source stream subset system table target tensor thread token topic trace traffic "
    "update value vector version window worker workload"
)
_WORDS = _VOCABULARY.split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 16))]
    return " ".join(words).capitalize() + "."


def system_prompt(group: int, chars: int, seed: int) -> str:
    """About ``chars`` characters of varied text, the same for the same (group, seed)."""
    rng = random.Random(f"system-{seed}-{group}")
    parts = [f"You are assistant number {group} of the routing benchmark."]
    size = len(parts[0])
    while size < chars:
        parts.append(sentence(rng))
        size += len(parts[-1]) + 1
    return " ".join(parts)[:chars]


@dataclass
class Planned:
    index: int
    group: int
    at: float  # seconds after the start
    body: bytes


def plan(
    *, requests: int, groups: int, rate: float, prompt_chars: int, max_tokens: int, model: str, seed: int
) -> list[Planned]:
    """The workload: the same arguments always give the same requests at the same offsets."""
    rng = random.Random(f"plan-{seed}")
    prompts = [system_prompt(g, prompt_chars, seed) for g in range(groups)]
    out: list[Planned] = []
    at = 0.0
    for i in range(requests):
        group = rng.randrange(groups)
        question = f"Question {i} ({rng.getrandbits(48):012x}): {sentence(rng)} Please explain briefly."
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": prompts[group]},
                {"role": "user", "content": question},
            ],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.append(Planned(i, group, at, json.dumps(body).encode()))
        at += rng.expovariate(rate) if rate > 0 else 0.0
    return out


@dataclass
class Session:
    """One conversation: its start offset and, per turn, the user message and the assistant reply
    that the next turn carries in its history (planned, so every config sees the same prompts)."""

    index: int
    at: float
    system: str
    turns: list[tuple[str, str]]


def plan_sessions(
    *,
    sessions: int,
    turns: int,
    rate: float,
    system_chars: int,
    turn_chars: int,
    seed: int,
    system_groups: int = 0,
) -> list[Session]:
    """Multi-turn sessions; the same arguments always give the same conversations. ``system_groups``
    > 0: session s has the system prompt of group s mod ``system_groups`` (else one of its own)."""
    rng = random.Random(f"sessions-{seed}")
    out: list[Session] = []
    at = 0.0
    for s in range(sessions):
        system = system_prompt(1000 + (s % system_groups if system_groups > 0 else s), system_chars, seed)
        conv = []
        for t in range(turns):
            user = f"Turn {t} of session {s} ({rng.getrandbits(48):012x}): " + _text(rng, turn_chars)
            reply = _text(rng, max(1, turn_chars // 2))
            conv.append((user, reply))
        out.append(Session(s, at, system, conv))
        at += rng.expovariate(rate) if rate > 0 else 0.0
    return out


def _text(rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    size = 0
    while size < chars:
        parts.append(sentence(rng))
        size += len(parts[-1]) + 1
    return " ".join(parts)[:chars]


def session_messages(session: Session, turn: int) -> list[dict[str, str]]:
    """The messages of ``turn``: the system prompt, every earlier turn with its reply, the new question."""
    messages = [{"role": "system", "content": session.system}]
    for user, reply in session.turns[:turn]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": session.turns[turn][0]})
    return messages


def session_body(session: Session, turn: int, *, model: str, max_tokens: int) -> bytes:
    body = {
        "model": model,
        "messages": session_messages(session, turn),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


@dataclass
class Record:
    index: int
    group: int
    status: int = 0
    ttft: float | None = None  # seconds
    latency: float | None = None  # seconds, send to end of stream
    output_tokens: int = 0
    pod: str = ""
    error: str = ""
    start: float = 0.0  # seconds after the run's start
    end: float = 0.0
    prompt_tokens: int = 0  # from the usage chunk
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: the engine's prefix-cache hit


async def _one(session: Any, url: str, item: Planned, t0: float, timeout: float) -> Record:
    import aiohttp

    rec = Record(item.index, item.group)
    sent = time.perf_counter()
    rec.start = sent - t0
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with session.post(
            url,
            data=item.body,
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            rec.status = resp.status
            rec.pod = resp.headers.get("x-inference-pod", "")
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - sent
                    if data == b"[DONE]":
                        continue
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        usage_tokens = int(usage.get("completion_tokens") or 0)
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(details.get("cached_tokens") or 0)
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                        chunks += 1
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    end = time.perf_counter()
    rec.end = end - t0
    if not rec.error:
        rec.latency = end - sent
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return rec


def _pick(urls: list[str], seed: int) -> Any:
    """A seeded choice of gateway per request (the same sequence for every config)."""
    rng = random.Random(f"gateway-{seed}")
    return lambda: urls[rng.randrange(len(urls))] if len(urls) > 1 else urls[0]


async def run(
    urls: list[str], items: list[Planned], *, timeout: float, connections: int, seed: int = 1
) -> dict[str, Any]:
    """Send every planned request at its offset (open loop) and collect the records."""
    import aiohttp

    pick = _pick(urls, seed)

    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        tasks = []
        for item in items:
            delay = t0 + item.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, pick() + PATH, item, t0, timeout)))
        records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return {"wall_seconds": wall, "requests": [asdict(r) for r in records]}


async def run_sessions(
    urls: list[str],
    sessions: list[Session],
    *,
    model: str,
    max_tokens: int,
    think_time: float,
    seed: int,
    timeout: float,
    connections: int,
) -> dict[str, Any]:
    """Run every session's turns in order (each after the previous answer and a think time)."""
    import aiohttp

    rng = random.Random(f"think-{seed}")
    pick = _pick(urls, seed)
    thinks = [[rng.expovariate(1 / think_time) if think_time > 0 else 0.0 for _ in s.turns] for s in sessions]
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    records: list[Record] = []
    async with aiohttp.ClientSession(connector=connector) as client:
        t0 = time.perf_counter()

        async def one_session(s: Session) -> None:
            await asyncio.sleep(max(0.0, t0 + s.at - time.perf_counter()))
            for turn in range(len(s.turns)):
                body = session_body(s, turn, model=model, max_tokens=max_tokens)
                item = Planned(s.index * 1000 + turn, s.index, time.perf_counter() - t0, body)
                records.append(await _one(client, pick() + PATH, item, t0, timeout))
                await asyncio.sleep(thinks[s.index][turn])

        await asyncio.gather(*(one_session(s) for s in sessions))
        wall = time.perf_counter() - t0
    return {"wall_seconds": wall, "requests": [asdict(r) for r in records]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--url",
        required=True,
        help="base URL, e.g. http://127.0.0.1:8081 (the Envoy listener); several comma-separated: "
        "every request goes to one of them at random (seeded), as an L4 load balancer in front of replicas",
    )
    add("--rate", type=float, default=6.0, help="Poisson arrival rate, requests/s; 0 sends all at once")
    add("--requests", type=int, default=240, help="number of requests (default 240)")
    add("--groups", type=int, default=8, help="groups sharing a system prompt (default 8)")
    add("--prompt-chars", type=int, default=12000, help="system prompt length in characters (12000)")
    add("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    add("--model", default="demo", help="model name (default demo)")
    add("--seed", type=int, default=1, help="workload seed (default 1)")
    add("--timeout", type=float, default=120.0, help="per-request timeout in seconds (default 120)")
    add("--connections", type=int, default=512, help="connection pool limit (default 512)")
    add("--output", default="-", help="where to write the JSON result (default stdout)")
    add("--scenario", choices=("groups", "sessions"), default="groups", help="workload (default groups)")
    add("--sessions", type=int, default=24, help="sessions scenario: conversations (default 24)")
    add("--turns", type=int, default=6, help="sessions scenario: turns per conversation (default 6)")
    add("--turn-chars", type=int, default=2000, help="sessions scenario: user message length (2000)")
    add("--think-time", type=float, default=1.0, help="sessions scenario: mean think time in s (1.0)")
    add(
        "--system-groups",
        type=int,
        default=0,
        help="sessions scenario: sessions share the system prompts of this many groups (default 0: one each)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.scenario == "sessions":
        planned = plan_sessions(
            sessions=args.sessions,
            turns=args.turns,
            rate=args.rate,
            system_chars=args.prompt_chars,
            turn_chars=args.turn_chars,
            seed=args.seed,
            system_groups=args.system_groups,
        )
        coro: Any = run_sessions(
            _urls(args.url),
            planned,
            model=args.model,
            max_tokens=args.max_tokens,
            think_time=args.think_time,
            seed=args.seed,
            timeout=args.timeout,
            connections=args.connections,
        )
        return _finish(coro, args.output)
    items = plan(
        requests=args.requests,
        groups=args.groups,
        rate=args.rate,
        prompt_chars=args.prompt_chars,
        max_tokens=args.max_tokens,
        model=args.model,
        seed=args.seed,
    )
    return _finish(
        run(_urls(args.url), items, timeout=args.timeout, connections=args.connections, seed=args.seed),
        args.output,
    )


def _urls(text: str) -> list[str]:
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


def _finish(coro: Any, output: str) -> int:
    try:
        import uvloop

        result = uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency of the test extra
        result = asyncio.run(coro)
    text = json.dumps(result)
    if output == "-":
        print(text)
    else:
        Path(output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
