"""Oobleck's batch distribution over heterogeneous pipelines (oobleck.md §3.5, Eq. 2.6, and the
redistribution after failures, §3.8), in whole samples.

Pipeline ``i`` running ``s_i`` samples takes ``t_i(s_i) = fixed_i + per_sample_i * s_i``
seconds: a template's fill and drain plus its bottleneck stage once per microbatch, spread per
sample (`loom.planner.oobleck_templates.PipelineTemplate`: ``fixed = fill``, ``per_sample =
bottleneck / b`` for microbatches of ``b`` samples; the affine model of gap G5). The global
batch of ``B`` samples is split so that ``sum_i s_i = B`` exactly and ``s_i >= minimum_i`` (a
pipeline runs at least as many samples as its microbatches need).

Two objectives, both solved exactly:

- ``"eq2.6"`` (the default, the text's): ``min sum_i (t_i - mean t)^2``. Per pipeline, not per
  template (gap G12): with whole samples two instances of one template may differ by a sample.
  The text hands this integer quadratic program to a MINLP solver (Pyomo + MindtPy, which needs
  glpk and ipopt binaries). It is small and has structure we use instead of a solver:
  ``sum (t_i - mean)^2 = min_mu sum (t_i - mu)^2``, and for a fixed ``mu`` the inner problem is
  separable convex with one sum constraint, solved exactly by rounding its continuous optimum and
  then moving single samples between pipelines while a move helps (a separable convex function
  over ``sum s = B`` is optimal exactly when no one-sample move improves it). As ``mu`` varies
  the inner optimum traces the lower envelope of finitely many lines ``Q(s) - 2 mu T(s)``
  (``T = sum t_i``, ``Q = sum t_i^2``); the envelope's pieces between the smallest and largest
  possible mean are found by intersecting neighbouring lines, and the best of them is the
  optimum of Eq. 2.6. SciPy's MILP cannot take the quadratic objective; plain enumeration is
  exponential in the number of pipelines.
- ``"makespan"``: ``min max_i t_i``, the step time itself, by water-filling (each next sample
  to the pipeline that would finish it soonest), which is exact for non-decreasing ``t_i``.

When ``B`` is smaller than the minimums' sum there is no distribution; the error recommends the
nearest distributable batch (the text's "adjusted global batch size", §3.5) instead of
changing it (the text: "Oobleck does not change the global batch size arbitrarily").
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

OBJECTIVES = ("eq2.6", "makespan")


class BatchDistributionError(ValueError):
    """The global batch cannot be split as asked; the message names the numbers and the fix."""


@dataclass(frozen=True)
class BatchDistribution:
    """``samples[i]``: pipeline ``i``'s share of the global batch; ``times[i]``: its seconds."""

    samples: tuple[int, ...]
    times: tuple[float, ...]

    @property
    def step_time(self) -> float:
        """The slowest pipeline's time: the step waits for it (before the gradient sync)."""
        return max(self.times)

    @property
    def squared_deviation(self) -> float:
        """Eq. 2.6's objective."""
        t = np.asarray(self.times)
        return float(((t - t.mean()) ** 2).sum())


