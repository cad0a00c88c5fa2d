"""The ``disttrain`` policy: one layout for every phase (``disttrain.md`` §3.3-3.5), on arrays.

1. Algorithm 2 (§3.3): the global batch's samples over the LLM's data-parallel groups, LPT on
   each sample's summed cost (every module's forward FLOPs, a generator's included), through the quantised integer LPT
   core (`quantised_lpt`: Graham's bound up to half a quantum per sample, see its docstring).
2. Inside each group, LPT of its samples into the group's ``k`` microbatches: all groups in
   lockstep, one step per sample rank, a ``(groups, k)`` load matrix and one argmin per step;
   the same float operations as `balance_dp_groups` on each group, so the same microbatches.
3. Algorithm 3 (§3.4) on every group at once (`reorder_microbatches_batched`, bit-identical to
   `reorder_microbatches` per group), a microbatch's size its encoder plus generator time.

A right-padded LLM (loom's default, ``llm_batching = "padded"``) runs a microbatch as ``count``
rows of its longest sample, so its LLM cost is ``count * max`` of the samples' padded row costs,
not their sum. LPT on summed cost spreads long samples over the microbatches, one each, and then
every microbatch pays for a long row. With a padded LLM each group therefore gets a second
candidate, its samples sorted by padded row cost and cut into ``k`` contiguous runs (similar
lengths together, the least padding for equal counts), and keeps whichever of the two has the
shorter 1F1B iteration time (Appendix A's chain, LLM stages costed padded) after Algorithm 3.
"""

from __future__ import annotations

import numpy as np

from loom.balance.costs import SampleCosts
from loom.balance.disttrain import balance_dp_groups, reorder_microbatches_batched
from loom.balance.lpt import quantised_lpt
from loom.plan.plan import LLM, Plan
from loom.schedule.layout import BatchLayout


def disttrain_layout(plan: Plan, costs: SampleCosts, llm_padded: bool = True) -> BatchLayout:
    """DistTrain: groups over the LLM's replicas, LPT microbatches, Algorithm 3 order. Slot
    ``j`` is microbatch ``j // dp`` (in Algorithm 3's order) of group ``j % dp``. The plan has
    passed `check_balance_config` (`make_layout` runs it first): equal data-parallel degrees,
    microbatches a multiple of them, a sample per microbatch."""
    n, m = costs.num_samples, plan.num_microbatches
    dp = plan.spec(LLM).data_parallel
    k = m // dp
    # every costed module: a generator's work counts although it follows the LLM's slots (make_layout)
    total = sum(costs.work.values())
    group_of = quantised_lpt(total, dp).rank_of_sample if dp > 1 else np.zeros(n, dtype=np.int64)
    sizes = np.bincount(group_of, minlength=dp)
    if sizes.min() < k:
        # a group with fewer samples than its microbatches (it drew the heavy ones): Algorithm 2
        # with equal counts (disttrain.md §3.3, defect 2) when they divide, else the lightest
        # samples of the fullest groups move over; n >= dp * k, so both succeed
        listed = total.tolist()
        groups = (balance_dp_groups(listed, dp, equal_counts=True) if n % dp == 0
                  else _fill_counts([np.flatnonzero(group_of == g).tolist() for g in range(dp)], k, listed))
        group_of = np.empty(n, dtype=np.int64)
        for g, members in enumerate(groups):
            group_of[members] = g
        sizes = np.bincount(group_of, minlength=dp)
    # members of each group, heaviest first (ties: lower position), as a (dp, width) matrix
    # padded with -1
    by_group = _by_group(group_of, sizes)
    members = _members_descending(by_group, total, sizes)
    mb_of = _lockstep_lpt(members, total, k)
    mb_of = _nonempty(mb_of, group_of, total, k)
    candidates = [mb_of]
    if llm_padded:
        candidates.append(sorted_runs(_members_descending(by_group, costs.llm_padded_weight(), sizes), sizes, k))
    # a microbatch's size: its encoder plus generator time (disttrain.md §3.4)
    enc_total = sum((w for p, w in costs.work.items() if p != LLM), np.zeros(n))
    p_llm = plan.spec(LLM).num_stages
    enc, llm = [], []
    weight = costs.llm_padded_weight() if llm_padded else None
    for cand in candidates:
        mb = group_of * k + cand  # global microbatch id, group-major
        enc.append(np.bincount(mb, weights=enc_total, minlength=dp * k).reshape(dp, k))
        if llm_padded:
            llm.append((np.bincount(mb, minlength=dp * k) * _peak(mb, weight, dp * k)).reshape(dp, k) / p_llm)
        else:
            llm.append(np.bincount(mb, weights=costs.work[LLM], minlength=dp * k).reshape(dp, k) / p_llm)
    # every candidate of every group in one lockstep run
    orders, times = reorder_microbatches_batched(np.concatenate(enc), np.concatenate(llm), 1 + p_llm)
    orders = orders.reshape(len(candidates), dp, k)
    times = times.reshape(len(candidates), dp)
    pick = np.zeros(dp, dtype=np.int64)
    for c in range(1, len(candidates)):
        pick[times[c] < times[pick, np.arange(dp)]] = c  # ties keep the LPT candidate
    chosen = np.choose(pick[group_of], candidates)
    order_g = orders[pick, np.arange(dp)]
    # position of each microbatch in its group's order; slot = position * dp + group
    position = np.empty_like(order_g)
    np.put_along_axis(position, order_g, np.arange(k)[None, :].repeat(dp, axis=0), axis=1)
    slot = position[group_of, chosen] * dp + group_of
    return _shared_layout(slot, m, plan.module_names, "disttrain")


