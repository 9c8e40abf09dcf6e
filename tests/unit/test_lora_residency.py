"""LoRA at scale: ``lora-load-state-scorer``, ``lora-residency-filter``, the residency metrics the
core extractor reads, and the simulator's adapter slots over a host cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from epp.config.loader import load_config_file
from epp.dev.sim.engine import Engine, RequestSpec, SimConfig
from epp.dev.sim.lora import FROM_DISK, FROM_HOST, RESIDENT, LoraSlots
from epp.framework import ConfigError, CycleState, Endpoint, Plugin
from epp.framework.params import decode_params
from epp.framework.registry import lookup
from epp.plugins.filters.lora_residency_filter import DECISIONS, LoraResidencyFilter
from epp.plugins.scorers._adapter_heat import AdapterHeat
from epp.plugins.scorers.lora_load_state import LoraLoadStateScorer
from epp.plugins.scraping.core_metrics_extractor import CoreMetricsExtractor, CoreMetricsExtractorParams
from tests.unit.factories import endpoint, known_metrics, request


def build(cls: type[Plugin], raw: dict[str, Any] | None = None) -> Any:
    return cls("p", decode_params(cls.Params, raw, "plugins[0].parameters"))


def ep(name: str, **fields: Any) -> Endpoint:
    """An endpoint with known metrics; residency is reported unless ``lora_residency=False``."""
    fields.setdefault("lora_residency", True)
    fields.setdefault("max_active_models", 2)
    loaded = fields.get("loaded_adapters", {})
    fields.setdefault("gpu_loaded_adapters", sum(1 for v in loaded.values() if v == "gpu"))
    return endpoint(name, metrics=known_metrics(**fields))


def scores(plugin: Any, model: str, eps: list[Endpoint]) -> dict[str, float]:
    got = plugin.score(CycleState(), request(model=model), eps)
    return {e.metadata.name: s for e, s in zip(eps, got, strict=True)}


# --- lora-load-state-scorer ---------------------------------------------------------------------


def test_scorer_tiers_order_gpu_cpu_free_evictable_saturated() -> None:
    eps = [
        ep("gpu", loaded_adapters={"a": "gpu", "b": "gpu"}, active_models={"b": 0}),
        ep("cpu", loaded_adapters={"a": "cpu", "b": "gpu", "c": "gpu"}, active_models={"b": 0, "c": 0}),
        ep("free", loaded_adapters={"b": "gpu"}),
        ep("evictable", loaded_adapters={"b": "gpu", "c": "gpu"}, active_models={"b": 0}),
        ep("saturated", loaded_adapters={"b": "gpu", "c": "gpu"}, active_models={"b": 0, "c": 0}),
    ]
    got = scores(build(LoraLoadStateScorer), "a", eps)
    order = ["gpu", "cpu", "free", "evictable", "saturated"]
    assert [got[n] for n in order] == sorted(got.values(), reverse=True)
    scale = 1 - 0.06
    # the bonuses never cross a tier: each score lies within its tier's band
    for name, tier in zip(order, (1.0, 0.7, 0.6, 0.3, 0.0), strict=True):
        assert tier * scale <= got[name] <= tier * scale + 0.06 + 1e-9, name
    assert lookup("lora-load-state-scorer") is LoraLoadStateScorer


def test_scorer_placement_bonus_picks_one_stable_home_for_a_new_adapter() -> None:
    eps = [ep(f"e{i}") for i in range(6)]
    scorer = build(LoraLoadStateScorer)
    homes = set()
    for adapter in ("x", "y", "z", "w"):
        got = scores(scorer, adapter, eps)
        best = max(got, key=lambda n: got[n])
        assert sorted(got.values())[-2] < got[best]  # a unique winner
        assert scores(scorer, adapter, list(reversed(eps))) == got  # independent of candidate order
        homes.add(best)
    assert len(homes) > 1  # different adapters hash to different homes


def test_scorer_headroom_breaks_ties_toward_free_slots() -> None:
    eps = [
        ep("one-free", loaded_adapters={"b": "gpu", "c": "gpu", "d": "gpu"}, max_active_models=4),
        ep("three-free", loaded_adapters={"b": "gpu"}, max_active_models=4),
    ]
    params = {"placementBonus": 0.0}
    got = scores(build(LoraLoadStateScorer, params), "a", eps)
    assert got["three-free"] > got["one-free"]


def test_scorer_evicts_where_the_idle_adapter_is_coldest() -> None:
    """A miss on full endpoints goes where the idle adapter the engine would evict is the least
    requested lately; the ranking stays inside the evictable tier."""
    eps = [
        ep("evicts-hot", loaded_adapters={"hot": "gpu", "busy": "gpu"}, active_models={"busy": 0}),
        ep("evicts-cold", loaded_adapters={"cold": "gpu", "busy": "gpu"}, active_models={"busy": 0}),
        ep("saturated", loaded_adapters={"busy": "gpu", "b2": "gpu"}, active_models={"busy": 0, "b2": 0}),
    ]
    params = {"placementBonus": 0.0}
    scorer = build(LoraLoadStateScorer, params)
    plain = build(LoraLoadStateScorer, {**params, "protectHotAdapters": False})
    for model, times in (("hot", 20), ("mid", 5), ("cold", 1)):
        for _ in range(times):
            scorer.score(CycleState(), request(model=model), eps[:1])
            plain.score(CycleState(), request(model=model), eps[:1])
    got = scores(scorer, "new", eps)
    assert got["evicts-cold"] > got["evicts-hot"] > got["saturated"] + 0.03  # tiers never cross (bonus 0.03)
    assert got["evicts-cold"] <= 0.3 * (1 - 0.03) + 0.03 + 1e-9
    flat = scores(plain, "new", eps)
    assert flat["evicts-cold"] == flat["evicts-hot"]


def test_scorer_falls_back_to_lora_requests_info() -> None:
    eps = [
        ep("running", lora_residency=False, active_models={"a": 0}),
        ep("room", lora_residency=False, active_models={"b": 0}),
        ep("full", lora_residency=False, active_models={"b": 0}, waiting_models={"c": 0}),
    ]
    got = scores(build(LoraLoadStateScorer, {"placementBonus": 0.0, "headroomBonus": 0.0}), "a", eps)
    assert got == {"running": 1.0, "room": 0.6, "full": 0.0}


def test_scorer_base_model_requests_avoid_engines_busy_with_adapters() -> None:
    eps = [
        ep("busy", served_models=("base",), loaded_adapters={"a": "gpu", "b": "gpu"}, active_models={"a": 0}),
        ep("idle", served_models=("base",), loaded_adapters={"a": "gpu", "b": "gpu"}),
    ]
    got = scores(build(LoraLoadStateScorer), "base", eps)
    assert got["idle"] > got["busy"]


def test_scorer_leaves_a_fleet_without_adapter_slots_alone() -> None:
    eps = [ep(f"e{i}", lora_residency=False, max_active_models=0) for i in range(4)]
    got = scores(build(LoraLoadStateScorer), "some-model", eps)
    assert len(set(got.values())) == 1  # no placement bonus herding base-model traffic onto one engine


@pytest.mark.parametrize(
    ("raw", "field", "reason"),
    [
        ({"gpuResidentScore": 1.5}, "gpuResidentScore", "must be in [0, 1]"),
        (
            {"cpuResidentScore": 0.5, "freeSlotScore": 0.6},
            "freeSlotScore",
            "must be at most cpuResidentScore",
        ),
        ({"cpuResidentScore": 0.62}, "cpuResidentScore", "must exceed the bonuses"),
        ({"placementBonus": 0.6, "headroomBonus": 0.5}, "placementBonus", "must be below 1"),
        ({"freeSlotScore": "high"}, "freeSlotScore", ""),
        ({"popularityHalfLifeSeconds": 0}, "popularityHalfLifeSeconds", "must be > 0"),
    ],
)
def test_scorer_bad_parameters_name_the_field(raw: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(LoraLoadStateScorer, raw)
    assert field in str(e.value) and reason in str(e.value)


# --- lora-residency-filter ----------------------------------------------------------------------


def kept(plugin: Any, model: str, eps: list[Endpoint]) -> list[str]:
    return [e.metadata.name for e in plugin.filter(CycleState(), request(model=model), eps)]


def decisions(outcome: str) -> float:
    return DECISIONS.labels("p", outcome).value


def test_filter_keeps_homes_with_room() -> None:
    eps = [
        ep("home", loaded_adapters={"a": "gpu"}, waiting_queue_size=3),
        ep("warm", loaded_adapters={"a": "cpu"}),
        ep("cold"),
    ]
    before = decisions("sticky")
    assert kept(build(LoraResidencyFilter), "a", eps) == ["home"]
    assert decisions("sticky") == before + 1


def test_filter_passes_everything_without_a_home() -> None:
    eps = [ep("warm", loaded_adapters={"a": "cpu"}), ep("cold")]
    assert kept(build(LoraResidencyFilter), "a", eps) == ["warm", "cold"]


def test_filter_spreads_a_hot_adapter_when_its_home_saturates_warm_first() -> None:
    eps = [
        ep("home", loaded_adapters={"a": "gpu"}, waiting_queue_size=9),
        ep("warm-busy", loaded_adapters={"a": "cpu"}, kv_cache_usage_percent=0.95),
        ep("warm", loaded_adapters={"a": "cpu"}),
        ep("cold"),
    ]
    f = build(LoraResidencyFilter, {"queueThreshold": 8})
    assert kept(f, "a", eps) == ["warm"]
    eps[2] = ep("warm", loaded_adapters={"a": "cpu"}, waiting_queue_size=20)
    assert kept(f, "a", eps) == ["cold"]


def test_filter_stops_spreading_at_max_replicas() -> None:
    eps = [
        ep("h1", loaded_adapters={"a": "gpu"}, waiting_queue_size=10),
        ep("h2", loaded_adapters={"a": "gpu"}, waiting_queue_size=10),
        ep("cold"),
    ]
    before = decisions("cap_blocked")
    assert kept(build(LoraResidencyFilter, {"maxReplicas": 2}), "a", eps) == ["h1", "h2"]
    assert decisions("cap_blocked") == before + 1
    assert kept(build(LoraResidencyFilter, {"maxReplicas": 3}), "a", eps) == ["cold"]


def test_filter_keeps_homes_when_the_fleet_is_saturated_and_thresholds_can_be_disabled() -> None:
    eps = [ep("home", loaded_adapters={"a": "gpu"}, waiting_queue_size=10), ep("cold", waiting_queue_size=10)]
    assert kept(build(LoraResidencyFilter), "a", eps) == ["home"]
    eps[0] = ep("home", loaded_adapters={"a": "gpu"}, waiting_queue_size=100, kv_cache_usage_percent=1.0)
    eps[1] = ep("cold")
    disabled = build(LoraResidencyFilter, {"queueThreshold": 0, "kvCacheThreshold": 0})
    assert kept(disabled, "a", eps) == ["home"]


def test_filter_uses_running_adapters_without_residency_metrics() -> None:
    eps = [ep("running", lora_residency=False, active_models={"a": 0}), ep("other", lora_residency=False)]
    assert kept(build(LoraResidencyFilter), "a", eps) == ["running"]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"maxReplicas": -1}, "maxReplicas"),
        ({"queueThreshold": -2}, "queueThreshold"),
        ({"kvCacheThreshold": 1.5}, "kvCacheThreshold"),
    ],
)
def test_filter_bad_parameters_name_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(LoraResidencyFilter, raw)
    assert field in str(e.value)


# --- core-metrics-extractor: residency ------------------------------------------------------------

RESIDENCY_PAGE = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="base"} 1
vllm:num_requests_waiting{model_name="base"} 0
vllm:kv_cache_usage_perc{model_name="base"} 0.1
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} 1.7e9
vllm:lora_adapter_loaded{adapter_name="a",level="gpu",model_name="base",pinned="false"} 1
vllm:lora_adapter_loaded{adapter_name="b",level="cpu",model_name="base",pinned="false"} 1
vllm:lora_adapter_loaded{adapter_name="c",level="gpu",model_name="base",pinned="false"} 0
vllm:lora_adapter_loaded{adapter_name="d",level="cpu",model_name="base",pinned="false"} 1
vllm:lora_adapter_loaded{adapter_name="d",level="gpu",model_name="base",pinned="false"} 1
vllm:num_gpu_loaded_lora_adapters{model_name="base"} 2
vllm:max_gpu_lora_adapters{model_name="base"} 3
"""