def _check(fixed: Sequence[float], per_sample: Sequence[float], batch: int,
           minimum: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.asarray(fixed, dtype=float)
    c = np.asarray(per_sample, dtype=float)
    if a.ndim != 1 or len(a) == 0 or a.shape != c.shape:
        raise BatchDistributionError(f"fixed ({len(a)}) and per_sample ({len(c)}) need one entry per pipeline, "
                                     f"at least one pipeline")
    if not (np.isfinite(a).all() and (a >= 0).all() and np.isfinite(c).all() and (c > 0).all()):
        raise BatchDistributionError("pipeline times must be finite, fixed >= 0 and per_sample > 0 seconds")
    m = np.ones(len(a), dtype=np.int64) if minimum is None else np.asarray(minimum, dtype=np.int64)
    if m.shape != a.shape or (m < 0).any():
        raise BatchDistributionError(f"minimum = {list(m)}: one non-negative sample count per pipeline")
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise BatchDistributionError(f"global batch = {batch!r}: must be a positive number of samples")
    if m.sum() > batch:
        raise BatchDistributionError(
            f"global batch of {batch} samples cannot give {len(a)} pipelines their minimum samples "
            f"{[int(x) for x in m]} (sum {int(m.sum())}): use a global batch of at least {int(m.sum())} samples "
            f"(the nearest distributable), or fewer pipelines")
    return a, c, m


def distribute_batch(fixed: Sequence[float], per_sample: Sequence[float], batch: int,
                     minimum: Sequence[int] | None = None, objective: str = "eq2.6") -> BatchDistribution:
    """Split ``batch`` samples over pipelines with times ``fixed[i] + per_sample[i] * s`` (module
    docstring), each getting at least ``minimum[i]`` (default 1), under ``objective``."""
    a, c, m = _check(fixed, per_sample, batch, minimum)
    if objective == "makespan":
        s = _water_fill(a, c, m, batch)
    elif objective == "eq2.6":
        s = _squared_deviation_optimum(a, c, m, batch)
    else:
        raise BatchDistributionError(f"objective = {objective!r}: choose one of {list(OBJECTIVES)}")
    return BatchDistribution(tuple(int(x) for x in s), tuple(float(x) for x in a + c * s))


def _water_fill(a: np.ndarray, c: np.ndarray, m: np.ndarray, batch: int) -> np.ndarray:
    """Exact ``min max t_i``: the first ``batch - sum m`` samples in order of the time they
    finish at; bulk-assigned up to a bound first, then one at a time (ties: lower index)."""
    s = m.copy()
    left = batch - int(m.sum())
    if left == 0:
        return s
    # a level every pipeline reaches before the optimum's: fill to it in bulk
    level = (left + (a / c).sum() + (m).sum()) / (1 / c).sum()
    bulk = np.maximum(m, np.floor((level - a) / c - 1).astype(np.int64))
    while bulk.sum() > batch:  # only when the minimums bind: back off
        bulk = np.maximum(m, bulk - 1)
    s = bulk
    heap = [(a[i] + c[i] * (s[i] + 1), i) for i in range(len(a))]
    heapq.heapify(heap)
    for _ in range(batch - int(s.sum())):
        _, i = heapq.heappop(heap)
        s[i] += 1
        heapq.heappush(heap, (a[i] + c[i] * (s[i] + 1), i))
    return s


def _inner(a: np.ndarray, c: np.ndarray, m: np.ndarray, batch: int, mu: float) -> np.ndarray:
    """Exact ``argmin_s sum (a + c s - mu)^2`` with ``sum s = batch``, ``s >= m`` (module docstring):
    the rounded continuous optimum, then single-sample moves while one lowers the sum."""
    # continuous optimum with the bounds: s_i(lam) = max(m_i, (mu - a_i + lam / c_i) / c_i), lam by bisection
    def total(lam: float) -> float:
        return float(np.maximum(m, (mu - a + lam / c) / c).sum())

    lo, hi = -1.0, 1.0
    while total(lo) > batch:
        lo *= 2
    while total(hi) < batch:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < batch else (lo, mid)
    s = np.maximum(m, np.floor(np.maximum(m, (mu - a + hi / c) / c)).astype(np.int64))
    while s.sum() > batch:  # rounding down can only undershoot, unless the bounds bind
        over = np.flatnonzero(s > m)
        s[over[np.argmax((a + c * s)[over])]] -= 1
    t = a + c * s
    while True:
        add = (t + c - mu) ** 2 - (t - mu) ** 2  # cost of one more sample
        drop = np.where(s > m, (t - mu) ** 2 - (t - c - mu) ** 2, -np.inf)  # saving of one fewer
        if s.sum() < batch:
            j = int(np.argmin(add))
            s[j] += 1
            t[j] += c[j]
            continue
        gain = drop[:, None] - add[None, :]  # moving a sample from i (rows) to j (columns)
        np.fill_diagonal(gain, -np.inf)
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[i, j] <= 1e-12 * max(1.0, mu * mu):
            return s
        s[i] -= 1
        s[j] += 1
        t = a + c * s


def _deviation(a: np.ndarray, c: np.ndarray, s: np.ndarray) -> float:
    t = a + c * s
    return float(((t - t.mean()) ** 2).sum())


def _squared_deviation_optimum(a: np.ndarray, c: np.ndarray, m: np.ndarray, batch: int) -> np.ndarray:
    x = len(a)
    if x == 1:
        return np.array([batch], dtype=np.int64)
    left = batch - int(m.sum())
    base = float((a + c * m).sum())
    mu_lo, mu_hi = (base + left * c.min()) / x, (base + left * c.max()) / x  # the mean lies between
    # tighter: an optimum has every |t_i - mean| <= r = sqrt(V) for any feasible V, and
    # sum_i (t_i - a_i) / c_i = batch then puts its mean within r of the level all pipelines
    # would share without the minimums, `level`
    level = (batch + (a / c).sum()) / (1 / c).sum()
    r = math.sqrt(min(_deviation(a, c, _inner(a, c, m, batch, level)), _deviation(a, c, _water_fill(a, c, m, batch))))
    mu_lo, mu_hi = max(mu_lo, level - r), min(mu_hi, level + r)
    if mu_lo > mu_hi:  # rounding only
        mu_lo = mu_hi = min(max(level, mu_lo), mu_hi)

    def line(s: np.ndarray) -> tuple[float, float]:
        t = a + c * s
        return float((t * t).sum()), float(t.sum())  # Q, T

    def deviation(s: np.ndarray) -> float:
        return _deviation(a, c, s)

    found: dict[tuple[int, ...], np.ndarray] = {}

    def visit(s: np.ndarray) -> np.ndarray:
        found.setdefault(tuple(int(v) for v in s), s)
        return s

    s_lo, s_hi = visit(_inner(a, c, m, batch, mu_lo)), visit(_inner(a, c, m, batch, mu_hi))
    stack = [(s_lo, s_hi)]
    for _ in range(10_000):
        if not stack:
            break
        sl, sh = stack.pop()
        (q1, t1), (q2, t2) = line(sl), line(sh)
        if abs(t1 - t2) <= 1e-12 * max(1.0, abs(t1)):
            continue
        mu = (q2 - q1) / (2 * (t2 - t1))  # where the two lines cross
        sc = visit(_inner(a, c, m, batch, mu))
        qc, tc = line(sc)
        if qc - 2 * mu * tc >= q1 - 2 * mu * t1 - 1e-9 * max(1.0, abs(q1)):
            continue  # no line below the crossing: the two are neighbours on the envelope
        stack.append((sl, sc))
        stack.append((sc, sh))
    # the envelope's pieces (and the ends) hold the optimum; ties go to the first in sample order
    return min(found.values(), key=lambda s: (round(deviation(s), 12), tuple(-s)))
