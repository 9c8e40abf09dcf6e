"""KV events: decoding, and ingestion over real ZMQ sockets on 127.0.0.1 (epp.kvevents)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest

from epp.kvcache import BlockKeyer, KVBlockIndex, block_extras
from epp.kvevents import DecodeError, EventApplier, KVEventsIngester, Target, decode_batch, service
from epp.kvevents import metrics as m
from epp.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored
from tests.unit.kv_publisher import Publisher, batch, free_port, removed, stored, wait

BS = 4
T1 = [1, 2, 3, 4, 5, 6, 7, 8]
T2 = [9, 10, 11, 12]


# --- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_decode_both_encodings(encoding: str) -> None:
    digest = bytes(24) + (0xDEADBEEF).to_bytes(8, "big")
    payload = batch(
        [
            stored([1, digest], T1, parent=7, medium="CPU", lora="ad"),
            removed([3], "GPU"),
            ["AllBlocksCleared"],
        ],
        encoding=encoding,
        rank=1,
    )
    b = decode_batch(payload)
    assert b.data_parallel_rank == 1
    s, r, c = b.events
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved) and isinstance(c, AllBlocksCleared)
    assert s.block_hashes == [1, 0xDEADBEEF] and s.parent == 7 and s.token_ids == T1
    assert (s.medium, s.lora_name, s.block_size) == ("CPU", "ad", BS)
    assert r.block_hashes == [3] and r.medium == "GPU"


def test_decode_negative_hash_is_uint64_and_unknown_tags_are_skipped() -> None:
    b = decode_batch(msgspec.msgpack.encode([0.0, [["BlockRemoved", [-1]], ["Future", 1]]]))
    assert b.events[0].block_hashes == [(1 << 64) - 1]  # type: ignore[union-attr]
    assert b.unknown == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1not msgpack",
        msgspec.msgpack.encode("text"),
        msgspec.msgpack.encode([0.0]),
        msgspec.msgpack.encode([0.0, "events"]),
        msgspec.msgpack.encode([0.0, [["BlockStored", "x", None, [1], 4]]]),
        msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], "4"]]]),
        msgspec.msgpack.encode([0.0, [["BlockRemoved", [1.5]]]]),
        msgspec.msgpack.encode([0.0, [[42]]]),
        msgspec.msgpack.encode([0.0, [{"block_hashes": [1]}]]),
    ],
)
def test_decode_malformed_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_sglang_positional_events() -> None:
    b = decode_batch(
        msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, T2, 4, None, None, None, None, 3]]]),
        "sglang",
    )
    assert b.events[0].group_idx is None  # type: ignore[union-attr]
    b = decode_batch(msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [1]}]]), "sglang")
    assert isinstance(b.events[0], BlockRemoved) and b.events[0].block_hashes == [1]


# --- the events of real engines (issue 26) -----------------------------------------------------


def _request_keys(applier: EventApplier, tokens: list[int], model: str = "", salt: str = "") -> list[int]:
    """The keys ``precise-prefix-cache-producer`` computes for a request (its namespace rule)."""
    namespace = model if model in applier.loras else ""
    return applier.keyer.keys(
        tokens, namespace=namespace, extras=block_extras(len(tokens), BS, cache_salt=salt)
    )


def _held(applier: EventApplier, keys: list[int]) -> int:
    found = applier.index.match(keys, [POD])
    return found[POD].blocks if POD in found else 0


def _map(tag: str, **fields: object) -> dict[str, object]:
    return {"type": tag, **fields}


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_lora_blocks_match_the_adapter_s_requests(encoding: str) -> None:
    """vLLM >= 0.17 lists the adapter name first in every block's ``extra_keys`` (and the salt
    after it on block 0): the adapter's salted request matches both blocks, others none."""
    applier = EventApplier(KVBlockIndex(), BlockKeyer(BS))
    fields = {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": T1,
        "block_size": BS,
        "lora_id": 7,
        "medium": "GPU",
        "lora_name": "ad",
        "extra_keys": [["ad", "s"], ["ad"]],
    }
    ev: object = _map("BlockStored", **fields) if encoding == "map" else ["BlockStored", *fields.values()]
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [ev]])))
    assert _held(applier, _request_keys(applier, T1, "ad", "s")) == 2
    assert _held(applier, _request_keys(applier, T1, "ad")) == 0  # unsalted
    assert _held(applier, _request_keys(applier, T1)) == 0  # the base model
    child = ["BlockStored", [3], 2, T2, BS, 7, "GPU", "ad", [["ad"]]]
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [child]])))
    assert _held(applier, _request_keys(applier, T1 + T2, "ad", "s")) == 3


