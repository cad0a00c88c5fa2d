"""A balancing result: which rank (bin) gets each sample, and the loads that gives; the input
checks and per-rank cost functions every post-balancing algorithm shares (orchmllm.md §3.1, §3.3).

Every algorithm returns an `Assignment` that is a partition of its input samples: no sample is
dropped or duplicated. Ties are broken on sample index and rank index so every rank computes
the identical plan (orchmllm.md §7.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


class InfeasibleBalanceError(ValueError):
    """The requested constraint (e.g. a per-rank capacity) cannot be met by any assignment."""


@dataclass(frozen=True)
class Assignment:
    """A partition of samples 0..n-1 over ranks 0..d-1.

    Stored as one rank id per sample (not lists per rank) so that building it for 153,600
    samples costs microseconds, not milliseconds; `ranks` materialises the lists on demand.
    `loads` are the per-rank costs under the objective of the algorithm that produced it.
    """

    rank_of_sample: np.ndarray  # int64, shape (n,)
    loads: np.ndarray  # float64, shape (d,)

    @property
    def num_ranks(self) -> int:
        return int(self.loads.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.rank_of_sample.shape[0])

    @property
    def ranks(self) -> list[list[int]]:
        """Per rank, its sample indices in ascending order."""
        order = np.argsort(self.rank_of_sample, kind="stable")
        counts = np.bincount(self.rank_of_sample, minlength=self.num_ranks)
        bounds = np.concatenate(([0], np.cumsum(counts)))
        flat = order.tolist()
        return [flat[bounds[r] : bounds[r + 1]] for r in range(self.num_ranks)]

    def samples_on(self, rank: int) -> np.ndarray:
        return np.flatnonzero(self.rank_of_sample == rank)

    @property
    def max_load(self) -> float:
        return float(self.loads.max()) if self.loads.size else 0.0

    @property
    def mean_load(self) -> float:
        return float(self.loads.mean()) if self.loads.size else 0.0

    def imbalance(self) -> float:
        """max / mean load (1.0 is perfect; 1.0 also when every load is 0)."""
        mean = self.mean_load
        return self.max_load / mean if mean > 0 else 1.0


# ----------------------------------------------------------------------------- validation


def _check_num_ranks(num_ranks: int, name: str = "num_ranks") -> int:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)):
        raise ValueError(f"{name} must be an int >= 1, got {num_ranks!r}; pass the DP world size")
    if num_ranks < 1:
        raise ValueError(f"{name} must be >= 1, got {num_ranks}; pass the DP world size")
    return int(num_ranks)


def _check_workloads(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of per-sample numbers, got shape {arr.shape}")
    if arr.size and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinity; pass finite per-sample workloads")
    if arr.size and arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ValueError(
            f"{name}[{bad}] = {arr[bad]} is negative; workloads are token counts or costs and must be >= 0"
        )
    return arr


def _check_coefficient(value: float, name: str) -> float:
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_capacity(capacity: float | None) -> float | None:
    if capacity is None:
        return None
    if not np.isfinite(capacity) or capacity <= 0:
        raise ValueError(f"capacity must be a finite number > 0 or None, got {capacity!r}")
    return float(capacity)


# ------------------------------------------------------------------------- cost functions


def packed_loads(workloads: Sequence[float] | np.ndarray, rank_of_sample: np.ndarray, num_ranks: int) -> np.ndarray:
    """Per-rank sum of workloads: Eq. 1, no-padding case (section 3.1)."""
    w = np.asarray(workloads, dtype=np.float64)
    return np.bincount(rank_of_sample, weights=w, minlength=num_ranks).astype(np.float64)


def padded_loads(
    lengths: Sequence[float] | np.ndarray,
    rank_of_sample: np.ndarray,
    num_ranks: int,
    alpha: float = 1.0,
    beta: float = 0.0,
) -> np.ndarray:
    """Per-rank padded cost count * (alpha * max_len + beta * max_len^2): Eq. 2, padding case
    (section 3.3; alpha*L_i + beta*L_i^2/b_i with L_i = b_i * max_len)."""
    l = np.asarray(lengths, dtype=np.float64)
    counts = np.bincount(rank_of_sample, minlength=num_ranks)
    max_len = np.zeros(num_ranks)
    np.maximum.at(max_len, rank_of_sample, l)
    return counts * (alpha * max_len + beta * max_len * max_len)
