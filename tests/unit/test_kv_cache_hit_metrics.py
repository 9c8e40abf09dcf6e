"""The precise prefix cache's hit counters (``llm_d_epp_kv_cache_index_lookup_hits_total`` and
``..._max_pod_hit_count_total``) count only the contiguous prefix chain an endpoint holds: a block held
after a missing one is no hit. Read from the scrape page, as Prometheus reads them."""

from __future__ import annotations

import gc

from prometheus_client.parser import text_string_to_metric_families

from epp import promlite
from epp.kvcache import KVBlockIndex
from epp.kvevents import metrics as kvm

HITS = "llm_d_epp_kv_cache_index_lookup_hits_total"
MAX_POD = "llm_d_epp_kv_cache_index_max_pod_hit_count_total"


def _scrape() -> dict[str, float]:
    page = promlite.exposition().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name in (HITS, MAX_POD, "kvcache_index_lookup_hits_total")
    }


def test_hits_count_only_the_contiguous_prefix_chain() -> None:
    gc.collect()  # indexes of earlier tests leave the sums now, not between the two scrapes
    before = _scrape()
    index = KVBlockIndex(size=100, pod_cache_size=4)
    kvm.track_index(index)
    index.store("ns/a", [11, 12, 14, 15], [1, 2, 4, 5])  # holds blocks 1, 2, then 4, 5 after a gap
    index.store("ns/b", [21], [1])
    match = index.match([1, 2, 3, 4, 5], ["ns/a", "ns/b"])
    assert {k: m.blocks for k, m in match.items()} == {"ns/a": 2, "ns/b": 1}
    after = _scrape()
    assert after[HITS] - before.get(HITS, 0.0) == 2  # not 4: blocks 4 and 5 follow a miss
    assert after[MAX_POD] - before.get(MAX_POD, 0.0) == 2
    assert after["kvcache_index_lookup_hits_total"] == after[HITS]  # the deprecated name, same series
    index.match([9, 1, 2], ["ns/a", "ns/b"])  # the first block missing: no hit at all
    assert _scrape()[HITS] == after[HITS]
