"""The simulator's KV-cache admin endpoints: vLLM's ``POST /reset_prefix_cache`` and the
simulator-only ``/sim/kv-events`` (publisher state), ``/sim/kv-events/drop`` (a sequence gap) and
``/sim/kv-events/corrupt`` (a malformed message)."""

from __future__ import annotations

from aiohttp import web

from epp.dev.sim.context import ENGINE_KEY, PUBLISHER_KEY
from epp.dev.sim.kv_events import ZmqEventPublisher
from epp.dev.sim.openai import OpenAIError, bad_request, json_response

MAX_FAULTS = 100_000


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Forget every cached block and publish ``AllBlocksCleared``; 409 while requests hold blocks
    (vLLM refuses the reset then, too)."""
    engine = request.app[ENGINE_KEY]
    if not engine.reset_prefix_cache():
        raise OpenAIError(
            409,
            f"prefix cache not reset: {engine.kv.pinned_blocks} blocks are in use by running requests",
            "ConflictError",
        )
    return json_response({"reset": True})


async def kv_events_state(request: web.Request) -> web.Response:
    """Where the KV events go (the bound endpoints, useful with wildcard ports) and the next seq."""
    publisher = _publisher(request)
    return json_response(
        {
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "topic": publisher.topic,
            "data_parallel_rank": publisher.data_parallel_rank,
            "next_seq": publisher.next_seq,
            "queue_overflows": publisher.queue_overflows,
        }
    )


async def drop_kv_events(request: web.Request) -> web.Response:
    """Simulator-only fault: the next ``count`` batches get sequence numbers and stay in the replay
    buffer but are not sent on PUB, so a subscriber sees a gap."""
    publisher = _publisher(request)
    pending = publisher.drop_next(_count(request))
    return json_response({"pending_faults": pending, "next_seq": publisher.next_seq})


async def corrupt_kv_events(request: web.Request) -> web.Response:
    """Simulator-only fault: the next ``count`` batches are sent on PUB with a payload that is not
    msgpack (their real payload stays in the replay buffer), so a subscriber gets malformed messages."""
    publisher = _publisher(request)
    pending = publisher.corrupt_next(_count(request))
    return json_response({"pending_faults": pending, "next_seq": publisher.next_seq})


def _count(request: web.Request) -> int:
    text = request.query.get("count", "1")
    try:
        count = int(text)
    except ValueError:
        raise bad_request(f"count must be an integer, got {text!r}", "count") from None
    if not 1 <= count <= MAX_FAULTS:
        raise bad_request(f"count must be in 1..{MAX_FAULTS}, got {count}", "count")
    return count


def _publisher(request: web.Request) -> ZmqEventPublisher:
    publisher = request.app[PUBLISHER_KEY].publisher
    if publisher is None:
        raise OpenAIError(409, "KV events are not enabled (see --kv-events-config)", "ConflictError")
    return publisher
