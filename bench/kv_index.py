"""KV-event ingestion cost and KV-block index memory (``make bench-kv-index``).

Builds vLLM-format payloads (msgpack ``EventBatch`` of chained ``BlockStored`` events) for
``--pods`` endpoints x ``--blocks`` blocks each (the first ``--shared`` fraction of every pod's
blocks is a prefix all pods share), then reports:

* CPU per 1,000 block events, decode + index update (``time.process_time``), for stores and removes;
* bytes per block entry (endpoint x block) the index holds, by ``tracemalloc``, and the index's own
  estimate;
* the request side: block keys for a ``--prompt-tokens`` prompt (and for its next turn, reusing
  the previous turn's keys) and one match over all pods.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epp.kvcache import BlockKeyer, KVBlockIndex, PrefixKeyCache
from epp.kvevents import EventApplier, decode_batch

BLOCK = 16


def _payloads(pods: int, blocks: int, shared: float, per_event: int, seed: int) -> list[list[bytes]]:
    rng = random.Random(seed)
    n_shared = int(blocks * shared)
    shared_tokens = [rng.randrange(150_000) for _ in range(n_shared * BLOCK)]
    out: list[list[bytes]] = []
    for p in range(pods):
        tokens = shared_tokens + [rng.randrange(150_000) for _ in range((blocks - n_shared) * BLOCK)]
        payloads: list[bytes] = []
        parent: int | None = None
        for start in range(0, blocks, per_event):
            n = min(per_event, blocks - start)
            hashes = [rng.getrandbits(64) for _ in range(n)]
            ev = ["BlockStored", hashes, parent, tokens[start * BLOCK : (start + n) * BLOCK], BLOCK]
            payloads.append(msgspec.msgpack.encode([time.time(), [ev]]))
            parent = hashes[-1]
        out.append(payloads)
        del p
    return out


def _removes(payloads: list[list[bytes]], fraction: float) -> list[list[bytes]]:
    out = []
    for pod_payloads in payloads:
        batch = []
        for raw in pod_payloads[: max(1, int(len(pod_payloads) * fraction))]:
            hashes = msgspec.msgpack.decode(raw)[1][0][1]
            batch.append(msgspec.msgpack.encode([time.time(), [["BlockRemoved", hashes]]]))
        out.append(batch)
    return out


def _ingest(applier: EventApplier, payloads: list[list[bytes]]) -> int:
    blocks = 0
    for p, pod_payloads in enumerate(payloads):
        pod = f"default/pod-{p}"
        for raw in pod_payloads:
            blocks += applier.apply(pod, decode_batch(raw))
    return blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=50_000, help="blocks per pod")
    ap.add_argument("--shared", type=float, default=0.2, help="fraction of blocks every pod shares")
    ap.add_argument("--per-event", type=int, default=16, help="blocks per BlockStored event")
    ap.add_argument("--prompt-tokens", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    payloads = _payloads(args.pods, args.blocks, args.shared, args.per_event, args.seed)
    removes = _removes(payloads, 0.1)
    entries = args.pods * args.blocks

    # CPU (no tracing)
    index = KVBlockIndex()
    applier = EventApplier(index, BlockKeyer(BLOCK))
    gc.collect()
    t0 = time.process_time()
    stored = _ingest(applier, payloads)
    t_store = time.process_time() - t0
    t0 = time.process_time()
    removed = _ingest(applier, removes)
    t_remove = time.process_time() - t0

    # request side on the full index
    index2 = KVBlockIndex()
    applier2 = EventApplier(index2, BlockKeyer(BLOCK))
    _ingest(applier2, payloads)
    rng = random.Random(args.seed + 1)
    prompt = [rng.randrange(150_000) for _ in range(args.prompt_tokens)]
    keyer = BlockKeyer(BLOCK)
    t0 = time.perf_counter()
    keys = keyer.keys(prompt)
    t_keys = time.perf_counter() - t0
    recent = PrefixKeyCache(keyer)
    recent.keys(prompt)
    next_turn = prompt[:-10] + [rng.randrange(150_000) for _ in range(500)]
    t0 = time.perf_counter()
    recent.keys(next_turn)
    t_next = time.perf_counter() - t0
    pods = [f"default/pod-{p}" for p in range(args.pods)]
    # a prompt the pods hold: pod 0's whole chain
    held = [k for k in index2._young] + [k for k in index2._old]
    sample = held[: len(keys)]
    t0 = time.perf_counter()
    index2.match(keys, pods)
    t_miss = time.perf_counter() - t0
    t0 = time.perf_counter()
    index2.match(sample, pods)
    t_hit = time.perf_counter() - t0
    del index2, applier2, held, sample

    # memory (tracemalloc over a fresh ingestion)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index3 = KVBlockIndex()
    applier3 = EventApplier(index3, BlockKeyer(BLOCK))
    _ingest(applier3, payloads)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    st = index3.stats()

    print(f"pods={args.pods} blocks/pod={args.blocks} shared={args.shared:.0%} blocks/event={args.per_event}")
    print(f"index: {st.keys} request keys, {st.engine_keys} engine keys, {entries} block entries")
    print(f"ingest stores : {t_store / stored * 1e6:8.1f} ms CPU per 1,000 block events ({stored} events)")
    print(f"ingest removes: {t_remove / removed * 1e6:8.1f} ms CPU per 1,000 block events ({removed} events)")
    print(
        f"memory        : {used / entries:8.1f} bytes per block entry (tracemalloc); "
        f"estimate {st.bytes / entries:.1f}"
    )
    print(f"request keys  : {t_keys * 1e3:8.2f} ms for {args.prompt_tokens} tokens ({len(keys)} blocks)")
    print(f"next turn     : {t_next * 1e3:8.2f} ms (the same prompt + 500 tokens, PrefixKeyCache)")
    print(
        f"match (miss)  : {t_miss * 1e6:8.1f} us; "
        f"match ({len(keys)} blocks, {args.pods} pods): {t_hit * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
