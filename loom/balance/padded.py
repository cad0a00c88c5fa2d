"""Algorithm 2 of OrchMLLM, post-balancing with padding (orchmllm.md §3.5, fixes of §7.1)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from loom.balance.assignment import (Assignment, InfeasibleBalanceError, _check_capacity, _check_coefficient,
                                     _check_num_ranks, _check_workloads, padded_loads)


def _greedy_run_starts(w_sorted: np.ndarray, bound: float, limit: int, integer: bool) -> list[int]:
    """Start positions of the maximal contiguous runs of the ascending order with
    count * w(last) <= bound (GETLEASTBATCHES, section 3.5); stops once more than `limit`.

    A run starting at s may end at e iff (e - s + 1) * w[e] <= bound iff
    s >= g(e) := e + 1 - floor(bound / w[e]); g is strictly increasing (w ascending), so the
    next run starts at searchsorted(g, s, 'right'): O(n) numpy plus O(runs) jumps instead of
    the paper's O(n) Python loop per probe.
    """
    n = w_sorted.size
    if integer:
        # Exact integer floor division; a zero weight fits any count.
        wi = w_sorted.astype(np.int64)
        per = np.where(wi > 0, int(bound) // np.maximum(wi, 1), n + 1)
    else:
        per = np.floor(np.divide(bound, w_sorted, out=np.full(n, np.inf), where=w_sorted > 0))
        per = np.minimum(per, float(n + 1))
        # bound / w rounds: 3 * w / w may come out as 2.999...; correct the floor by the exact
        # test count * w <= bound in both directions, so the always-feasible upper bound is
        # feasible here too
        finite = np.isfinite(per) & (w_sorted > 0)
        per = np.where(finite & ((per + 1) * w_sorted <= bound), per + 1, per)
        per = np.where(finite & (per * w_sorted > bound), per - 1, per)
    g = np.arange(1, n + 1, dtype=np.int64) - per if integer else np.arange(1, n + 1) - per
    starts: list[int] = []
    s = 0
    while s < n:
        starts.append(s)
        if len(starts) > limit:
            break
        s = int(np.searchsorted(g, s, side="right"))
    return starts


def padded_balance(
    lengths: Sequence[float] | np.ndarray,
    num_ranks: int,
    alpha: float = 1.0,
    beta: float = 0.0,
    capacity: float | None = None,
) -> Assignment:
    """Algorithm 2, post-balancing with padding (section 3.5), with the fixes of section 7.1.

    A rank's cost is count * w(max length), w(l) = alpha*l + beta*l^2: Eq. 2's padded case
    (alpha*L + beta*L^2/b with L = b * max). Samples are sorted ascending (ties on index); the
    smallest bound B for which greedy maximal runs of that order need <= d runs is found by
    binary search, and those runs are the new batches. Fixes: the search starts from a bound that
    is always feasible (max w * ceil(n/d), not the paper's min-length bound), the comparison on
    line 14 is `runs <= d -> right = mid`, and the batches are recomputed at the final bound
    instead of returning the last (possibly infeasible) `mid`.

    Exact (section 3.5 [derived]): some optimal partition is contiguous in the sorted order, and
    greedy maximal runs minimise the run count for a bound. With integer w (integer lengths and
    coefficients) the search is over integers and the result is the optimum; with real w it
    stops at relative width 1e-12. Fewer than d runs leave ranks empty (load 0); batches go to
    ranks in run order (longest run last).

    `capacity`: if the optimum exceeds it, no assignment fits; InfeasibleBalanceError.
    """
    num_ranks = _check_num_ranks(num_ranks)
    l = _check_workloads(lengths, "lengths")
    alpha = _check_coefficient(alpha, "alpha")
    beta = _check_coefficient(beta, "beta")
    capacity = _check_capacity(capacity)
    n = l.size
    if n == 0:
        return Assignment(np.empty(0, dtype=np.int64), np.zeros(num_ranks))
    w = alpha * l + beta * l * l
    order = np.lexsort((np.arange(n), w))  # ascending, ties on sample index
    w_sorted = w[order]
    integer = bool(np.all(w_sorted == np.round(w_sorted))) and float(w_sorted[-1]) * n < 2.0**52
    # Lower bounds: the largest sample alone; the average (padded cost >= sum of w on a rank).
    # The upper bound is always feasible.
    lo = max(float(w_sorted[-1]), math.ceil(float(w_sorted.sum()) / num_ranks) if integer else 0.0)
    hi = float(w_sorted[-1]) * math.ceil(n / num_ranks)  # d runs of ceil(n/d): always feasible
    if integer:
        lo_i, hi_i = int(lo), int(hi)
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            if len(_greedy_run_starts(w_sorted, mid, num_ranks, True)) <= num_ranks:
                hi_i = mid
            else:
                lo_i = mid + 1
        bound = float(lo_i)
    else:
        # Invariant: hi feasible, lo - tiny infeasible or lo = max(w) (a lower bound).
        if len(_greedy_run_starts(w_sorted, lo, num_ranks, False)) <= num_ranks:
            hi = lo
        while hi - lo > 1e-12 * hi:
            mid = 0.5 * (lo + hi)
            if len(_greedy_run_starts(w_sorted, mid, num_ranks, False)) <= num_ranks:
                hi = mid
            else:
                lo = mid
        bound = hi
    starts = _greedy_run_starts(w_sorted, bound, num_ranks, integer)
    assert len(starts) <= num_ranks  # guaranteed by the search; recomputed, not stale (fix 3)
    run_of_sorted = np.zeros(n, dtype=np.int64)
    run_of_sorted[np.asarray(starts[1:], dtype=np.int64)] = 1
    run_of_sorted = np.cumsum(run_of_sorted)
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[order] = run_of_sorted
    loads = padded_loads(l, rank_of, num_ranks, alpha, beta)
    result = Assignment(rank_of, loads)
    if capacity is not None and result.max_load > capacity:
        raise InfeasibleBalanceError(
            f"the optimal padded max load is {result.max_load} > capacity {capacity}; no assignment "
            "fits; raise the capacity, use more ranks or a smaller batch"
        )
    return result


def _runs_from_top(l_desc: np.ndarray, alpha: float, beta: float, bound: float, limit: int) -> list[int]:
    """Start positions (in descending order of length) of greedy maximal runs under ``bound``:
    a run starting at ``s`` holds ``floor(bound / w(l[s]))`` samples (its first is its longest).
    Stops after ``limit + 1`` runs. Minimal in count, as the ascending greedy: after t runs it
    stands at least as far as any partition into runs (each run's capacity is set by its first
    sample, which is no longer than the other's). O(runs) scalar steps, no n-sized pass."""
    n = l_desc.size
    starts: list[int] = []
    pos = 0
    while pos < n:
        starts.append(pos)
        if len(starts) > limit:
            break
        x = float(l_desc[pos])
        w = alpha * x + beta * x * x
        if w <= 0.0:
            break  # zero-cost rows: any count fits
        k = int(bound // w)
        if k * w > bound:  # float floor one too high
            k -= 1
        pos += max(k, 1)
    return starts


def padded_balance_fast(lengths: np.ndarray, num_ranks: int, alpha: float = 1.0, beta: float = 0.0,
                        tolerance: float = 1e-3) -> Assignment:
    """`padded_balance` for the runtime's hot path: the same objective and contiguous-run
    structure, searched over real bounds to relative ``tolerance``, so its max load is at most
    ``(1 + tolerance)`` times the optimum (tested against the exact `padded_balance`).

    Integer lengths are ordered longest first by a radix sort; each probe of the bound is a
    greedy from the top (`_runs_from_top`, at most ``d + 1`` steps), and the search starts at the
    lower bound ``max(max w, sum w / d)`` and steps up by the run count's ratio to ``d``
    (runs shrink about as 1 / bound) before bisecting, so a 153,600-sample batch over 2560 ranks
    takes a handful of probes. Loads come from the runs (count x first row's cost)."""
    d = _check_num_ranks(num_ranks)
    alpha = _check_coefficient(alpha, "alpha")
    beta = _check_coefficient(beta, "beta")
    l = np.asarray(lengths)
    if l.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array of per-sample token counts, got shape {l.shape}")
    n = l.size
    if n == 0:
        return Assignment(np.empty(0, dtype=np.int64), np.zeros(d))
    if l.dtype.kind in "iu" and l.min() >= 0 and l.max() < 2**16:
        order = np.argsort((l.max() - l).astype(np.uint16), kind="stable")  # longest first, ties by index
        lf = l.astype(np.float64)
    else:
        lf = _check_workloads(l, "lengths")
        order = np.lexsort((np.arange(n), -lf))
    l_desc = l[order]
    top = float(l_desc[0])
    lo = max(alpha * top + beta * top * top, (alpha * float(lf.sum()) + beta * float(np.dot(lf, lf))) / d)
    runs = len(_runs_from_top(l_desc, alpha, beta, lo, d))
    if runs <= d:
        bound = lo
    else:
        hi = lo
        while True:  # step up until feasible; lo stays the last infeasible bound
            hi = hi * max(runs / d, 1.0 + tolerance) * (1.0 + tolerance)
            runs = len(_runs_from_top(l_desc, alpha, beta, hi, d))
            if runs <= d:
                break
            lo = hi
        while hi - lo > tolerance * hi:
            mid = 0.5 * (lo + hi)
            if len(_runs_from_top(l_desc, alpha, beta, mid, d)) <= d:
                hi = mid
            else:
                lo = mid
        bound = hi
    starts = np.asarray(_runs_from_top(l_desc, alpha, beta, bound, d), dtype=np.int64)
    sizes = np.diff(np.append(starts, n))
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[order] = np.repeat(np.arange(starts.size, dtype=np.int64), sizes)
    first = l_desc[starts].astype(np.float64)
    loads = np.zeros(d)
    loads[:starts.size] = sizes * (alpha * first + beta * first * first)
    return Assignment(rank_of, loads)