def test_a_group_whose_kind_was_never_announced_is_full_attention() -> None:
    """vLLM 0.20 and 0.21 send ``group_idx`` without ``kv_cache_spec_kind``."""
    applier = EventApplier(KVBlockIndex(), BlockKeyer(BS))
    store = ["BlockStored", [1, 2], None, T1, BS, None, "GPU", None, None, 0]
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [store]])))
    assert _held(applier, _request_keys(applier, T1)) == 2
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [["BlockRemoved", [2], "GPU", 0]]])))
    assert _held(applier, _request_keys(applier, T1)) == 1
    # an endpoint that announces kinds: a group never announced is not taken for full attention
    applier.apply("default/e1", decode_batch(msgspec.msgpack.encode([0.0, [[*store, "full_attention"]]])))
    other = ["BlockStored", [5], None, T2, BS, None, "GPU", None, None, 1]
    applier.apply("default/e1", decode_batch(msgspec.msgpack.encode([0.0, [other]])))
    assert "default/e1" not in applier.index.match(_request_keys(applier, T2), ["default/e1"])


SGLANG_0_5_23 = {
    "block_hashes": [-5, 6],
    "parent_block_hash": None,
    "token_ids": T1,
    "block_size": BS,
    "lora_id": None,
    "medium": "GPU",
    "cache_salt": "tenant",
    "session_id": "s1",
}


def test_engine_type_sglang_reads_sglang_0_5_23_maps() -> None:
    payload = msgspec.msgpack.encode([0.0, [_map("BlockStored", **SGLANG_0_5_23, lora_name="ad")], 2])
    b = decode_batch(payload, "sglang")
    [s] = b.events
    assert isinstance(s, BlockStored) and b.data_parallel_rank == 2
    assert (s.block_hashes, s.cache_salt, s.lora_name, s.medium) == (
        [(1 << 64) - 5, 6],
        "tenant",
        "ad",
        "GPU",
    )


def test_session_id_of_a_store_is_decoded_from_maps_and_sglang_metadata() -> None:
    sglang_map = _map("BlockStored", **SGLANG_0_5_23)
    vllm_map = _map("BlockStored", **SGLANG_0_5_23 | {"cache_salt": None, "session_id": "chat-9"})
    sglang_array = ["BlockStored", [1], None, T1[:BS], BS, None, "GPU", {"session_id": "s2"}]
    bare = ["BlockStored", [1], None, T1[:BS], BS, None, "GPU", None, [None], 0, "full_attention"]
    events = decode_batch(
        msgspec.msgpack.encode([0.0, [sglang_map, vllm_map, sglang_array, bare], None])
    ).events
    assert [e.session_id for e in events if isinstance(e, BlockStored)] == ["s1", "chat-9", "s2", None]
    with pytest.raises(DecodeError, match="session_id"):
        decode_batch(
            msgspec.msgpack.encode([0.0, [_map("BlockStored", **SGLANG_0_5_23 | {"session_id": 5})]])
        )


@pytest.mark.parametrize("layout", ["map-0.5.23", "array-0.5.19"])
def test_sglang_cache_salt_keeps_tenants_apart(layout: str) -> None:
    applier = EventApplier(KVBlockIndex(), BlockKeyer(BS))
    if layout.startswith("map"):
        ev: object = _map("BlockStored", **SGLANG_0_5_23)
        child: object = _map(
            "BlockStored", **SGLANG_0_5_23 | {"block_hashes": [7], "parent_block_hash": 6, "token_ids": T2}
        )
    else:  # BlockStoredWithMetadata: the salt in a metadata map after medium
        ev = ["BlockStored", [-5, 6], None, T1, BS, None, "GPU", {"cache_salt": "tenant"}]
        child = ["BlockStored", [7], 6, T2, BS, None, "GPU", {"cache_salt": "tenant"}]
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [ev, child], None]), "sglang"))
    assert _held(applier, _request_keys(applier, T1 + T2, salt="tenant")) == 3
    assert _held(applier, _request_keys(applier, T1 + T2)) == 0
    assert _held(applier, _request_keys(applier, T1 + T2, salt="other")) == 0


