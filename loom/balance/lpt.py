"""Algorithm 1 of OrchMLLM, post-balancing without padding: LPT (orchmllm.md §3.4).

Three implementations of one assignment: the heap (`_lpt_heap`, small instances and the
reference), vectorised batches over float workloads (`_lpt_fast`) and the integer core over
packed integer keys (`_lpt_integer_core`, the fast path). `quantised_lpt` feeds the integer core
float costs scaled to integers, with the bound its tests check.
"""

from __future__ import annotations

import heapq
import math
import threading
from typing import Sequence

import numpy as np

from loom.balance.assignment import (Assignment, InfeasibleBalanceError, _check_capacity, _check_num_ranks,
                                     _check_workloads, packed_loads)


def _descending_order(w: np.ndarray) -> np.ndarray:
    # Descending by workload, ties by ascending sample index: deterministic on every rank.
    return np.lexsort((np.arange(w.size), -w))


def _lpt_heap(w: np.ndarray, num_ranks: int) -> np.ndarray:
    """Textbook LPT with a heap (section 3.4): each sample, longest first, goes to the rank with
    the smallest (load, rank index). Slow in Python at scale; the oracle for `_lpt_fast`."""
    heap = [(0.0, r) for r in range(num_ranks)]
    rank_of = np.empty(w.size, dtype=np.int64)
    for k in _descending_order(w).tolist():
        load, r = heap[0]
        rank_of[k] = r
        heapq.heapreplace(heap, (load + float(w[k]), r))
    return rank_of


def _lpt_fast(w: np.ndarray, num_ranks: int) -> np.ndarray:
    """The same assignment as `_lpt_heap`, computed in vectorised batches.

    Why it is exact: with ranks sorted by (load, rank) as l_0 <= l_1 <= ..., sequential LPT gives
    the next items p_0 >= p_1 >= ... to ranks 0, 1, ..., t as long as rank t is still the minimum
    when item t arrives, i.e. every already-updated rank i < t now has (l_i + p_i, r_i) >
    (l_t, r_t). We find the longest such prefix with one prefix-minimum, assign it at once, and
    re-sort. In the usual regime (loads within an item's size of each other) a batch covers a
    large fraction of the ranks, so 153,600 samples take a few hundred numpy steps instead of
    153,600 heap operations.
    """
    n = w.size
    order_items = _descending_order(w)
    p_all = w[order_items]
    rank_of = np.empty(n, dtype=np.int64)
    loads = np.zeros(num_ranks)
    ranks_sorted = np.arange(num_ranks)  # ranks by (load, rank index)
    pos = 0
    while pos < n:
        k_max = min(num_ranks, n - pos)
        r = ranks_sorted[:k_max]
        l = loads[r]
        q = l + p_all[pos : pos + k_max]
        k = k_max
        if k_max > 1:
            prefmin = np.minimum.accumulate(q)
            # Candidate stops: positions t where some earlier updated rank is not strictly larger.
            for t in (np.flatnonzero(prefmin[:-1] <= l[1:]) + 1).tolist():
                if prefmin[t - 1] < l[t]:
                    k = t
                    break
                # Equal load: sequential LPT prefers the lower rank index among the ties.
                tied = q[:t] == l[t]
                if np.any(r[:t][tied] < r[t]):
                    k = t
                    break
        rank_of[order_items[pos : pos + k]] = r[:k]
        loads[r[:k]] = q[:k]
        pos += k
        # Re-sort by (load, rank). Only the k updated ranks moved; the rest stay sorted.
        ranks_sorted = np.lexsort((np.arange(num_ranks), loads))
    return rank_of


class _Scratch:
    """Per-thread scratch arrays for `_lpt_integer_core`, kept between calls.

    A call at 2560 ranks x 60 samples needs ~1.2 MB of n-sized temporaries. Freed and
    allocated afresh on every call, they come back as new pages from the OS (glibc returns the
    top of the heap), and on the 2-core machine (a VM) each page costs ~3 us in faults: ~1-2 ms
    per call, a third of the algorithm. Buffers are views into per-thread byte arrays that only
    grow; instances above `_SCRATCH_MAX_ITEMS` items use fresh arrays instead.
    """

    _local = threading.local()

    def __init__(self, n: int) -> None:
        self.n = n
        self.keep = n <= _SCRATCH_MAX_ITEMS

    def get(self, name: str, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = self.n * dtype.itemsize
        if not self.keep:
            return np.empty(self.n, dtype=dtype)
        store = self._local.__dict__
        buf = store.get(name)
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 1), dtype=np.uint8)
            store[name] = buf
        return buf[:nbytes].view(dtype)