def test_extractor_reads_residency_metrics() -> None:
    e = endpoint("e")
    m = CoreMetricsExtractor("c", CoreMetricsExtractorParams()).extract(e, RESIDENCY_PAGE).metrics
    assert m is not None
    assert dict(m.loaded_adapters) == {"a": "gpu", "b": "cpu", "d": "gpu"}  # a 0 series is absent
    assert (m.lora_residency, m.gpu_loaded_adapters, m.max_active_models) == (True, 2, 3)
    assert (m.lora_level("b"), m.lora_level("c"), m.lora_slots_used()) == ("cpu", "", 2)


def test_extractor_without_residency_keeps_the_info_series() -> None:
    residency = (b"vllm:lora_adapter_loaded", b"vllm:num_gpu_loaded", b"vllm:max_gpu")
    page = b"\n".join(line for line in RESIDENCY_PAGE.splitlines() if not line.startswith(residency))
    extractor = CoreMetricsExtractor("c", CoreMetricsExtractorParams())
    m = extractor.extract(endpoint("e"), page).metrics
    assert m is not None and not m.lora_residency
    assert m.max_active_models == 4 and m.lora_level("a") == "gpu" and m.lora_level("b") == ""
    e = endpoint("e")
    e.metrics = extractor.extract(e, RESIDENCY_PAGE).metrics or e.metrics
    assert e.metrics.lora_level("b") == "cpu"
    m = extractor.extract(e, page).metrics  # the engine no longer reports residency
    assert m is not None and not m.lora_residency and m.lora_level("b") == ""