def _shared_layout(slot: np.ndarray, m: int, phases: list[str], policy: str) -> BatchLayout:
    """`BatchLayout.from_slot_index` for phases that share one slot array: the sort is done
    once (positions ascending inside a slot)."""
    small = slot.astype(np.int16) if m < 2**15 else slot
    order = np.argsort(small, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(slot, minlength=m))))
    return BatchLayout(None, {p: policy for p in phases}, arrays={p: (order, bounds) for p in phases})


def _by_group(group: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions ordered by group, then position (a stable sort of 16-bit keys is a radix
    sort), with each one's group and its rank inside the group."""
    small = np.int16 if sizes.size < 2**15 else np.int64
    order = np.argsort(group.astype(small), kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return order, group[order], np.arange(group.size) - np.repeat(starts, sizes)


def _members_descending(by_group: tuple[np.ndarray, np.ndarray, np.ndarray], value: np.ndarray,
                        sizes: np.ndarray) -> np.ndarray:
    """Each group's positions by value descending, then position, as a ``(groups, width)``
    matrix padded with -1: one stable sort per row (a group's positions enter it ascending, and
    padding sorts last), cheaper than sorting the whole batch by value."""
    order, group, rank = by_group
    width = int(sizes.max(initial=0))
    key = np.full((sizes.size, width), np.inf)
    key[group, rank] = -value[order]
    members = np.full((sizes.size, width), -1, dtype=np.int64)
    members[group, rank] = order
    return np.take_along_axis(members, np.argsort(key, axis=1, kind="stable"), axis=1)


def _peak(slot: np.ndarray, value: np.ndarray, slots: int) -> np.ndarray:
    """Largest value per slot (0 for an empty one), by one sort and a segmented maximum."""
    order = np.argsort(slot.astype(np.int16) if slots < 2**15 else slot, kind="stable")
    counts = np.bincount(slot, minlength=slots)
    peak = np.zeros(slots)
    full = counts > 0
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    peak[full] = np.maximum.reduceat(value[order], starts[full])
    return peak


def _lockstep_lpt(members: np.ndarray, cost: np.ndarray, k: int) -> np.ndarray:
    """LPT of every group's members (rows of ``members``, heaviest first, -1 padding) into
    ``k`` microbatches, all groups in lockstep: step ``t`` places every group's ``t``-th
    sample on its least-loaded microbatch (ties: lowest index), adding its cost to that load,
    which is `balance_dp_groups`' loop float operation for float operation. Padding adds a
    zero cost, which changes no load. Returns each sample's microbatch within its group."""
    groups, width = members.shape
    loads = np.zeros((groups, k))
    w = np.where(members >= 0, cost[np.maximum(members, 0)], 0.0)
    by_step = np.ascontiguousarray(w.T)  # (width, groups): step t's costs, contiguous
    chosen = np.empty((width, groups), dtype=np.int64)
    start = 0
    if width >= k and np.all(w[:, :k - 1] > 0):
        # while a microbatch is empty the least-loaded one is the first empty one: with positive
        # costs the first k samples go to microbatches 0..k-1 in turn (the loop's own choices)
        chosen[:k] = np.arange(k)[:, None]
        loads[:] = w[:, :k]
        start = k
    flat, at = loads.ravel(), np.arange(groups) * k  # group g's microbatch b is flat[g * k + b]
    for t in range(start, width):
        b = loads.argmin(axis=1)
        chosen[t] = b
        flat[b + at] += by_step[t]
    out = np.empty(cost.size, dtype=np.int64)
    real = members >= 0
    out[members[real]] = chosen.T[real]
    return out


def _nonempty(mb_of: np.ndarray, group_of: np.ndarray, cost: np.ndarray, k: int) -> np.ndarray:
    """Move the cheapest sample (ties: lowest position) of a group's fullest microbatch (ties:
    lowest index) into each empty one of that group (zero-cost samples can share a microbatch
    under LPT). Keeps every sample; a no-op in the usual case."""
    groups = int(group_of.max()) + 1 if group_of.size else 0
    counts = np.bincount(group_of * k + mb_of, minlength=groups * k).reshape(groups, k)
    if counts.min() > 0:
        return mb_of
    mb_of = mb_of.copy()
    for g, b in zip(*np.nonzero(counts == 0)):
        donor = int(np.argmax(counts[g]))
        inside = np.flatnonzero((group_of == g) & (mb_of == donor))
        s = int(inside[np.lexsort((inside, cost[inside]))[0]])
        mb_of[s] = b
        counts[g, donor] -= 1
        counts[g, b] += 1
    return mb_of


def sorted_runs(members: np.ndarray, sizes: np.ndarray, k: int) -> np.ndarray:
    """Each group's samples by padded row cost, longest first (``members``, ties: lower
    position), cut into ``k`` contiguous runs of equal count (the larger runs first): similar
    lengths share a microbatch, so right-padding adds the least. Returns each position's run.
    Entrain's padded candidate (`loom.balance.entrain_policy`) cuts its replicas alike."""
    rank = np.arange(members.shape[1])[None, :]
    base, extra = (sizes // k)[:, None], (sizes % k)[:, None]
    # runs 0..extra-1 hold base + 1 samples, the rest base
    big = extra * (base + 1)
    run = np.where(rank < big, rank // np.maximum(base + 1, 1), extra + (rank - big) // np.maximum(base, 1))
    real = members >= 0
    out = np.empty(int(sizes.sum()), dtype=np.int64)
    out[members[real]] = run[real]
    return out


def _fill_counts(groups: list[list[int]], k: int, cost: list[float]) -> list[list[int]]:
    """Every group at least ``k`` samples: the cheapest sample of the fullest group moves to a
    short one until none is short (deterministic; keeps every sample)."""
    groups = [list(g) for g in groups]
    for g in groups:
        while len(g) < k:
            donor = max(groups, key=len)
            s = min(donor, key=lambda x: (cost[x], x))
            donor.remove(s)
            g.append(s)
    return [sorted(g) for g in groups]