def test_a_re_announced_block_is_dropped_by_its_one_removal() -> None:
    """``kv_cache_report_mode: "full"`` (vLLM 0.34) stores reused blocks again; vLLM evicts once."""
    applier = EventApplier(KVBlockIndex(), BlockKeyer(BS))
    again = ["BlockStored", [1, 2], None, T1, BS, None, "GPU", None, [None, None], 0, "full_attention"]
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [again, again]])))
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [["BlockRemoved", [1], "GPU", 0]]])))
    assert _held(applier, _request_keys(applier, T1)) == 0


# --- ingestion over ZMQ ------------------------------------------------------------------------


class Rig:
    def __init__(self, *, replay: bool = False, central: str = "", port: int = 0) -> None:
        self.keyer = BlockKeyer(BS)
        self.index = KVBlockIndex()
        self.applier = EventApplier(self.index, self.keyer)
        self.port = port or free_port()
        self.replay_port = free_port() if replay else 0
        # the ingester adds the rank to both ports; rank 0 here
        self.ing = KVEventsIngester(
            self.applier, socket_port=self.port, replay_port=self.replay_port, central_endpoint=central
        )
        self.ing.start()

    def keys(self, tokens: list[int], parent: int | None = None) -> list[int]:
        return self.keyer.keys(tokens, parent=parent)

    def holds(self, pod: str, tokens: list[int]) -> int:
        m_ = self.index.match(self.keys(tokens), [pod])
        return m_[pod].blocks if pod in m_ else 0


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.ing.stop()


@pytest.fixture
def replay_rig() -> Iterator[Rig]:
    r = Rig(replay=True)
    yield r
    r.ing.stop()


POD = "default/e0"


def _target(rank: int = 0) -> Target:
    return Target(POD, "127.0.0.1", 8000, "e0", "pod0", rank)


def test_events_are_indexed_and_subscription_follows_the_endpoint(rig: Rig) -> None:
    pub = Publisher(rig.port)
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        pub.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2, what="blocks indexed")
        pub.send(batch([stored([103], T2, parent=102)]))
        wait(lambda: rig.holds(POD, T1 + T2) == 3, what="child block via parent")
        pub.send(batch([removed([102])]))
        wait(lambda: rig.holds(POD, T1 + T2) == 1, what="removal")
        rig.ing.remove_endpoint(POD)
        wait(lambda: POD not in rig.ing.streams and len(rig.index) == 0, what="unsubscribed and cleared")
    finally:
        pub.close()


def test_data_parallel_rank_offsets_the_port() -> None:
    rank1 = free_port()
    rig = Rig(port=rank1 - 1)
    pub = Publisher(rank1)
    try:
        rig.ing.add_endpoint(_target(rank=1))
        pub.wait_subscribed()
        assert rig.ing.streams[POD].endpoint.endswith(f":{rig.port + 1}")
        pub.send(batch([stored([101], T2)]))
        wait(lambda: rig.holds(POD, T2) == 1)
    finally:
        pub.close()
        rig.ing.stop()


def test_restart_clears_the_endpoint(rig: Rig) -> None:
    pub = Publisher(rig.port)
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        for _ in range(3):
            pub.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.ing.streams[POD].seq.last == 2)
        pub.send(batch([stored([201], T2)]), seq=0)  # a new engine: numbering starts again
        wait(lambda: rig.holds(POD, T2) == 1)
        assert rig.holds(POD, T1) == 0
    finally:
        pub.close()


def test_gap_without_replay_clears_the_endpoint_and_goes_on(rig: Rig) -> None:
    pub = Publisher(rig.port)
    errors = m.ZMQ_ERRORS.labels(POD, "gap")
    before = errors.value
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        pub.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2)
        pub.send(batch([removed([102])]), publish=False)  # lost on the way
        pub.send(batch([stored([201], T2)]))
        wait(lambda: rig.holds(POD, T2) == 1)
        assert rig.holds(POD, T1) == 0  # stale: cleared
        assert errors.value == before + 1
    finally:
        pub.close()