# --- the simulator's adapter slots ----------------------------------------------------------------


def test_slots_evict_to_the_host_cache_and_reload_from_it() -> None:
    slots = LoraSlots(max_loras=1, max_cpu_loras=2)
    assert slots.acquire("a", []) == FROM_DISK
    assert slots.acquire("b", []) == FROM_DISK  # evicts a from the GPU; a stays in the host cache
    assert (slots.loaded, slots.host_only) == (("b",), ("a",))
    assert slots.acquire("a", []) == FROM_HOST
    assert slots.acquire("a", []) == RESIDENT
    assert slots.acquire("c", []) == FROM_DISK  # the host cache is full: b (LRU host-only) goes
    assert (slots.loaded, slots.host_only) == (("c",), ("a",))
    assert slots.acquire("b", []) == FROM_DISK
    assert (slots.counts.from_disk, slots.counts.from_host, slots.counts.evictions) == (4, 1, 4)


def test_slots_without_a_host_cache_only_keep_the_gpu_ones() -> None:
    slots = LoraSlots(max_loras=2)
    for name in ("a", "b", "c"):
        assert slots.acquire(name, []) == FROM_DISK
    assert (slots.loaded, slots.host_only) == (("b", "c"), ())
    assert slots.acquire("a", []) == FROM_DISK


