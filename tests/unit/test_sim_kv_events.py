"""The simulator's vLLM KV events on real ZMQ sockets on 127.0.0.1: a SUB and a DEALER client decode
what ``epp sim`` publishes with plain msgpack (``msgspec.msgpack.decode`` to lists and dicts, not the
simulator's types) and check the fields, sequence numbers, replay (also after a dropped stretch),
prefix-cache reset, data-parallel ports and both encodings, and that the blocks reported stored minus
those reported removed are exactly the blocks the engine's cache holds."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import cbor2
import msgspec
import pytest
import zmq
import zmq.asyncio

from epp.dev.sim.cli import add_arguments, config_from_args
from epp.dev.sim.engine import Engine, RequestSpec, SimConfig
from epp.dev.sim.kv_events import KVEventsConfig, offset_endpoint
from epp.dev.sim.server import SimCluster, SimServer

BLOCK = 4
RECV_TIMEOUT_MS = 10_000


def sim_config(**overrides: Any) -> SimConfig:
    events = overrides.pop("events", {})
    options: dict[str, Any] = {
        "port": 0,
        "time_scale": 0.0,
        "block_size": BLOCK,
        "kv_cache_size": 64,
        "max_tokens": 1,
        "hash_seed": "0",
        "prefix_caching_hash_algo": "sha256_cbor",
        "kv_events_config": KVEventsConfig(
            **(
                {
                    "enable_kv_cache_events": True,
                    "endpoint": "tcp://127.0.0.1:*",
                    "replay_endpoint": "tcp://127.0.0.1:*",
                }
                | events
            )
        ),
    } | overrides
    return SimConfig(**options)


def low64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def expected_hashes(token_ids: list[int], seed: str = "0") -> list[int]:
    """vLLM's sha256_cbor chain computed here, independently of the simulator's code."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        payload = (parent, tuple(token_ids[start : start + BLOCK]), None)
        parent = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
        out.append(low64(parent))
    return out


