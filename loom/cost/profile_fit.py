"""Fitting a profile's measurements (entrain.md §3.1): per-layer cost coefficients and
message-cost lines.

Entrain's hardware-calibrated cost model fits each layer's measured times "to a ... quadratic
model ``T(x) = a x^2 + b x + c`` via linear regression". A microbatch's work is a `Workload`
and each layer and phase is fitted as

    t = a * attn_sq + a2 * tokens^2 + b * tokens + d * segments + c

by non-negative least squares on relative error (rows weighted by ``1 / t``, so the small
microbatches that dominate pipelines of tiny models are fitted as well as the large ones). For
one sequence of length ``x`` this is entrain's ``a x^2 + b x + c``; the two extra terms are
what loom's layers actually do: ``tokens^2`` is attention over a *packed* sequence with a dense
block-diagonal mask (the zoo encoders score all ``N x N`` pairs and mask them, whatever the item
sizes), ``segments`` is per-item work (the audio front-end runs its convolutions clip by clip).
`LinearFit` is the bytes-to-seconds fit of one communication quantity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from loom.cost.model import Workload

FEATURES = ("attn_sq", "tokens_sq", "tokens", "segments", "one")


def features(work: Workload) -> np.ndarray:
    """The regressors of a workload, in `FEATURES` order."""
    return np.array([work.attn_sq, float(work.tokens) ** 2, work.tokens, work.segments, 1.0], dtype=np.float64)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares ``min |a x - b|, x >= 0`` (Lawson-Hanson active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 10 * np.finfo(float).eps * max(1.0, np.linalg.norm(a, 1)) * max(m, n)
    for _ in range(max_iter or 3 * n):
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # step back to the boundary and drop the coefficients that hit zero
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit_cost(works: Sequence[Workload], values: Sequence[float], relative: bool = True) -> list[float]:
    """Fit ``value = coef . features(work)`` with non-negative coefficients.

    ``relative`` weights each row by ``1 / value`` so the fit minimises relative error (times
    spanning two orders of magnitude are all fitted well); columns are scaled to unit maximum
    so the solver sees comparable magnitudes. Columns that never vary from 0 get 0."""
    x = np.array([features(w) for w in works], dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if len(y) == 0:
        return [0.0] * len(FEATURES)
    if relative:
        floor = max(float(np.median(np.abs(y))) * 1e-3, 1e-12)
        weights = 1.0 / np.maximum(np.abs(y), floor)
    else:
        weights = np.ones_like(y)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls((x / scale) * weights[:, None], y * weights) / scale
    return [float(c) for c in coef]


def evaluate(coef: Sequence[float], work: Workload) -> float:
    return float(np.dot(np.asarray(coef, dtype=np.float64), features(work)))


@dataclass
class LinearFit:
    """Seconds as a function of bytes (communication), from measured ``points`` ``[[bytes,
    seconds], ...]``: interpolated linearly between them (gloo's costs are not linear in the
    size: small messages and scheduling make steps), the first point's value below them, and
    ``alpha + bytes * seconds_per_byte`` (the least-squares line through them) fitted to the
    last point above them."""

    alpha_s: float = 0.0
    seconds_per_byte: float = 0.0
    points: list[list[float]] = field(default_factory=list)

    def time(self, nbytes: float) -> float:
        pts = self.points
        if not pts:
            return self.alpha_s + nbytes * self.seconds_per_byte
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / max(b1 - b0, 1e-12)
        return pts[-1][1] + (nbytes - pts[-1][0]) * self.seconds_per_byte

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> "LinearFit":
        pts = sorted((float(b), float(t)) for b, t in points)
        sizes = np.array([p[0] for p in pts], dtype=np.float64)
        secs = np.array([p[1] for p in pts], dtype=np.float64)
        top = max(sizes.max(), 1.0)
        w = 1.0 / np.maximum(secs, 1e-9)
        a = np.stack([np.ones_like(sizes), sizes / top], axis=1) * w[:, None]
        alpha, slope = nnls(a, secs * w)
        return cls(float(alpha), float(slope / top), [[b, t] for b, t in pts])