async def test_engine_pays_the_host_load_time_not_the_cold_one() -> None:
    cfg = SimConfig(
        lora_modules=("a", "b"), max_loras=1, max_cpu_loras=2, lora_load_time=40.0, lora_host_load_time=4.0
    )
    engine = Engine(cfg)

    loads = []
    for i, name in enumerate(("a", "b", "a")):
        seq = engine.submit(RequestSpec(str(i), name, 3, prompt=[1, 2, 3]))
        loads.append(seq.lora_load_ms)
        engine.abort(seq)
    assert loads == [40.0, 40.0, 4.0]
    snap = engine.snapshot()
    assert (snap.gpu_lora_adapters, snap.cpu_lora_adapters) == (("a",), ("b",))
    assert snap.counters.lora_adapter_load.count == 3


def test_sim_config_rejects_a_host_cache_smaller_than_the_slots() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        SimConfig(lora_modules=("a",), max_loras=4, max_cpu_loras=2)


# --- the shipped example ------------------------------------------------------------------------


def test_shipped_lora_example_loads_and_refuses_without_experimental_plugins() -> None:
    path = str(Path(__file__).parents[2] / "deploy" / "examples" / "lora-at-scale.yaml")
    loaded = load_config_file(path)
    assert loaded is not None
    with pytest.raises(ConfigError, match="--allow-experimental-plugins"):
        load_config_file(path, allow_experimental=False)


# --- adapter popularity (lora-load-state-scorer's eviction choice) ------------------------------


def test_adapter_heat_ranks_decays_and_predicts_the_victim() -> None:
    heat = AdapterHeat(half_life=10.0, max_tracked=8)
    for _ in range(8):
        heat.add("hot", 0.0)
    heat.add("warm", 0.0)
    heat.add("warm", 0.0)
    heat.add("tail", 5.0)
    now = heat.snapshot(5.0)
    assert [now.percentile(n) for n in ("tail", "warm", "hot")] == [0.0, 0.5, 1.0]
    assert now.percentile("never-seen") == 0.0
    # the victim an LRU engine takes: the idle adapter requested longest ago, one never seen first
    assert now.least_recent(["tail", "hot"]) == "hot"
    assert now.least_recent(["tail", "never-seen"]) == "never-seen"
    # after 40 s (4 half-lives) hot's 8 requests weigh 0.5, below 3 fresh requests for tail
    for _ in range(3):
        heat.add("tail", 45.0)
    later = heat.snapshot(45.0)
    assert later.percentile("tail") == 1.0 and later.percentile("hot") < 1.0
    # bounded: past max_tracked the coldest half goes
    for i in range(10):
        heat.add(f"new-{i}", 46.0)
    assert len(heat) <= 8