_SCRATCH_MAX_ITEMS = 1 << 20  # so at most ~16 MB is kept per thread


def _lpt_integer_core(wi: np.ndarray, num_ranks: int,
                      groups: list | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """`_lpt_fast` for integer workloads (token counts, the usual case): the same assignment,
    plus the per-rank loads (exact sums), or None when the values are too large for its keys.

    Ranks are kept as packed keys load << b | rank (b = bits of d - 1), so ordering ranks by
    (load, rank) is a plain value sort and the batch condition of `_lpt_fast`,
    (l_i + p_i, r_i) > (l_t, r_t) for all i < t, is one integer comparison against a prefix
    minimum. A rank's load never exceeds total / d + max (it received its last item while it was
    the least loaded), so keys below ((total // d + 2 max + 1) << b) cannot overflow; int32 keys
    are used when that bound fits, int64 otherwise (int32 halves the cost of the per-batch sort).

    Items are ordered descending by workload, ties by index: by a stable (radix) argsort of
    uint16 (max - w) when max < 2^16, else by a value sort of packed int64 keys
    (max - w) << 32 | index; never by an argsort of floats (~10 ms for 153,600 items on the
    2-core machine). The order array is then reused as the output, and the other n-sized
    arrays are per-thread scratch (`_Scratch`).

    ``groups`` (a list): when every batch was full (every rank took one item per batch, the
    usual case at many items per rank), receives each rank's items, ``(ranks, n / ranks)``
    positions ascending per row: the items grouped by rank without a sort of all n (row ``r``
    holds the item of batch ``t`` at column ``t``, then each row of ``n / ranks`` is sorted).
    """
    n = wi.size
    m = num_ranks
    top = int(wi.max())
    if top >= 2**31 or n >= 2**32:
        return None
    total = int(wi.sum(dtype=np.int64))  # < 2^63: n < 2^32 values < 2^31
    b = max(1, (m - 1).bit_length())
    mask = (1 << b) - 1
    key_bound = (total // m + 2 * top + 1) << b
    if key_bound < 2**31:
        dt = np.int32
    elif key_bound < 2**62:
        dt = np.int64
    else:
        return None
    ws = _Scratch(n)
    ps = ws.get("ps", dt)  # item sizes in LPT order
    if top < 2**16:
        u = ws.get("a16", np.uint16)
        np.subtract(top, wi, out=u, casting="unsafe")  # exact: 0 <= top - w < 2^16
        rank_of = np.argsort(u, kind="stable")  # the LPT order; becomes the output below
        np.subtract(top, np.take(u, rank_of, out=ws.get("b16", np.uint16), mode="clip"), out=ps, dtype=dt)
    else:
        rank_of = np.empty(n, dtype=np.int64)
        np.subtract(top, wi, out=rank_of, casting="unsafe")  # exact: 0 <= top - w < 2^31
        rank_of <<= 32
        rank_of |= np.arange(n, dtype=np.uint32)
        rank_of.sort()
        np.right_shift(rank_of, 32, out=ps, casting="unsafe")  # top - w
        np.subtract(top, ps, out=ps)
        rank_of &= 0xFFFFFFFF  # the LPT order
    np.left_shift(ps, b, out=ps)  # in key units
    # The loop overwrites ps[pos:pos + k], once consumed, with the keys of the ranks those items
    # go to.
    K = np.arange(m, dtype=dt)  # ranks by (load, rank): load 0, rank r -> key r
    q_buf = np.empty(m, dtype=dt)
    pm_buf = np.empty(m, dtype=dt)
    stop_buf = np.empty(m, dtype=bool)
    pos = 0
    full = True  # every batch so far was a full one
    while pos < n:
        k_max = min(m, n - pos)
        Kp = K[:k_max]
        Q = q_buf[:k_max]
        np.add(Kp, ps[pos : pos + k_max], out=Q)
        if k_max == m > 1 and K[m - 1] < Q[: m - 1].min():
            # a full batch (S(t) fails for every t < m: the least of Q[:-1] is above the largest
            # key; the usual case when items far outnumber ranks): every rank takes an item and
            # the new keys are Q itself, sorted, so the buffers swap instead of copying back
            ps[pos : pos + m] = K
            Q.sort(kind="stable")  # timsort: Q is mostly one descending run (see below)
            K, q_buf = Q, K
            pos += m
            continue
        k = k_max
        full = False
        if k_max > 1:
            # Stop at the first t with S(t): min(Q[:t]) <= Kp[t]. S is monotone (prefix minima
            # fall, Kp rises) and false while Kp[t] < g = min(Q[:-1]); let t0 be the first t
            # with Kp[t] >= g. If g sits before t0, S(t0) holds (the usual case); otherwise the
            # prefix minimum is needed from t0 on only.
            i_g = int(Q[:-1].argmin())
            t0 = int(Kp[1:].searchsorted(Q[i_g])) + 1
            if t0 < k_max:
                if i_g < t0:
                    k = t0
                else:
                    pm = np.minimum.accumulate(Q[t0 - 1 : k_max - 1], out=pm_buf[: k_max - t0])
                    if t0 > 1:
                        np.minimum(pm, Q[: t0 - 1].min(), out=pm)
                    stop = np.less_equal(pm, Kp[t0:], out=stop_buf[: k_max - t0])
                    j = int(stop.argmax())
                    if stop[j]:  # S(k_max - 1) holds, so always
                        k = t0 + j
        ps[pos : pos + k] = Kp[:k]
        Kp[:k] = Q[:k]
        K.sort(kind="stable")
        pos += k
    ps &= mask  # rank per item, in LPT order
    if groups is not None and full and m > 1:
        per = n // m  # every batch full: n = per * m, item i of the LPT order in batch i // m
        cell = ps.reshape(per, m).astype(np.int64) * per
        cell += np.arange(per, dtype=np.int64)[:, None]
        grouped = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)
        grouped[cell.reshape(-1)] = rank_of  # still the LPT order: item positions
        grouped = grouped.reshape(m, per)
        grouped.sort(axis=1)
        groups.append(grouped)
    # rank_of[order] = ps, scattered into the smallest integer type that holds a rank (a random
    # scatter over n items is memory-bound; int16 keeps it in cache), then widened in place.
    if m <= 2**15:
        src = ws.get("b16", np.int16)
        np.copyto(src, ps, casting="unsafe")
        rank_small = ws.get("a16", np.int16)
    else:
        src, rank_small = ps, ws.get("a32", np.int32)
    rank_small[rank_of] = src
    rank_of[...] = rank_small
    loads = np.empty(m)
    loads[K & mask] = K >> b
    return rank_of, loads


def _integer_workloads(values: Sequence[float] | np.ndarray) -> np.ndarray | None:
    # A valid 1-D integer ndarray (token counts, the usual input), checked without the float64
    # copy `_check_workloads` makes; None for anything else, which takes the general path.
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype.kind not in "iu":
        return None
    if values.size and values.dtype.kind == "i" and values.min() < 0:
        return None  # `_check_workloads` raises the usual error
    return values


def _lpt_assign(w: np.ndarray, num_ranks: int, groups: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LPT rank per sample and per-rank loads (the packed sums) for validated workloads `w`
    (float64, or a nonnegative integer array from `_integer_workloads`); ``groups``: see
    `_lpt_integer_core` (left empty on the other paths)."""
    # The heap is faster for tiny instances, where batches hold a single item.
    if num_ranks > 2 and w.size > 64:
        if w.dtype.kind in "iu":
            res = _lpt_integer_core(w, num_ranks, groups)
        elif float(w.max()) < 2**31 and np.array_equal(w, np.floor(w)):
            res = _lpt_integer_core(w.astype(np.int64), num_ranks, groups)
        else:
            res = None
        if res is not None:
            return res
        wf = np.asarray(w, dtype=np.float64)
        rank_of = _lpt_fast(wf, num_ranks)
    else:
        wf = np.asarray(w, dtype=np.float64)
        rank_of = _lpt_heap(wf, num_ranks)
    return rank_of, packed_loads(wf, rank_of, num_ranks)


def lpt_balance(
    workloads: Sequence[float] | np.ndarray, num_ranks: int, capacity: float | None = None
) -> Assignment:
    """Algorithm 1, post-balancing without padding (orchmllm.md section 3.4).

    Longest-processing-time-first: samples in descending workload order, each to the rank with
    the smallest total so far (ties: lower sample index first, then lower rank index). The
    makespan is at most (4/3 - 1/(3 d)) times the optimum (Graham; the paper states 4/3).
    `workloads` may be token lengths (the beta << alpha objective) or any additive per-sample
    cost, e.g. `quadratic_sample_costs` (see `quadratic_lpt_balance`).

    `capacity`: optional per-rank limit on the load. Raises InfeasibleBalanceError if it is
    provably unmeetable (a single sample above it, or total > d * capacity), or if LPT's
    result exceeds it (then no fitting assignment was found; LPT is a heuristic).
    """
    num_ranks = _check_num_ranks(num_ranks)
    capacity = _check_capacity(capacity)
    w = _integer_workloads(workloads) if capacity is None else None
    if w is None:
        w = _check_workloads(workloads, "workloads")
    if capacity is not None:
        if w.size and w.max() > capacity:
            raise InfeasibleBalanceError(
                f"sample {int(np.argmax(w))} has workload {w.max()} > capacity {capacity}; "
                "no assignment fits it; raise the capacity or split the sample"
            )
        if w.sum() > num_ranks * capacity:
            raise InfeasibleBalanceError(
                f"total workload {w.sum()} exceeds num_ranks * capacity = {num_ranks * capacity}; "
                "use more ranks, a larger capacity or a smaller batch"
            )
    rank_of, loads = _lpt_assign(w, num_ranks)
    result = Assignment(rank_of, loads)
    if capacity is not None and result.max_load > capacity:
        raise InfeasibleBalanceError(
            f"LPT reached max load {result.max_load} > capacity {capacity}; a fitting assignment may "
            "not exist (lower bound: max(max workload, total / num_ranks)); raise the capacity"
        )
    return result


QUANT_LEVELS = 2**16 - 1  # the integer core's radix path sorts uint16 keys


def quantised_lpt(costs: Sequence[float] | np.ndarray, num_ranks: int, levels: int = QUANT_LEVELS) -> Assignment:
    """LPT on float per-sample costs through the integer core: each cost becomes
    ``q = round(c / u)`` with unit ``u = max(c) / levels``, so ``|q u - c| <= u / 2``.

    Bound (Graham's, carried through the rounding): with ``k`` the largest sample count of a
    bin in this result or in an optimal one, the true makespan is at most
    ``(4/3 - 1/(3d)) (OPT + k u / 2) + k u / 2``. At 2560 bins of 60 samples and the default
    levels, ``k u / 2`` is below 0.05 % of the largest sample's cost. Loads are the true float
    sums. Zero costs stay zero (text-only samples in an encoder phase)."""
    return _quantised_lpt(costs, num_ranks, levels)


def _quantised_lpt(costs: Sequence[float] | np.ndarray, num_ranks: int, levels: int = QUANT_LEVELS,
                   groups: list | None = None) -> Assignment:
    """`quantised_lpt`, with each rank's items put in ``groups`` where the integer core can give
    them (`_lpt_integer_core`)."""
    num_ranks = _check_num_ranks(num_ranks)
    c = np.asarray(costs, dtype=np.float64)
    # two reductions validate the usual input (NaN and infinities show in the max or min);
    # `_check_workloads`, with its message, only when they fail
    top = float(c.max()) if c.ndim == 1 and c.size else 0.0
    if c.ndim != 1 or (c.size and not (math.isfinite(top) and c.min() >= 0)):
        c = _check_workloads(costs, "costs")
    # uint16 keys when they fit (the default levels): the integer core reads them without a wider copy
    dtype = np.uint16 if levels < 2**16 else np.int64
    if top <= 0.0:
        q = np.zeros(c.size, dtype=dtype)
    else:
        scaled = np.multiply(c, levels / top)
        q = np.rint(scaled, out=scaled).astype(dtype)
    rank_of, _ = _lpt_assign(q, num_ranks, groups)
    return Assignment(rank_of, packed_loads(c, rank_of, num_ranks))