def test_gap_is_replayed(replay_rig: Rig) -> None:
    rig = replay_rig
    pub = Publisher(rig.port, replay_port=rig.replay_port)
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        wait(lambda: pub.replay_requests == [0], what="proactive replay")
        wait(lambda: rig.ing.streams[POD].seq.replay is None)
        pub.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2)
        pub.send(batch([stored([103], T2, parent=102)]), publish=False)  # lost live, kept in the buffer
        pub.send(batch([stored([301], [7, 7, 7, 7])]))
        wait(lambda: rig.holds(POD, [7, 7, 7, 7]) == 1)
        assert pub.replay_requests == [0, 1]
        assert rig.holds(POD, T1 + T2) == 3  # the replayed batch
        assert rig.ing.streams[POD].seq.last == 2
    finally:
        pub.close()


def test_restart_with_replay_rebuilds_from_zero(replay_rig: Rig) -> None:
    rig = replay_rig
    pub = Publisher(rig.port, replay_port=rig.replay_port)
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        wait(lambda: pub.replay_requests == [0] and rig.ing.streams[POD].seq.replay is None)
        pub.send(batch([stored([101], T2)]))
        pub.send(batch([stored([102], [5, 5, 5, 5])]))
        wait(lambda: rig.ing.streams[POD].seq.last == 1)
        pub.buffer.clear()  # the engine restarts: an empty buffer, numbering from 0
        pub.send(batch([stored([201], [6, 6, 6, 6])]), seq=0, publish=False)
        pub.send(batch([stored([202], T1[:4])]), seq=1, publish=False)
        pub.send(batch([stored([203], [8, 8, 8, 8])]), seq=0)  # replaced 0 in the buffer below
        pub.buffer = pub.buffer[:2]
        wait(lambda: pub.replay_requests == [0, 0], what="replay from 0 after the restart")
        wait(lambda: rig.holds(POD, [6, 6, 6, 6]) == 1 and rig.holds(POD, T1[:4]) == 1)
        assert rig.holds(POD, T2) == 0
    finally:
        pub.close()


def test_failed_replay_clears_the_endpoint(replay_rig: Rig) -> None:
    rig = replay_rig
    pub = Publisher(rig.port)  # no ROUTER: every replay times out
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        wait(lambda: rig.ing.streams[POD].seq.replay is None, timeout=20, what="proactive replay gives up")
        pub.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2)
        pub.send(batch([removed([101])]), publish=False)
        pub.send(batch([stored([201], T2)]))  # gap: replay is in its cool-down: cleared, live
        wait(lambda: rig.holds(POD, T2) == 1)
        assert rig.holds(POD, T1) == 0
    finally:
        pub.close()


def test_malformed_message_clears_the_endpoint_and_ingestion_goes_on(rig: Rig) -> None:
    pub = Publisher(rig.port)
    errors = m.ZMQ_ERRORS.labels(POD, "decode")
    before = errors.value
    frame_errors = m.ZMQ_ERRORS.labels(POD, "frame")
    frames_before = frame_errors.value
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        pub.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2)
        pub.send(b"\x93garbage")
        pub.raw([b"kv@pod@m", b"short"])  # a bad frame too
        pub.send(batch([stored([201], T2)]))
        wait(lambda: rig.holds(POD, T2) == 1)
        assert rig.holds(POD, T1) == 0
        assert errors.value == before + 1
        assert frame_errors.value == frames_before + 1  # one malformed message, counted once
        assert rig.ing.running
    finally:
        pub.close()


def test_unreachable_socket_is_retried_and_counted(rig: Rig) -> None:
    retries = m.RECONNECTIONS.labels(POD)
    rig.ing.add_endpoint(_target())
    wait(lambda: retries.value >= 1, what="a counted reconnection attempt")
    assert rig.ing.running
    pub = Publisher(rig.port)  # the engine comes up later
    try:
        pub.wait_subscribed(timeout=15)
        pub.send(batch([stored([101], T2)]))
        wait(lambda: rig.holds(POD, T2) == 1)
    finally:
        pub.close()


