"""Online latency regression for ``predicted-latency-producer``: exponentially weighted ridge.

Pure Python on short feature vectors: an update costs O(d²) plus an O(d³) solve (d <= 9), a
prediction O(d). ``ErrorWindow`` keeps the absolute percentage errors of recent predictions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["ErrorWindow", "OnlineRidge"]

MIN_ACTUAL_MS = 1.0
"""Observed latencies below this count as this in percentage errors (no division by ~0)."""


class OnlineRidge:
    """Linear regression ``y ≈ θ·x`` fitted online with exponential forgetting and a ridge penalty.

    Keeps ``A = Σ λᵏ x xᵀ`` and ``b = Σ λᵏ x y`` (the newest sample has weight 1) and solves
    ``(A + ridge·I') θ = b`` after each update, where ``I'`` is the identity without the first entry (the
    intercept ``x[0] = 1`` is not penalised). ``samples`` counts every update; ``warm`` says the model
    has seen ``warmup`` of them and may predict.
    """

    __slots__ = ("_a", "_b", "_dim", "_forget", "_ridge", "samples", "theta", "warmup")

    def __init__(self, dim: int, *, forgetting: float, ridge: float, warmup: int) -> None:
        self._dim = dim
        self._forget = forgetting
        self._ridge = ridge
        self.warmup = warmup
        self._a = [[0.0] * dim for _ in range(dim)]
        self._b = [0.0] * dim
        self.theta = [0.0] * dim
        self.samples = 0

    @property
    def warm(self) -> bool:
        return self.samples >= self.warmup

    def predict(self, x: Sequence[float]) -> float:
        """``θ·x``, never below 0 (a latency)."""
        y = 0.0
        for t, v in zip(self.theta, x, strict=True):
            y += t * v
        return y if y > 0.0 else 0.0

    def update(self, x: Sequence[float], y: float) -> None:
        lam = self._forget
        a, b, d = self._a, self._b, self._dim
        for i in range(d):
            xi = x[i]
            row = a[i]
            for j in range(i, d):
                row[j] = lam * row[j] + xi * x[j]
            b[i] = lam * b[i] + xi * y
        self.samples += 1
        self._solve()

    def _solve(self) -> None:
        """Cholesky solve of ``(A + ridge·I') θ = b`` (A kept as its upper triangle)."""
        d, a, alpha = self._dim, self._a, self._ridge
        low = [[0.0] * d for _ in range(d)]
        for i in range(d):
            for j in range(i + 1):
                s = a[j][i]  # entry (i, j), j <= i, from the upper triangle
                if i == j and i > 0:
                    s += alpha
                li, lj = low[i], low[j]
                for k in range(j):
                    s -= li[k] * lj[k]
                if i == j:
                    if s <= 1e-12:  # not positive definite (no data on a direction): keep θ
                        return
                    li[i] = s**0.5
                else:
                    li[j] = s / lj[j]
        z = [0.0] * d
        for i in range(d):
            s = self._b[i]
            li = low[i]
            for k in range(i):
                s -= li[k] * z[k]
            z[i] = s / li[i]
        theta = [0.0] * d
        for i in range(d - 1, -1, -1):
            s = z[i]
            for k in range(i + 1, d):
                s -= low[k][i] * theta[k]
            theta[i] = s / low[i][i]
        self.theta = theta


class ErrorWindow:
    """Mean absolute percentage error (a ratio) over the last ``size`` predictions."""

    __slots__ = ("_errors", "_sum")

    def __init__(self, size: int) -> None:
        self._errors: deque[float] = deque(maxlen=size)
        self._sum = 0.0

    def add(self, predicted: float, actual: float) -> None:
        err = abs(predicted - actual) / max(actual, MIN_ACTUAL_MS)
        errors = self._errors
        if len(errors) == errors.maxlen:
            self._sum -= errors[0]
        errors.append(err)
        self._sum += err

    def __len__(self) -> int:
        return len(self._errors)

    @property
    def mape(self) -> float | None:
        """The mean error, None before the first prediction was scored."""
        n = len(self._errors)
        if not n:
            return None
        if n % 256 == 0:  # re-sum now and then: no drift from the running subtraction
            self._sum = sum(self._errors)
        return self._sum / n
