"""The event-compatibility matrix: every KV-event layout of vLLM (0.10 to 0.34) and SGLang (0.5.1
to 0.5.23), encoded as those engines encode it (``engine_layouts``), decoded and applied by epp
under either ``engineType``, with the index contents a request then finds; and ``epp sim``'s
publisher writes each layout as the engine does."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from epp.dev.sim.kv_events import LAYOUTS as SIM_LAYOUTS
from epp.dev.sim.kv_events import encode_batch
from epp.dev.sim.kvcache import AllCleared, BlocksRemoved, BlocksStored
from epp.kvcache import BlockKeyer, KVBlockIndex, block_extras
from epp.kvevents import EventApplier, decode_batch
from epp.plugins.parsers.sglanghttp import SGLangHttpParser
from tests.unit.engine_layouts import LAYOUTS, Encoder, EngineLayout

BS = 4
POD = "default/e0"
T1, T2, T3 = list(range(100, 108)), list(range(200, 204)), list(range(300, 304))
H1, H2, H3, H4 = 0x1111, 0xFFFF_0000_0000_0001, 0x3333, 0x4444  # H2 >= 2**63: SGLang sends it negative
_PREFIX = bytes(range(24))


def _digest(h: int) -> bytes:
    """A 32-byte engine digest whose low 64 bits are ``h``."""
    return _PREFIX + h.to_bytes(8, "big")


def _wire(layout: EngineLayout, h: int, as_bytes: bool) -> int | bytes:
    if layout.engine == "sglang":
        return h - (1 << 64) if h >= 1 << 63 else h
    return _digest(h) if as_bytes else h


def _events(enc: Encoder, *, tenant: bool, as_bytes: bool, cpu: bool = True) -> list[Any]:
    """A root chain of two blocks, a child block, a lower-tier block, the child's removal."""
    lay = enc.layout
    h = {k: _wire(lay, v, as_bytes) for k, v in {"1": H1, "2": H2, "3": H3, "4": H4}.items()}
    vllm = lay.engine == "vllm"
    who: dict[str, Any] = {"lora_id": 3 if vllm else None, "lora_name": "ad"} if tenant else {}
    if tenant:
        who["cache_salt"] = "s"  # read only by SGLang's layouts
    common = {"block_size": BS, "medium": "GPU", "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    root_keys = [["ad", "s"], ["ad"]] if tenant else [None, None]
    events = [
        enc.stored(
            block_hashes=[h["1"], h["2"]], parent_block_hash=None, token_ids=T1, extra_keys=root_keys,
            **common, **who,
        ),
        enc.stored(
            block_hashes=[h["3"]], parent_block_hash=h["2"], token_ids=T2,
            extra_keys=[["ad"]] if tenant else [None], **common, **who,
        ),
    ]  # fmt: skip
    if cpu:
        lower = "CPU" if vllm else "CPU_PINNED"
        events.append(
            enc.stored(
                block_hashes=[h["4"]], parent_block_hash=None, token_ids=T3, extra_keys=[None],
                **(common | {"medium": lower}),
            )
        )  # fmt: skip
    events.append(enc.removed(block_hashes=[h["3"]], medium="GPU", group_idx=0))
    return events


def _keys(applier: EventApplier, tokens: list[int], model: str, salt: str) -> list[int]:
    """The request keys ``precise-prefix-cache-producer`` computes (its namespace rule)."""
    namespace = model if model in applier.loras else ""
    return applier.keyer.keys(
        tokens, namespace=namespace, extras=block_extras(len(tokens), BS, cache_salt=salt)
    )


def _match(
    applier: EventApplier, tokens: list[int], model: str = "", salt: str = ""
) -> tuple[int, dict[str, int]]:
    found = applier.index.match(_keys(applier, tokens, model, salt), [POD])
    return (found[POD].blocks, found[POD].tiers) if POD in found else (0, {})


# int hashes everywhere; bytes too where vLLM can send them (0.11+, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
_BYTES = [
    (lay, b)
    for lay in LAYOUTS
    for b in (False, True)
    if not b or lay.engine == lay.name[:4] != "vllm-0.10"[:0]
]
_BYTES = [(lay, b) for lay, b in _BYTES if not b or (lay.engine == "vllm" and lay.name != "vllm-0.10")]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(
    ("layout", "as_bytes"), _BYTES, ids=[f"{lay.name}-{'bytes' if b else 'int'}" for lay, b in _BYTES]
)
def test_every_layout_is_indexed_as_the_engine_holds_it(
    layout: EngineLayout, as_bytes: bool, engine: str
) -> None:
    enc = Encoder(layout)
    applier = EventApplier(KVBlockIndex(), BlockKeyer(BS))
    batch = decode_batch(enc.batch(_events(enc, tenant=False, as_bytes=as_bytes), rank=2), engine)
    assert batch.data_parallel_rank == 2 and batch.unknown == 0
    applier.apply(POD, batch)
    assert _match(applier, T1 + T2) == (2, {"gpu": 2})  # the child block was removed
    assert _match(applier, T3) == (1, {"cpu" if layout.has_medium else "gpu": 1})
    applier.apply(POD, decode_batch(enc.batch([enc.cleared()]), engine))
    assert _match(applier, T1) == (0, {}) and _match(applier, T3) == (0, {})


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
def test_adapter_and_salted_blocks_match_only_what_the_layout_lets_a_request_name(
    layout: EngineLayout,
) -> None:
    """A LoRA adapter's salted request's blocks: found by that adapter's salted request where the
    layout names the adapter (``lora_name``) and carries the salt; a layout without one is matched
    without it (vLLM 0.14-0.16 lose the salt; SGLang before 0.5.22 the adapter, before 0.5.18 both);
    vLLM before 0.14 gives only ``lora_id``, which no request names: nothing matches."""
    enc = Encoder(layout)
    applier = EventApplier(KVBlockIndex(), BlockKeyer(BS))
    applier.apply(
        POD, decode_batch(enc.batch(_events(enc, tenant=True, as_bytes=False, cpu=False)), layout.engine)
    )
    tries = [(m, s) for m in ("ad", "") for s in ("s", "")]
    expected = {t: 0 for t in tries}
    salt = "s" if layout.carries_salt else ""
    if layout.names_adapter:
        expected[("ad", salt)] = 2
    elif layout.engine == "sglang":  # no adapter named: keyed as the base model, which "ad" then is
        expected[("ad", salt)] = expected[("", salt)] = 2
    assert {t: _match(applier, T1 + T2, *t)[0] for t in tries} == expected


_SALTED_SGLANG = [lay for lay in LAYOUTS if lay.engine == "sglang" and lay.carries_salt]
_SGLANG_PARSER = SGLangHttpParser("sglanghttp-parser", None)


@pytest.mark.parametrize("layout", _SALTED_SGLANG, ids=[lay.name for lay in _SALTED_SGLANG])
def test_a_sglang_generate_request_is_salted_as_its_engine_reports_its_blocks(layout: EngineLayout) -> None:
    """SGLang salts a ``/generate`` request's blocks, and their BlockStored events, with its
    ``cache_salt``; its ``extra_key`` is not in the events: a request that names only that one is
    found among the unsalted blocks its engine reports."""
    enc = Encoder(layout)
    applier = EventApplier(KVBlockIndex(), BlockKeyer(BS))
    common = {"parent_block_hash": None, "block_size": BS, "medium": "GPU"}
    events = [  # what the engine publishes for {cache_salt: "s", ...} on T1, then an unsalted T3
        enc.stored(block_hashes=[H1, H3], token_ids=T1, cache_salt="s", **common),
        enc.stored(block_hashes=[H4], token_ids=T3, **common),
    ]
    applier.apply(POD, decode_batch(enc.batch(events), "sglang"))

    def found(tokens: list[int], **fields: str) -> int:
        raw = json.dumps({"input_ids": tokens, **fields}).encode()
        body = _SGLANG_PARSER.parse_request(raw, {":path": "/generate"})
        assert body.token_ids == tokens
        return _match(applier, tokens, salt=body.cache_salt)[0]

    assert found(T1, cache_salt="s") == 2
    assert found(T1, cache_salt="s", extra_key="k") == 2
    assert found(T1, extra_key="s") == 0
    assert found(T1) == 0
    assert found(T3, extra_key="k") == 1
    assert found(T3, cache_salt="s") == 0


def _sim_events(tenant: bool) -> list[Any]:
    who: dict[str, Any] = {"lora_name": "ad", "lora_id": 3, "cache_salt": "s"} if tenant else {
        "lora_name": None, "lora_id": None}  # fmt: skip
    return [
        BlocksStored(
            [_digest(H1), _digest(H2)], None, T1, [("ad", "s"), ("ad",)] if tenant else [None, None], **who
        ),
        BlocksStored([_digest(H3)], _digest(H2), T2, [("ad",)] if tenant else [None], **who),
        BlocksRemoved([_digest(H3)]),
        AllCleared(),
    ]


@pytest.mark.parametrize("tenant", [False, True])
@pytest.mark.parametrize(
    ("layout", "as_bytes"), _BYTES, ids=[f"{lay.name}-{'bytes' if b else 'int'}" for lay, b in _BYTES]
)
def test_the_sim_publishes_each_layout_as_the_engine_encodes_it(
    layout: EngineLayout, as_bytes: bool, tenant: bool
) -> None:
    enc = Encoder(layout)
    expected = _events(enc, tenant=tenant, as_bytes=as_bytes, cpu=False)
    want = msgspec.msgpack.decode(enc.batch([*expected, enc.cleared()], ts=1.0, rank=0))
    got = encode_batch(
        _sim_events(tenant),
        block_size=BS,
        layout=layout.name,
        int_hashes=not as_bytes,
        ts=1.0,
        data_parallel_rank=0,
    )
    assert msgspec.msgpack.decode(got) == want  # the same values (msgspec may size a header wider)
    assert layout.name in SIM_LAYOUTS