def test_central_socket_names_the_endpoint_by_topic() -> None:
    port = free_port()
    rig = Rig(central=f"tcp://127.0.0.1:{port}")
    try:
        rig.ing.add_endpoint(Target("default/a", "10.0.0.1", 8000, "a", "pod-a"), subscribe=False)
        rig.ing.add_endpoint(Target("default/b", "10.0.0.2", 8000, "b", "pod-b"), subscribe=False)
        pub_a = Publisher(0, topic="kv@10.0.0.1:8000@m", connect=f"tcp://127.0.0.1:{port}")
        pub_b = Publisher(0, topic="kv@pod-b@m", connect=f"tcp://127.0.0.1:{port}")
        try:
            pub_a.wait_subscribed()
            pub_b.wait_subscribed()
            pub_a.send(batch([stored([1], T2)]))
            pub_b.send(batch([stored([2], T1)]))
            wait(lambda: rig.holds("default/a", T2) == 1 and rig.holds("default/b", T1) == 2)
            assert rig.holds("default/b", T2) == 0
            assert not rig.ing.streams  # no per-endpoint sockets
        finally:
            pub_a.close()
            pub_b.close()
    finally:
        rig.ing.stop()


def test_stop_ends_the_thread(rig: Rig) -> None:
    rig.ing.add_endpoint(_target())
    wait(lambda: POD in rig.ing.streams)
    thread = rig.ing._thread
    rig.ing.stop()
    assert thread is not None and not thread.is_alive()
    time.sleep(0)


def test_apply_skips_unknown_parents_and_sliding_window_groups() -> None:
    index = KVBlockIndex()
    applier = EventApplier(index, BlockKeyer(BS))
    skipped = m.STORES_SKIPPED.labels("unknown", "unknown_parent")
    before = skipped.value
    applier.apply(POD, decode_batch(batch([stored([5], T2, parent=999)])))
    assert len(index) == 0 and skipped.value == before + 1
    swa = ["BlockStored", [6], None, T2, BS, None, None, None, None, 1, "sliding_window"]
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [swa]])))
    assert len(index) == 0
    full = ["BlockStored", [7], None, T2, BS, None, None, None, None, 0, "full_attention"]
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [full]])))
    assert len(index) == 1
    # a removal for the sliding-window group is skipped, for the full-attention group applied
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [["BlockRemoved", [7], None, 1]]])))
    assert len(index) == 1
    applier.apply(POD, decode_batch(msgspec.msgpack.encode([0.0, [["BlockRemoved", [7], None, 0]]])))
    assert len(index) == 0


def test_cleared_event_empties_the_endpoint_and_bad_token_ids_raise() -> None:
    index = KVBlockIndex()
    applier = EventApplier(index, BlockKeyer(BS))
    applier.apply(POD, decode_batch(batch([stored([1], T2)])))
    applier.apply(POD, decode_batch(batch([["AllBlocksCleared"]])))
    assert len(index) == 0
    with pytest.raises(DecodeError):
        applier.apply(
            POD, decode_batch(msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, ["a"] * 4, 4]]]))
        )


def test_ingester_can_start_again_after_a_stop(rig: Rig) -> None:
    pub = Publisher(rig.port)
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        rig.ing.stop()
        assert not rig.ing.streams
        rig.ing.start()
        pub.wait_subscribed()  # subscribed again
        pub.send(batch([stored([101], T2)]))
        wait(lambda: rig.holds(POD, T2) == 1)
    finally:
        pub.close()


def test_central_socket_bind_is_retried_when_the_address_is_taken() -> None:
    import zmq

    port = free_port()
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PULL)
    squatter.bind(f"tcp://127.0.0.1:{port}")
    rig = Rig(central=f"tcp://127.0.0.1:{port}")
    try:
        wait(lambda: rig.ing.central_error != "", what="a failed bind")
        assert rig.ing.running
        squatter.close(0)
        wait(lambda: rig.ing._central is not None, what="the bind retried")
        assert rig.ing.central_error == ""
    finally:
        rig.ing.stop()
        ctx.term()


# --- engine restarts seen as a reconnection (vLLM numbers each engine's batches from 0) ---------


def _reconnected(rig: Rig, old: Publisher, **kw: object) -> Publisher:
    """``old`` goes away (its socket closes, as a killed engine's does); another publisher binds the
    same ports; returns it once the ingester is subscribed again."""
    old.close()
    wait(lambda: not rig.ing.streams[POD].connected, what="disconnection seen")
    new = Publisher(rig.port, **kw)  # type: ignore[arg-type]
    new.wait_subscribed()
    return new


