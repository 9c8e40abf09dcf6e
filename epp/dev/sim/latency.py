"""The simulated engine's latency model and the latency histograms it records."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's buckets for ``vllm:time_to_first_token_seconds``."""

ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""vLLM's buckets for ``vllm:inter_token_latency_seconds``."""

QUEUE_TIME_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets for ``vllm:request_queue_time_seconds``."""

LORA_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Buckets of the simulator's ``vllm:lora_adapter_load_seconds``."""


@dataclass(slots=True)
class LatencyModel:
    """Computes modelled TTFT and inter-token latency in milliseconds (unscaled by ``time_scale``).

    TTFT = prefill overhead + per-token cost x uncached prompt tokens; the inter-token latency is a
    constant. Both get optional Gaussian jitter and a load factor
    ``1 + time_factor_under_load * (running - 1) / max(1, max_num_seqs - 1)``.
    """

    time_to_first_token: float
    prefill_time_per_token: float
    inter_token_latency: float
    time_factor_under_load: float
    max_num_seqs: int
    time_to_first_token_std_dev: float = 0.0
    inter_token_latency_std_dev: float = 0.0
    rng: random.Random = field(default_factory=random.Random)

    def load_factor(self, running: int) -> float:
        """How much slower everything is with ``running`` requests in the batch (1.0 when alone)."""
        busy = max(0, running - 1) / max(1, self.max_num_seqs - 1)
        return 1.0 + self.time_factor_under_load * busy

    def ttft_ms(self, uncached_tokens: int, running: int) -> float:
        """Prefill time for ``uncached_tokens`` prompt tokens with ``running`` requests in the batch."""
        base = self.time_to_first_token + self.prefill_time_per_token * uncached_tokens
        return self._jitter(base, self.time_to_first_token_std_dev) * self.load_factor(running)

    def itl_ms(self, running: int) -> float:
        """Time to produce one more output token with ``running`` requests in the batch."""
        base = self._jitter(self.inter_token_latency, self.inter_token_latency_std_dev)
        return base * self.load_factor(running)

    def _jitter(self, value: float, std_dev: float) -> float:
        if std_dev <= 0:
            return value
        return max(0.0, self.rng.gauss(value, std_dev))


@dataclass(slots=True)
class Histogram:
    """A cumulative-bucket histogram in seconds, as Prometheus exposes it."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for index, bound in enumerate(self.buckets):
            if seconds <= bound:
                self.counts[index] += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``."""
        pairs = [(_le(bound), float(count)) for bound, count in zip(self.buckets, self.counts, strict=True)]
        return [*pairs, ("+Inf", float(self.count))]

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


def _le(bound: float) -> str:
    return repr(float(bound))
