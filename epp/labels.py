"""Bounded values for metric labels that come from requests (model names, fairness ids, pools).

Served and pinned values keep their own label; any other value records as ``other``.
"""

from __future__ import annotations

from collections.abc import Iterable

from epp import promlite

OVERFLOW = promlite.OVERFLOW  # "other"
DEFAULT_LIMIT = 1000

LABEL_OVERFLOW_TOTAL = promlite.Counter(
    "llm_d_epp_metric_label_overflow_total",
    "Request-derived metric label values recorded as 'other' (not served, or over the cap), per label.",
    ["label"],
)
promlite.register(LABEL_OVERFLOW_TOTAL)


class BoundedLabel:
    """The label values one kind of request-derived value may take.

    ``bound(value)`` is one dict lookup for a value seen before. Pinned values (configuration) always
    keep their label; served values (reported by the model servers) keep theirs, at most ``limit``;
    once any value is served every other one records as ``OVERFLOW``; before that the first ``limit``
    distinct values are admitted. Admission is sticky, so paired gauge updates stay balanced.
    """

    __slots__ = ("_admitted", "_folded", "_labels", "_served", "limit", "name", "restricted")

    def __init__(self, name: str, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 0:
            raise ValueError(f"{name}: the label limit must be >= 0, got {limit}")
        self.name = name
        self.limit = limit
        self.restricted = False
        self._labels: dict[str, str] = {}  # value -> its own label (pinned, served or admitted)
        self._admitted = 0  # admitted while unrestricted
        self._served = 0
        self._folded = LABEL_OVERFLOW_TOTAL.labels(name)

    def bound(self, value: str) -> str:
        """The label to record for ``value``."""
        label = self._labels.get(value)
        if label is not None:
            return label
        if not value:
            return value
        if self.restricted or self._admitted >= self.limit:
            self._folded.value += 1
            return OVERFLOW
        self._admitted += 1
        self._labels[value] = value
        return value

    def pin(self, values: Iterable[str]) -> None:
        """Configured values: their own label always, outside every cap."""
        for v in values:
            if v:
                self._labels[v] = v

    def serve(self, values: Iterable[str]) -> None:
        """Values the pool reports serving; the first call restricts the set to known values."""
        labels = self._labels
        for v in values:
            if not v:
                continue
            self.restricted = True  # also when v was admitted before anything was known
            if v in labels:
                continue
            if self._served >= self.limit:
                break
            self._served += 1
            labels[v] = v

    def __contains__(self, value: str) -> bool:
        return value in self._labels

    def __len__(self) -> int:
        return len(self._labels)

    def reset(self, limit: int | None = None) -> None:
        """Forget every value (and set a new ``limit``); for start-up configuration and tests."""
        if limit is not None:
            if limit < 0:
                raise ValueError(f"{self.name}: the label limit must be >= 0, got {limit}")
            self.limit = limit
        self._labels = {}
        self._admitted = self._served = 0
        self.restricted = False


MODEL_NAMES = BoundedLabel("model_name")
"""Model names (incoming and target) on every model-labelled metric."""

FAIRNESS_IDS = BoundedLabel("fairness_id")
"""Fairness ids (``x-gateway-inference-fairness-id``): never restricted, capped by
``--fairness-id-metric-label-limit``."""

INFERENCE_POOLS = BoundedLabel("inference_pool")
"""InferencePool names on the request metrics: each pool the EPP serves is served here when its
runtime is built (at most ``DEFAULT_LIMIT`` over the process's life; later pools record as
``other``); ``""``: a request that matched no pool."""