def test_restart_whose_first_batch_repeats_the_last_sequence_number(rig: Rig) -> None:
    old = Publisher(rig.port)
    new: Publisher | None = None
    try:
        rig.ing.add_endpoint(_target())
        old.wait_subscribed()
        old.send(batch([stored([101, 102], T1)]))  # seq 0: the old engine's only batch
        wait(lambda: rig.holds(POD, T1) == 2)
        new = _reconnected(rig, old)
        # without a replay socket nothing tells whether it is the same engine: its blocks go at once
        wait(lambda: rig.holds(POD, T1) == 0, what="the old engine's blocks cleared on reconnection")
        new.send(batch([stored([201], T2)]))  # seq 0 again: the new engine's first batch, no duplicate
        wait(lambda: rig.holds(POD, T2) == 1, what="the new engine's first batch kept")
    finally:
        (new or old).close()


def test_reconnection_compares_the_replayed_last_batch(replay_rig: Rig) -> None:
    rig = replay_rig
    old = Publisher(rig.port, replay_port=rig.replay_port)
    new: Publisher | None = None
    try:
        rig.ing.add_endpoint(_target())
        old.wait_subscribed()
        wait(lambda: old.replay_requests == [0] and rig.ing.streams[POD].seq.replay is None)
        old.send(batch([stored([101, 102], T1)]))
        old.send(batch([stored([103], T2, parent=102)]))
        wait(lambda: rig.holds(POD, T1 + T2) == 3)
        # the same engine behind a new connection: its buffer answers the last batch unchanged
        buffer = list(old.buffer)
        new = _reconnected(rig, old, replay_port=rig.replay_port)
        new.buffer, new.seq = buffer, len(buffer)
        wait(lambda: new.replay_requests == [1], what="the last batch asked again")
        wait(lambda: rig.ing.streams[POD].seq.replay is None)
        assert rig.holds(POD, T1 + T2) == 3
        new.send(batch([stored([301], [7, 7, 7, 7])]))
        wait(lambda: rig.holds(POD, [7, 7, 7, 7]) == 1)
        assert rig.holds(POD, T1 + T2) == 3
        # a restarted engine: an empty buffer; its old blocks go before it publishes anything
        old, new = new, None
        new = _reconnected(rig, old, replay_port=rig.replay_port)
        wait(lambda: new.replay_requests == [2, 0], what="the last batch asked, then a replay from 0")
        wait(lambda: rig.holds(POD, T1) == 0 and rig.holds(POD, [7, 7, 7, 7]) == 0, what="cleared")
        new.send(batch([stored([401], [6, 6, 6, 6])]))  # seq 0
        wait(lambda: rig.holds(POD, [6, 6, 6, 6]) == 1, what="the new engine's first batch kept")
    finally:
        (new or old).close()


def test_entries_untrusted_from_a_disconnection_until_the_restart_check(
    replay_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the stream is away, and until the replayed last batch shows the same engine, the
    endpoint's entries are not to be matched (``trusted`` False); they hold again once checked."""
    monkeypatch.setattr(service, "REPLAY_IDLE_TIMEOUT", 30.0)  # the answer waits for the gate
    rig = replay_rig
    gate = threading.Event()
    old = Publisher(rig.port, replay_port=rig.replay_port)
    new: Publisher | None = None
    try:
        rig.ing.add_endpoint(_target())
        old.wait_subscribed()
        wait(lambda: old.replay_requests == [0] and rig.ing.streams[POD].seq.replay is None)
        old.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2)
        assert rig.ing.trusted(POD)
        buffer = list(old.buffer)
        old.close()
        wait(lambda: not rig.ing.streams[POD].connected, what="disconnection seen")
        assert not rig.ing.trusted(POD)  # the engine may come back another
        new = Publisher(rig.port, replay_port=rig.replay_port, replay_gate=gate)
        new.buffer, new.seq = buffer, len(buffer)
        new.wait_subscribed()
        wait(lambda: new.replay_requests == [0], what="the last batch asked again")
        assert not rig.ing.trusted(POD)  # asked, not answered yet
        assert rig.holds(POD, T1) == 2
        gate.set()
        wait(lambda: rig.ing.trusted(POD), what="the same engine recognised")
        assert rig.holds(POD, T1) == 2
    finally:
        (new or old).close()