class Subscriber:
    """A SUB socket on the simulator's PUB endpoint, decoding ``[topic, seq, payload]``."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = False) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self.frames: list[tuple[bytes, int, bytes]] = []

    async def recv(self) -> tuple[bytes, int, Any]:
        if not await self.sock.poll(RECV_TIMEOUT_MS):
            raise AssertionError("no KV event batch arrived")
        topic, seq, payload = await self.sock.recv_multipart()
        assert len(seq) == 8
        self.frames.append((topic, int.from_bytes(seq, "big"), payload))
        return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    async def until_seq(self, last: int) -> list[tuple[bytes, int, Any]]:
        """Every batch up to sequence number ``last`` (inclusive)."""
        batches = []
        while True:
            batch = await self.recv()
            batches.append(batch)
            if batch[1] >= last:
                return batches

    def close(self) -> None:
        self.sock.close(linger=0)


async def settled(server: SimServer) -> int:
    """Wait until the publisher thread has sent everything published; the next sequence number."""
    publisher = server.publisher
    assert publisher is not None
    for _ in range(1000):
        if publisher.idle:
            return publisher.next_seq
        await asyncio.sleep(0.01)
    raise AssertionError("the publisher never caught up")


async def synced(ctx: zmq.asyncio.Context, server: SimServer, http: aiohttp.ClientSession) -> Subscriber:
    """A subscriber that has received at least one batch (ZMQ drops what a SUB misses while it joins):
    reset the idle prefix cache, which publishes ``AllBlocksCleared``, until a batch arrives."""
    assert server.publisher is not None
    sub = Subscriber(ctx, server.publisher.endpoint)
    for _ in range(200):
        async with http.post(f"{server.url}/reset_prefix_cache") as response:
            assert response.status == 200
        if await sub.sock.poll(50):
            last = await settled(server) - 1
            if sub.frames and sub.frames[-1][1] >= last:
                return sub
            await sub.until_seq(last)  # drain the probes that made it
            return sub
    raise AssertionError("the subscriber never received a batch")


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 1} | extra
    async with http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


@asynccontextmanager
async def running(
    config: SimConfig,
) -> AsyncIterator[tuple[SimServer, aiohttp.ClientSession, zmq.asyncio.Context]]:
    ctx = zmq.asyncio.Context()
    try:
        async with SimServer(config) as server, aiohttp.ClientSession() as http:
            yield server, http, ctx
    finally:
        ctx.destroy(linger=0)


def stored(event: Any, encoding: str) -> dict[str, Any]:
    """A BlockStored event as a dict, checking its positional layout in the array encoding."""
    if encoding == "map":
        assert isinstance(event, dict)
        return event
    assert isinstance(event, list)
    names = [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    ]  # fmt: skip
    assert len(event) == len(names)  # msgspec writes every field of an array-like struct
    assert event[-1] is None
    return dict(zip(names, event, strict=True))


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_block_stored_carries_vllm_fields_hashes_and_sequence(encoding: str) -> None:
    async with running(sim_config(kv_events_encoding=encoding)) as (server, http, ctx):
        sub = await synced(ctx, server, http)
        first_seq = await settled(server)
        prompt = list(range(100, 110))  # 10 tokens: 2 full blocks of 4
        await complete(http, server.url, prompt)
        topic, seq, batch = await sub.recv()
        assert topic == b""  # vLLM's default topic
        assert seq == first_seq
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        assert len(events) == 1
        event = stored(events[0], encoding)
        if encoding == "map":
            assert "kv_cache_spec_sliding_window" not in event
        assert event["type"] == "BlockStored"
        token_ids = event["token_ids"]
        assert len(token_ids) == 2 * BLOCK
        assert event["block_hashes"] == expected_hashes(token_ids)
        assert event["parent_block_hash"] is None
        assert event["block_size"] == BLOCK
        assert (event["lora_id"], event["lora_name"], event["medium"]) == (None, None, "GPU")
        assert event["extra_keys"] == [None, None]
        assert (event["group_idx"], event["kv_cache_spec_kind"]) == (0, "full_attention")
        stored_hashes = set(event["block_hashes"])
        assert stored_hashes == {low64(h) for h in server.engine.kv.cached_hashes()}

        # A longer prompt sharing both blocks stores only its new block, chained to the cached ones.
        await complete(http, server.url, prompt[:8] + list(range(200, 206)))
        _, next_seq, (_, events, _) = await sub.recv()
        assert next_seq == seq + 1
        extension = stored(events[0], encoding)
        assert extension["parent_block_hash"] == event["block_hashes"][-1]
        assert len(extension["block_hashes"]) == 1
        assert extension["block_hashes"] == expected_hashes(token_ids + extension["token_ids"])[2:]
        sub.close()


async def test_stored_minus_removed_is_what_the_cache_holds_under_eviction() -> None:
    async with running(sim_config(kv_cache_size=8)) as (server, http, ctx):
        sub = await synced(ctx, server, http)
        assert server.publisher is not None
        for index in range(12):  # 12 prompts of 3 full blocks each through an 8-block cache
            await complete(http, server.url, [500 * index + t for t in range(13)])
        await sub.until_seq(await settled(server) - 1)
        held: set[int] = set()
        removed_any = False
        seqs = [seq for _, seq, _ in sub.frames]
        assert seqs == list(range(seqs[0], seqs[-1] + 1))  # no gap, no repeat
        for _, _, payload in sub.frames:
            for event in msgspec.msgpack.decode(payload)[1]:
                if event["type"] == "AllBlocksCleared":
                    held.clear()
                elif event["type"] == "BlockStored":
                    assert not held & set(event["block_hashes"])
                    held |= set(event["block_hashes"])
                elif event["type"] == "BlockRemoved":
                    assert event["medium"] == "GPU" and event["group_idx"] == 0
                    assert set(event["block_hashes"]) <= held
                    held -= set(event["block_hashes"])
                    removed_any = True
        assert removed_any
        assert held == {low64(h) for h in server.engine.kv.cached_hashes()}
        assert len(held) == server.engine.kv.cached_blocks <= 8
        sub.close()


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the ROUTER for every buffered batch from ``start``; the replies up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            assert await dealer.poll(RECV_TIMEOUT_MS), "no replay reply"
            frames = await dealer.recv_multipart()
            replies.append(frames)
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                return replies
    finally:
        dealer.close(linger=0)


async def test_dropped_batches_leave_a_gap_that_replay_fills_byte_for_byte() -> None:
    async with running(sim_config()) as (server, http, ctx):
        sub = await synced(ctx, server, http)
        publisher = server.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        before = await settled(server)
        async with http.post(f"{server.url}/sim/kv-events/drop", params={"count": "2"}) as response:
            assert response.status == 200
            assert (await response.json())["pending_faults"] == 2
        for index in range(3):  # three new prompts: one BlockStored batch each
            await complete(http, server.url, [6000 + 100 * index + t for t in range(8)])
        topic, seq, _ = await sub.recv()
        assert seq == before + 2  # the two dropped batches never came on PUB
        live_payload = sub.frames[-1][2]

        replies = await replay(ctx, publisher.replay_endpoint, before)
        assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        batches = replies[:-1]
        assert [int.from_bytes(frames[2], "big") for frames in batches] == [before, before + 1, before + 2]
        assert all(frames[0] == b"" and frames[1] == topic for frames in batches)
        assert batches[-1][3] == live_payload  # the buffered bytes are exactly what went out live
        gap = [msgspec.msgpack.decode(frames[3])[1][0] for frames in batches[:2]]
        assert [event["type"] for event in gap] == ["BlockStored", "BlockStored"]

        # Replay from the start returns the whole buffer, the sync probes included.
        everything = await replay(ctx, publisher.replay_endpoint, 0)
        assert [int.from_bytes(f[2], "big") for f in everything[:-1]] == list(range(before + 3))
        sub.close()


async def test_legacy_replay_replies_have_no_topic_frame() -> None:
    async with running(sim_config(kv_events_replay_format="legacy")) as (server, http, ctx):
        await complete(http, server.url, list(range(8)))
        publisher = server.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        assert await settled(server) == 1
        replies = await replay(ctx, publisher.replay_endpoint, 0)
        assert replies[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert len(replies[0]) == 3 and int.from_bytes(replies[0][1], "big") == 0
        assert msgspec.msgpack.decode(replies[0][2])[1][0]["type"] == "BlockStored"


async def test_reset_clears_the_cache_publishes_all_blocks_cleared_and_refuses_while_busy() -> None:
    async with running(sim_config(kv_events_encoding="array")) as (server, http, ctx):
        sub = await synced(ctx, server, http)
        await complete(http, server.url, list(range(12)))
        await sub.recv()
        assert server.engine.kv.cached_blocks == 3
        seq = server.engine.submit(RequestSpec.of("busy", "demo", list(range(100, 108)), 1))
        async with http.post(f"{server.url}/reset_prefix_cache") as response:
            assert response.status == 409
            assert "in use" in (await response.json())["error"]["message"]
        assert server.engine.kv.cached_blocks == 5  # nothing was cleared
        await sub.recv()  # the busy request's own BlockStored
        server.engine.abort(seq)
        async with http.post(f"{server.url}/reset_prefix_cache") as response:
            assert response.status == 200
        _, _, (_, events, _) = await sub.recv()
        assert events == [["AllBlocksCleared"]]
        assert server.engine.kv.cached_blocks == 0
        result = await complete(http, server.url, list(range(12)))
        assert result["usage"].get("prompt_tokens_details") in (None, {"cached_tokens": 0})
        sub.close()


def _consecutive_free_ports() -> int:
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
                return base
    raise AssertionError("no two consecutive free ports")


async def test_data_parallel_ranks_offset_ports_and_stamp_their_rank() -> None:
    pub_port, replay_port = _consecutive_free_ports(), _consecutive_free_ports()
    ctx = zmq.asyncio.Context()
    # Endpoints without "*" are connected to (vLLM's rule), so the subscribers bind here.
    subs = [Subscriber(ctx, f"tcp://127.0.0.1:{pub_port + rank}", bind=True) for rank in range(2)]
    config = sim_config(
        data_parallel_size=2,
        events={
            "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": "kv@pod-a@demo",
        },
    )
    try:
        async with SimCluster(config) as cluster, aiohttp.ClientSession() as http:
            for rank, server in enumerate(cluster.servers):
                assert server.publisher is not None
                assert server.publisher.replay_endpoint == f"tcp://127.0.0.1:{replay_port + rank}"
                for attempt in range(200):  # a connecting PUB drops batches until the link is up
                    await complete(http, server.url, [rank * 4000 + attempt * 4 + t for t in range(4)])
                    if await subs[rank].sock.poll(50):
                        break
                topic, _, (_, events, batch_rank) = await subs[rank].recv()
                assert topic == b"kv@pod-a@demo"
                assert batch_rank == rank
                assert events[0]["type"] == "BlockStored"
    finally:
        for sub in subs:
            sub.close()
        ctx.destroy(linger=0)


def test_endpoint_offsets_follow_vllm() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint(None, 2) is None
    with pytest.raises(ValueError, match="tcp"):
        offset_endpoint("udp://x:1", 1)


def test_kv_events_flags_parse_vllm_json_and_reject_bad_fields() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001",'
            ' "buffer_steps": 5, "topic": "kv@p@m"}',
            "--kv-events-encoding",
            "array",
            "--prefix-caching-hash-algo",
            "xxhash_cbor",
        ]
    )
    config = config_from_args(args)
    assert config.kv_events_config == KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:6000",
        replay_endpoint="tcp://*:6001",
        buffer_steps=5,
        topic="kv@p@m",
    )
    assert config.kv_events_config.publisher == "zmq" and config.kv_events_enabled
    assert (config.kv_events_encoding, config.prefix_caching_hash_algo) == ("array", "xxhash_cbor")
    assert not config_from_args(parser.parse_args([])).kv_events_enabled
    for bad in ('{"buffer_steps": "x"}', "[1]", "{", '{"publisher": "kafka"}', '{"hwm": true}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-events-config", bad])


def test_kv_events_layout_flag_picks_the_engine_version_and_its_hashing() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--kv-events-layout", "vllm-0.20"]))
    assert config.kv_events_layout == "vllm-0.20"
    assert Engine(config).kv.hasher.version == (0, 20)
    assert Engine(config_from_args(parser.parse_args([]))).kv.hasher.version == (0, 34)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-layout", "vllm-9.9"])
    with pytest.raises(ValueError, match=r"kv_events_layout must be one of vllm-0\.10"):
        SimConfig(kv_events_layout="trtllm")


async def test_drop_hook_errors_are_precise() -> None:
    async with running(sim_config()) as (server, http, _):
        response = await http.post(f"{server.url}/sim/kv-events/drop", params={"count": "0"})
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "count"
    async with running(sim_config(kv_events_config=None)) as (server, http, _):
        response = await http.post(f"{server.url}/sim/kv-events/drop")
        assert response.status == 409
        assert "not enabled" in (await response.json())["error"]["message"]


async def test_cache_salt_keys_the_first_block_and_is_validated() -> None:
    async with running(sim_config()) as (server, http, ctx):
        sub = await synced(ctx, server, http)
        await complete(http, server.url, list(range(8)), cache_salt="tenant-a")
        _, _, (_, events, _) = await sub.recv()
        assert events[0]["extra_keys"] == [["tenant-a"], None]
        plain = expected_hashes(events[0]["token_ids"])
        assert events[0]["block_hashes"][0] != plain[0] and events[0]["block_hashes"][1] != plain[1]
        body = {"model": "demo", "prompt": [1, 2], "cache_salt": 7}
        async with http.post(f"{server.url}/v1/completions", json=body) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "cache_salt"
        sub.close()


async def test_engine_without_a_sink_discards_events() -> None:
    engine = Engine(sim_config(port=8000))
    seq = engine.submit(RequestSpec.of("r", "demo", list(range(8)), 1))
    engine.abort(seq)
    assert engine.kv.take_events() == []  # flushed at every scheduling step, nothing accumulates


async def test_the_epp_sim_process_publishes_hashes_seeded_by_pythonhashseed() -> None:
    """The real ``epp sim`` command: flags from the command line, the seed from the environment."""
    http_port, pub_port = _consecutive_free_ports(), _consecutive_free_ports()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"} | {"PYTHONHASHSEED": "0"}
    argv = [
        sys.executable, "-m", "epp", "sim", "--port", str(http_port), "--name", "pod-x",
        "--block-size", str(BLOCK), "--time-scale", "0", "--max-tokens", "1",
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}"}),
    ]  # fmt: skip
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ctx = zmq.asyncio.Context()
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{pub_port}")
    url = f"http://127.0.0.1:{http_port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
                try:
                    async with http.get(f"{url}/health") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            for attempt in range(200):  # until the SUB has joined: each prompt is new, so it publishes
                await complete(http, url, [attempt * 8 + t for t in range(8)])
                if await sub.sock.poll(50):
                    break
            topic, _, (_, events, rank) = await sub.recv()
        assert (topic, rank) == (b"", 0)  # vLLM's default topic
        assert events[0]["block_hashes"] == expected_hashes(events[0]["token_ids"], seed="0")
    finally:
        sub.close()
        ctx.destroy(linger=0)
        process.terminate()
        process.wait(timeout=30)


async def test_a_busy_kv_events_port_fails_start_up_with_the_endpoint_named() -> None:
    ctx = zmq.asyncio.Context()
    holder = ctx.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://*")
    server = SimServer(sim_config(events={"endpoint": f"tcp://*:{port}"}))
    try:
        with pytest.raises(OSError, match=f"KV events socket \\(tcp://\\*:{port}"):
            await server.start()
    finally:
        await server.stop()
        holder.close(linger=0)
        ctx.destroy(linger=0)


async def test_a_corrupted_batch_is_malformed_on_pub_and_whole_in_replay() -> None:
    async with running(sim_config()) as (server, http, ctx):
        sub = await synced(ctx, server, http)
        publisher = server.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        before = await settled(server)
        async with http.post(f"{server.url}/sim/kv-events/corrupt") as response:
            assert response.status == 200
        await complete(http, server.url, list(range(300, 308)))
        await complete(http, server.url, list(range(400, 408)))
        assert await sub.sock.poll(RECV_TIMEOUT_MS)
        _, seq, payload = await sub.sock.recv_multipart()
        assert int.from_bytes(seq, "big") == before
        with pytest.raises(msgspec.DecodeError):
            msgspec.msgpack.decode(payload)
        _, next_seq, (_, events, _) = await sub.recv()  # the fault hit one batch only
        assert next_seq == before + 1 and events[0]["type"] == "BlockStored"
        replies = await replay(ctx, publisher.replay_endpoint, before)
        replayed = msgspec.msgpack.decode(replies[0][3])
        assert int.from_bytes(replies[0][2], "big") == before
        assert replayed[1][0]["type"] == "BlockStored"
        sub.close()


@pytest.mark.parametrize(("host", "bound"), [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
async def test_wildcard_kv_event_sockets_bind_only_the_sims_listen_host(host: str, bound: str) -> None:
    config = sim_config(host=host, events={"endpoint": "tcp://*:*", "replay_endpoint": "tcp://*:*"})
    async with SimServer(config) as server:
        assert server.publisher is not None
        assert server.publisher.endpoint.startswith(f"tcp://{bound}:")
        assert server.publisher.replay_endpoint is not None
        assert server.publisher.replay_endpoint.startswith(f"tcp://{bound}:")