def test_an_endpoint_found_down_is_untrusted_until_checked(rig: Rig) -> None:
    pub = Publisher(rig.port)
    try:
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        pub.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2)
        rig.ing.endpoint_down(POD, True)
        wait(lambda: not rig.ing.trusted(POD), what="down seen")
        rig.ing.endpoint_down(POD, False)
        # no replay socket: nothing tells whether it restarted, so its entries go and trust returns
        wait(lambda: rig.ing.trusted(POD), what="checked on return")
        assert rig.holds(POD, T1) == 0
    finally:
        pub.close()


# --- replay answers that lose messages (vLLM's ROUTER drops beyond its send high-water mark) ----


def _history(pub: Publisher, n: int) -> None:
    """``n`` batches the engine published before the EPP subscribed (only in its replay buffer)."""
    for i in range(n):
        pub.send(batch([stored([1000 + i], [i + 1] * BS)]), publish=False)


def _holds_history(rig: Rig, n: int) -> int:
    return sum(rig.holds(POD, [i + 1] * BS) for i in range(n))


def test_a_replay_gap_asks_again_from_the_missing_batch(replay_rig: Rig) -> None:
    rig = replay_rig
    pub = Publisher(rig.port, replay_port=rig.replay_port, replay_drops=[(10, 15)])
    clears = m.ENDPOINT_CLEARS.labels(POD, "replay-incomplete")
    before = clears.value
    try:
        _history(pub, 30)
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        wait(lambda: _holds_history(rig, 30) == 30, what="the whole buffer indexed")
        assert pub.replay_requests == [0, 10]
        assert rig.ing.streams[POD].seq.last == 29
        assert clears.value == before
    finally:
        pub.close()


def test_a_replay_cut_short_is_asked_again_until_complete(
    replay_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "REPLAY_IDLE_TIMEOUT", 0.3)
    rig = replay_rig
    # the first two answers stop (end marker lost too) after 10 and 5 batches
    pub = Publisher(rig.port, replay_port=rig.replay_port, replay_drops=[(10, None), (5, None)])
    try:
        _history(pub, 30)
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        wait(lambda: _holds_history(rig, 30) == 30, what="the whole buffer indexed")
        assert pub.replay_requests == [0, 10, 15]
        pub.send(batch([stored([2000], T2)]))  # live traffic goes on in order
        wait(lambda: rig.holds(POD, T2) == 1)
        assert _holds_history(rig, 30) == 30
    finally:
        pub.close()


def test_replay_retries_without_progress_are_bounded(
    replay_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "REPLAY_IDLE_TIMEOUT", 0.3)
    rig = replay_rig
    drops: list[tuple[int, int | None]] = [(10, None)] + [(0, None)] * 20  # never any further
    pub = Publisher(rig.port, replay_port=rig.replay_port, replay_drops=drops)
    failed = m.REPLAYS.labels(POD, "failed")
    before = failed.value
    try:
        _history(pub, 30)
        rig.ing.add_endpoint(_target())
        pub.wait_subscribed()
        wait(lambda: failed.value == before + 1, what="the replay given up")
        assert pub.replay_requests == [0] + [10] * (service.REPLAY_RETRIES + 1)
        assert _holds_history(rig, 30) == 0  # what was replayed can no longer be trusted alone
    finally:
        pub.close()


# --- topics: vLLM publishes with topic "" unless told otherwise -------------------------------


def test_events_without_a_topic_are_taken_and_foreign_topics_dropped(rig: Rig) -> None:
    bare = Publisher(rig.port, topic="")  # vLLM's default topic
    errors = m.ZMQ_ERRORS.labels(POD, "topic")
    before = errors.value
    try:
        rig.ing.add_endpoint(_target())
        bare.wait_subscribed()
        bare.send(batch([stored([101, 102], T1)]))
        wait(lambda: rig.holds(POD, T1) == 2, what="events without a topic indexed")
        bare.topic = b"other@pod@m"  # a topic that does not start with topicFilter
        bare.send(batch([stored([201], T2)]))
        wait(lambda: errors.value == before + 1, what="the foreign topic counted")
        bare.topic = b"kv@pod@m"
        bare.send(batch([stored([301], [7, 7, 7, 7])]), seq=1)
        wait(lambda: rig.holds(POD, [7, 7, 7, 7]) == 1)
        assert rig.holds(POD, T2) == 0
    finally:
        bare.close()
