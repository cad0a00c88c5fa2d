"""The ``entrain`` policy: Algorithm 4 of ``entrain.md`` (§3.4-3.5) for every replica at once.

`loom.balance.entrain` holds the algorithm one replica at a time, in plain Python, with its
exact oracles. A step of 64 replicas x 32 microbatches of 16 samples needs it in tens of
milliseconds, so this module runs the same steps on arrays, all replicas in lockstep:

1. DP-level assignment (§3.4): samples by encoder work, heaviest first, in *rounds* of one
   sample per replica; inside a round the heaviest LLM sample goes to the replica with the
   least LLM work so far. This realises the capacity cap (§7.6: ``B / DP`` samples each) by
   construction, spreads the heaviest encoder samples one per replica, and keeps the replicas'
   LLM loads within one sample of each other (max - min <= the largest LLM cost: a sorted
   pairing never widens a spread that is within it). `entrain.dp_assignment`'s sequential
   greedy is a loop over samples that cannot run in lockstep.
2. ``K_eff`` (§3.5.1) per replica; every replica runs the smallest (the schedule's microbatches
   are round-robin over replicas).
3. Stratified assignment (§3.5.1): `entrain.stratified_assignment`'s list (one fine seed per
   microbatch, then the coarse set, then the rest of the fine set, each by encoder work
   descending), taken in rounds of ``K``: in each, the heaviest sample goes to the least-loaded
   microbatch, the next heaviest to the next, over a ``(replicas, K)`` load matrix. The spread
   of the loads then never exceeds the largest sample (a sorted pairing never widens a spread
   within it), so the makespan is at most ``sum / K + (1 - 1/K) max``, the very bound
   Graham's theorem gives the paper's min-load greedy (``<= (2 - 1/K) OPT``); the tests check
   it. Samples without encoder work after the seeds go where the LLM work is least.
4. Pairwise deferral (§3.5.2): every overloaded microbatch's subset-sum table at once, as
   packed 64-bit words (``SUBSET_SUM_RESOLUTION_POLICY`` units per microbatch), every pair's
   closest reachable sum by table look-up, eq. 4.3's ``V`` from it, and the bottleneck matching
   by a binary search in lockstep whose feasibility test is one Hopcroft-Karp matching over all
   replicas' graphs (block diagonal, `scipy.sparse.csgraph.maximum_bipartite_matching`). ``T*``
   is exact for the ``V`` it is given; ``V`` is exact up to half a unit per item (the reference's
   bound, at this module's unit), and the realised loads use the samples' true costs.
5. Eager forward (§3.6): the encoders' extra warmup, as deep as the 1F1B prediction finds
   faster, up to ``balance.entrain_eager_max`` microbatches (the paper's memory bound), carried
   by the layout (``eager_forward``) to `build_schedule`.

With a right-padded LLM (loom's default) an LLM microbatch costs its row count times its
longest row, not the sum: a deferral is kept only where it lowers the pair's padded cost. The
stratified microbatches of step 3 spread the heavy encoder samples, and with them the long LLM
rows, one per microbatch, so every microbatch pays for a long row (entrain.md assumes packed
sequences). A padded LLM therefore gets a second candidate, as DistTrain's policy does (a loom
extension): each replica's samples by padded row cost cut into ``K`` contiguous runs
(`disttrain_policy.sorted_runs`). Of the two microbatchings, the one the 1F1B prediction
(`loom.balance.predict`, each in microbatch order before deferral) finds faster then gets the
deferral and the interleaved order.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from loom.balance.costs import SampleCosts
from loom.balance.disttrain_policy import sorted_runs
from loom.balance.predict import predict_steps
from loom.plan.plan import LLM, Plan
from loom.schedule.layout import BatchLayout, LayoutError

# Units per overloaded microbatch of the policy's subset-sum tables (the reference uses 4096).
# At 512 a microbatch of 16 samples is matched to within 16 / 1024 of its LLM load in the worst
# case and typically 0.1 %, well inside the cost model's own error, and the tables of 64
# replicas x 16 microbatches are 9 words each.
SUBSET_SUM_RESOLUTION_POLICY = 512


def entrain_layout(plan: Plan, costs: SampleCosts, llm_padded: bool = True, eager: int = 0,
                   eager_max: int = 0) -> BatchLayout:
    """Entrain: replica assignment, K_eff, stratified microbatches (or, for a right-padded LLM,
    microbatches of similar row cost where the 1F1B prediction finds them faster), deferral,
    interleaving, eager forward. Slot ``j`` is position ``j // dp`` of replica ``j % dp``'s
    interleaved order. The plan has passed `check_balance_config` (`make_layout` runs it first):
    equal data-parallel degrees, microbatches and samples multiples of them (entrain.md §3.4,
    B/DP samples each).

    Eager forward (§3.6): the layout's ``eager_forward`` is the encoders' extra warmup, from
    ``eager`` (``balance.eager_forward``) up to ``eager + eager_max``, the shallowest of the
    depths the 1F1B prediction finds fastest. The paper forwards "as many as memory constraints
    allow"; ``eager_max`` is that bound, and depths that gain nothing are not taken."""
    dp = plan.spec(LLM).data_parallel
    m = plan.num_microbatches
    n = costs.num_samples
    enc = sum((costs.work[e] for e in plan.encoder_names), np.zeros(n))
    llm = costs.work[LLM]
    members = replicas_by_rounds(enc, llm, dp)  # (dp, n / dp) positions, ascending per row
    e, w = enc[members], llm[members]
    k = effective_count(e, m // dp)
    mb = stratified(e, w, k)  # (dp, per): microbatch of each member
    row_cost = None
    if llm_padded:
        row_cost = costs.llm_padded_weight()[members]
        by_cost = np.take_along_axis(members, np.argsort(-row_cost, axis=1, kind="stable"), axis=1)
        runs = sorted_runs(by_cost, np.full(dp, members.shape[1]), k)[members]
        # the microbatching is chosen before the deferral (the costly step, run once): each in
        # microbatch order without deferral, by the 1F1B prediction; ties keep the paper's
        order, no_defer = np.broadcast_to(np.arange(k), (dp, k)), np.zeros_like(mb)
        paper, padded = predict_steps([_entrain_layout(plan, members, c, order, no_defer, k) for c in (mb, runs)],
                                      plan, costs, llm_padded)
        if padded.step < paper.step:
            mb = runs
    position, defer = pairwise_deferral(mb, w, k, row_cost)
    layout = _entrain_layout(plan, members, mb, position, defer, k)
    layout.eager_forward = eager
    if eager_max and plan.encoder_names:
        steps = [predict_steps([layout], plan, costs, llm_padded, eager=e)[0].step
                 for e in range(eager, eager + eager_max + 1)]
        layout.eager_forward = eager + int(np.argmin(steps))  # the first of equal minima: the shallowest
    return layout


def _entrain_layout(plan: Plan, members: np.ndarray, mb: np.ndarray, position: np.ndarray, defer: np.ndarray,
                    k: int) -> BatchLayout:
    """The layout of microbatches ``mb`` (``(dp, per)``, of ``members``) in the order
    ``position`` (``position[r, b]``: microbatch ``b``'s place in replica ``r``'s order) with the
    deferrals ``defer`` (`pairwise_deferral`'s)."""
    dp, n = members.shape[0], members.size
    enc_slot = position[np.arange(dp)[:, None], mb] * dp + np.arange(dp)[:, None]
    llm_slot = enc_slot + defer * dp  # a deferred sample's LLM work runs one position later
    llm_slot = _keep_llm_nonempty(enc_slot, llm_slot, k * dp, dp)
    arrays = {}
    for phase, slots in ((LLM, llm_slot), ("encoders", enc_slot)):
        slot = np.empty(n, dtype=np.int64)
        slot[members] = slots
        order = np.argsort(slot.astype(np.int16) if k * dp < 2**15 else slot, kind="stable")
        arrays[phase] = (order, np.concatenate(([0], np.cumsum(np.bincount(slot, minlength=k * dp)))))
    # every encoder holds the same slots (the "unified encoder" of entrain.md §2.3)
    return BatchLayout(None, {p: "entrain" for p in plan.module_names},
                       arrays={p: arrays[LLM if p == LLM else "encoders"] for p in plan.module_names})


# ---- 1. DP-level assignment (§3.4) -----------------------------------------------------------
def replicas_by_rounds(enc: np.ndarray, llm: np.ndarray, dp: int) -> np.ndarray:
    """Samples (positions) of each replica, a ``(dp, n / dp)`` matrix, ascending per row.

    Samples by encoder work descending (ties: lower position) form rounds of ``dp``; in each
    round the samples by LLM work descending (ties: earlier in the round) go to the replicas by
    LLM load so far ascending (ties: the order they had, lower replica first at the start)."""
    n = enc.size
    order = np.argsort(-enc, kind="stable").reshape(-1, dp)
    within = np.argsort(-llm[order], axis=1, kind="stable")
    rounds = np.take_along_axis(order, within, axis=1)
    work = llm[rounds]
    # the replicas kept sorted by load, as each round's state (loads, then replica ids as exact
    # floats): a round adds its samples, heaviest first, to the replicas lightest first, then
    # re-sorts (stable: equal loads keep their order, replica order at the start) straight into
    # the next round's state, three NumPy calls a round
    track = np.empty((rounds.shape[0] + 1, 2, dp))
    track[0, 0] = 0.0
    track[0, 1] = np.arange(dp)
    for state, after, round_work in zip(track[:-1], track[1:], work):
        load = state[0]
        load += round_work
        state.take(load.argsort(kind="stable"), axis=1, out=after)
    replica = track[:-1, 1].astype(np.int64)
    rep = np.empty(n, dtype=np.int64)
    rep[rounds.ravel()] = replica.ravel()
    small = np.int16 if dp < 2**15 else np.int64  # a stable sort of 16-bit keys is a radix sort
    return np.argsort(rep.astype(small), kind="stable").reshape(dp, -1)


# ---- 2-3. K_eff and stratified assignment (§3.5.1) -------------------------------------------
def effective_count(enc: np.ndarray, k: int) -> int:
    """The smallest replica's ``K_eff = min(K, floor(sum / max))`` (`entrain.effective_microbatches`
    per row of ``enc``, whose slack against rounding it keeps)."""
    peak = enc.max(axis=1)
    total = enc.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(peak > 0, np.floor(total / np.where(peak > 0, peak, 1.0) * (1 + 1e-12)), enc.shape[1])
    return max(1, min(k, int(cap.min())))


def stratified(enc: np.ndarray, llm: np.ndarray, k: int, fine_fraction: float = 0.5) -> np.ndarray:
    """Microbatch of every member (``(replicas, per)`` in, same shape out) by
    `entrain.stratified_assignment`'s list, all replicas in lockstep."""
    rows, per = enc.shape
    r = np.arange(rows)[:, None]
    # the fine set: the fine_fraction of members with the least LLM work, at least k of them
    # (ties go to the lower member)
    n_fine = min(per, max(k, math.ceil(fine_fraction * per)))
    if n_fine < per:
        # below the n_fine-th smallest LLM work, then the first members at it (no full sort)
        cut = np.partition(llm, n_fine - 1, axis=1)[:, n_fine - 1:n_fine]
        fine = llm < cut
        at_cut = llm == cut
        fine |= at_cut & (np.cumsum(at_cut, axis=1) <= n_fine - fine.sum(axis=1, keepdims=True))
    else:
        fine = np.ones((rows, per), dtype=bool)
    # list order: k fine seeds (largest encoder work), the coarse set, the rest of the fine set,
    # each by encoder work descending (ties: lower member); rows are read through flat indices
    # (``+ at``), one gather per step for every replica
    at = (np.arange(rows) * per)[:, None]
    by_enc = np.argsort(-enc, axis=1, kind="stable")
    fine_by_enc = fine.ravel()[by_enc + at]
    seed = fine_by_enc & (np.cumsum(fine_by_enc, axis=1) <= k)  # the first k fine members
    group = np.where(seed, 0, np.where(fine_by_enc, 2, 1)).astype(np.int8)
    listed = by_enc.ravel()[np.argsort(group, axis=1, kind="stable") + at]  # by group, then encoder work
    w = np.ascontiguousarray(enc).ravel()[listed + at]
    aside = (w == 0) & (np.arange(per) >= k)  # no encoder work: placed by LLM work below
    w = np.where(aside, 0.0, w)
    # the list in rounds of k: the first is the seeds, one per microbatch; in every later round
    # the heaviest sample goes to the least-loaded microbatch, the next to the next (ties:
    # lower index), so no microbatch takes two samples of a round
    chosen = np.empty((rows, per), dtype=np.int64)
    chosen[:, :k] = np.arange(k)
    loads = w[:, :k].copy()
    at_k = (np.arange(rows) * k)[:, None]
    flat_w, flat_chosen, flat_loads = w.ravel(), chosen.ravel(), loads.ravel()
    lanes = np.arange(rows)
    for t in range(k, per, k):
        width = min(k, per - t)
        heavy = np.argsort(-w[:, t:t + width], axis=1, kind="stable") + (at + t)  # a round mixes the list's segments
        light = np.argsort(loads, axis=1, kind="stable")[:, :width]
        flat_chosen[heavy] = light
        flat_loads[light + at_k] += flat_w[heavy]
    mb = np.empty((rows, per), dtype=np.int64)
    mb.ravel()[listed + at] = chosen
    if aside.any():
        # text-only samples, heaviest LLM first, where the LLM work is least (ties: lowest
        # index): they change no encoder load, and deferral starts from balanced LLM loads
        is_aside = np.zeros((rows, per), dtype=bool)
        np.put_along_axis(is_aside, listed, aside, axis=1)
        llm_load = np.zeros((rows, k))
        np.add.at(llm_load, (np.broadcast_to(r, (rows, per))[~is_aside], mb[~is_aside]), llm[~is_aside])
        queue = np.argsort(np.where(is_aside, -llm, np.inf), axis=1, kind="stable")
        for t in range(int(is_aside.sum(axis=1).max())):
            s = queue[:, t]
            live = is_aside[lanes, s]
            b = llm_load.argmin(axis=1)
            mb[lanes[live], s[live]] = b[live]
            llm_load[lanes[live], b[live]] += llm[lanes[live], s[live]]
    return mb


# ---- 4. pairwise deferral (§3.5.2) -----------------------------------------------------------
def pairwise_deferral(mb: np.ndarray, llm: np.ndarray, k: int,
                      row_cost: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Interleaved order and deferrals of every replica. ``mb[r, i]``: microbatch of member
    ``i`` of replica ``r``; ``llm``: its LLM cost; ``row_cost`` (padded LLM): its padded row
    cost. Returns ``(position, defer)``: ``position[r, b]`` is microbatch ``b``'s place in
    replica ``r``'s order, ``defer[r, i]`` is 1 where member ``i``'s LLM work runs one
    position later (in its partner's microbatch)."""
    rows, per = mb.shape
    lanes = np.arange(rows)
    defer = np.zeros((rows, per), dtype=np.int64)
    flat = lanes[:, None] * k + mb
    loads = np.bincount(flat.ravel(), weights=llm.ravel(), minlength=rows * k).reshape(rows, k)
    by_load = np.argsort(-loads, axis=1, kind="stable")
    half = k // 2
    ol, ul = by_load[:, :half], by_load[:, half:]
    position = np.empty((rows, k), dtype=np.int64)
    if half == 0:  # one microbatch: nothing to pair
        position[:] = 0
        return position, defer
    # members of each microbatch as a (rows * k, width) matrix, -1 padded
    order = np.argsort(flat.ravel().astype(np.int16 if rows * k < 2**15 else np.int64), kind="stable")
    counts = np.bincount(flat.ravel(), minlength=rows * k)
    width = int(counts.max())
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.arange(order.size) - np.repeat(starts, counts)
    slot_members = np.full((rows * k, width), -1, dtype=np.int64)
    slot_members[flat.ravel()[order], rank] = order % per
    tables = (lanes[:, None] * k + ol).ravel()  # one table per overloaded microbatch
    items = slot_members[tables]  # (T, width) member index, -1 padded
    weights = np.where(items >= 0, llm[np.repeat(lanes, half)[:, None], np.maximum(items, 0)], 0.0)
    table = _SubsetSums(weights)
    l_ol = np.take_along_axis(loads, ol, axis=1)  # (rows, half)
    l_ul = np.take_along_axis(loads, ul, axis=1)  # (rows, n_ul)
    delta = (l_ol[:, :, None] - l_ul[:, None, :]) / 2  # (rows, half, n_ul)
    moved = table.closest(np.repeat(np.arange(tables.size), ul.shape[1]), delta.ravel()).reshape(delta.shape)
    v = np.maximum(l_ol[:, :, None] - moved, l_ul[:, None, :] + moved)  # eq. 4.3
    partner, critical = _bottleneck_matching(v, l_ol, l_ul)
    # interleaved order (ol_0, partner_0, ol_1, partner_1, ..., unpaired)
    paired = np.zeros((rows, ul.shape[1]), dtype=bool)
    paired[lanes[:, None], partner] = True
    unpaired = np.where(paired, np.inf, l_ul)
    rest = np.argsort(unpaired, axis=1, kind="stable")
    n_rest = ul.shape[1] - half
    sequence = np.empty((rows, k), dtype=np.int64)
    sequence[:, 0:2 * half:2] = ol
    sequence[:, 1:2 * half:2] = np.take_along_axis(ul, partner, axis=1)
    if n_rest:
        sequence[:, 2 * half:] = np.take_along_axis(ul, rest[:, :n_rest], axis=1)
    np.put_along_axis(position, sequence, np.broadcast_to(np.arange(k), (rows, k)), axis=1)
    # the deferral sets of the critical pairs, read back from the tables at their partner's target
    t_idx = np.flatnonzero(critical.ravel())
    if t_idx.size:
        r_idx, a_idx = np.divmod(t_idx, half)
        target = delta[r_idx, a_idx, partner[r_idx, a_idx]]
        take = table.subset(t_idx, target)  # (len, width) bool over each table's items
        if row_cost is not None:
            take &= _lowers_padded_cost(take, items[t_idx], slot_members, r_idx,
                                        (r_idx * k + ul[r_idx, partner[r_idx, a_idx]]), row_cost)[:, None]
        rr, cc = np.nonzero(take)
        defer[r_idx[rr], items[t_idx][rr, cc]] = 1
    return position, defer


def _lowers_padded_cost(take: np.ndarray, src_items: np.ndarray, slot_members: np.ndarray, r_idx: np.ndarray,
                        dst: np.ndarray, row_cost: np.ndarray) -> np.ndarray:
    """Whether moving ``take`` from each overloaded microbatch to its partner lowers the pair's
    padded cost ``max(count x longest row)`` (a right-padded LLM pays for its longest row)."""
    src_cost = np.where(src_items >= 0, row_cost[r_idx[:, None], np.maximum(src_items, 0)], 0.0)
    dst_items = slot_members[dst]
    dst_cost = np.where(dst_items >= 0, row_cost[r_idx[:, None], np.maximum(dst_items, 0)], 0.0)
    n_src, n_dst = (src_items >= 0).sum(axis=1), (dst_items >= 0).sum(axis=1)
    n_take = take.sum(axis=1)
    before = np.maximum(n_src * src_cost.max(axis=1), n_dst * dst_cost.max(axis=1))
    stay = np.where(take, 0.0, src_cost).max(axis=1)
    arrive = np.maximum(dst_cost.max(axis=1), np.where(take, src_cost, 0.0).max(axis=1))
    after = np.maximum((n_src - n_take) * stay, (n_dst + n_take) * arrive)
    return after < before


class _SubsetSums:
    """Reachable discretised subset sums of many item lists at once (§3.5.2 step 1), as packed
    64-bit words: bit ``u`` of row ``t`` is set when some subset of row ``t``'s items sums to
    ``u`` units. One row per overloaded microbatch; the prefixes (after each item) are kept to
    read a subset back, as `entrain._SubsetSumTable` does per table."""

    def __init__(self, weights: np.ndarray):
        total = weights.sum(axis=1)
        res = SUBSET_SUM_RESOLUTION_POLICY
        integral = np.all(weights == np.floor(weights), axis=1) & (total <= res)
        self.quantum = np.where(integral, 1.0, total / res)
        with np.errstate(divide="ignore", invalid="ignore"):
            units = np.where(self.quantum[:, None] > 0, np.rint(weights / self.quantum[:, None]), 0)
        self.units = units.astype(np.int64)
        self.weights = weights
        t = weights.shape[0]
        self.words = int(self.units.sum(axis=1).max(initial=0)) // 64 + 1
        # table c (the reachable sums of the first c items, the prefixes `subset` reads back) is
        # rows x words, the tables back to back in one flat array ending in a zero word: shifting
        # a row by u units reads words i - u // 64 and the one below, or the zero word below the
        # row's start; every step is a contiguous 1-D op on one table's words (small arrays)
        w, items = self.words, self.units.shape[1]
        size = t * w
        store = np.zeros((items + 1) * size + 1, dtype=np.uint64)
        store[np.arange(t) * w] = 1  # table 0: the empty subset
        zero = store.size - 1
        word_in_row = np.tile(np.arange(w), t)
        row_start = np.repeat(np.arange(t) * w, w)
        one, top_bit = np.uint64(1), np.uint64(63)
        for c in range(items):
            u = self.units[:, c]
            word = word_in_row - np.repeat(u >> 6, w)
            at = row_start + word + c * size
            bit = np.repeat((u & 63).astype(np.uint64), w)
            low = store.take(np.where(word >= 1, at - 1, zero))
            shifted = (store.take(np.where(word >= 0, at, zero)) << bit) | ((low >> one) >> (top_bit - bit))
            np.bitwise_or(store[c * size:(c + 1) * size], shifted, out=store[(c + 1) * size:(c + 2) * size])
        self.prefix = store[:-1].reshape(items + 1, t, w)
        self.reach = self.prefix[-1]
        # per row and word, the last nonzero word at or before it and the first at or after it
        # (-1, words: none), so a query finds the nearest reachable sums with no scan
        index = np.arange(w)
        nonzero = self.reach != 0
        self.last_word = np.maximum.accumulate(np.where(nonzero, index, -1), axis=1)
        self.next_word = np.minimum.accumulate(np.where(nonzero, index, w)[:, ::-1], axis=1)[:, ::-1]
        last = self.last_word[:, -1]  # bit 0, the empty subset, is reachable in every row
        self.top = last * 64 + _highest_bit(self.reach[np.arange(t), last])

    def _units(self, rows: np.ndarray, target: np.ndarray) -> np.ndarray:
        """Units of the reachable sum closest to ``target`` (ties: the smaller), per query: the
        highest set bit at or below ``t = floor(target / quantum)`` and the lowest above it, each
        in ``t``'s word or else in the nearest nonzero word on its side."""
        q = self.quantum[rows]
        ok = (target > 0) & (q > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(ok, np.floor(target / np.where(q > 0, q, 1.0)), 0)
        top = self.top[rows]
        t = np.minimum(t, top).astype(np.int64)
        word_at, bit = t >> 6, (t & 63).astype(np.uint64)
        # the (rows, words) tables read through flat indices: row * words + word
        reach, words, first = self.reach.ravel(), self.words, rows * self.words
        at = first + word_at
        word = reach.take(at)
        upto = (np.uint64(2) << bit) - np.uint64(1)  # bits 0..bit (all 64 at bit 63: the shift wraps to 0)
        below = word & upto
        in_word = below != 0
        # t's word holds bit 0 in word 0, so a row without a set bit up to t has an earlier word
        before = np.where(in_word, at, first + self.last_word.ravel().take(np.maximum(at - 1, first)))
        lo = (before - first) * 64 + _highest_bit(np.where(in_word, below, reach.take(before)))
        # t < top, so the smallest reachable sum above t is in the row
        has_hi = t < top
        above = word & ~upto
        in_word = above != 0
        after = np.where(in_word, at, first + np.minimum(self.next_word.ravel().take(np.minimum(at + 1, first + words - 1)),
                                                         words - 1))
        hi = np.where(has_hi, (after - first) * 64 + _lowest_bit(np.where(in_word, above, reach.take(after))), 0)
        lower = ~has_hi | (target - lo * q <= hi * q - target)
        return np.where(ok, np.where(lower, lo, hi), 0)

    def closest(self, rows: np.ndarray, target: np.ndarray) -> np.ndarray:
        """The (discretised) LLM work of the subset closest to each query's target."""
        return self._units(rows, target) * self.quantum[rows]

    def subset(self, rows: np.ndarray, target: np.ndarray) -> np.ndarray:
        """The subsets themselves, as ``(queries, items)`` masks: walk the prefixes backwards,
        skipping an item whenever the sum is reachable without it (`entrain._SubsetSumTable`)."""
        units = self._units(rows, target)
        take = np.zeros((rows.size, self.units.shape[1]), dtype=bool)
        one = np.uint64(1)
        for c in range(self.units.shape[1] - 1, -1, -1):
            word = self.prefix[c][rows, units >> 6]
            reachable = ((word >> (units & 63).astype(np.uint64)) & one).astype(bool)
            take[:, c] = ~reachable
            units = units - np.where(reachable, 0, self.units[rows, c])
        return take


def _highest_bit(x: np.ndarray) -> np.ndarray:
    """Index of the highest set bit of each nonzero uint64 (garbage for 0): a 32-bit half as a
    float is exact, so its binary exponent is the bit's index."""
    high = x >> np.uint64(32)
    upper = high != 0
    half = np.where(upper, high, x & np.uint64(0xFFFFFFFF)).astype(np.float64)
    return np.frexp(half)[1].astype(np.int64) - 1 + 32 * upper


def _lowest_bit(x: np.ndarray) -> np.ndarray:
    """Index of the lowest set bit of each nonzero uint64: ``x & -x`` is that bit alone, a power
    of two, which a float holds exactly."""
    return np.frexp((x & (~x + np.uint64(1))).astype(np.float64))[1].astype(np.int64) - 1


def _bottleneck_matching(v: np.ndarray, l_ol: np.ndarray, l_ul: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every replica's smallest feasible ``T*`` (§3.5.2 step 3) and its pairing: ``partner[r, a]``
    is the underloaded index paired with overloaded ``a``; ``critical[r, a]`` says it defers.

    Binary search over each replica's sorted candidates ``V u L`` (those at or above its
    heaviest underloaded load: deferral only adds to that side), all replicas in lockstep; a
    probe is feasible when every critical microbatch (``L > T``) matches a distinct partner with
    ``V <= T``, tested for all replicas by one maximum bipartite matching over their block-
    diagonal graph. Non-critical microbatches take the lightest leftover partners."""
    rows, half, n_ul = v.shape
    floor = l_ul.max(axis=1)
    cand = np.concatenate([v.reshape(rows, -1), l_ol, floor[:, None]], axis=1)
    cand = np.where(cand >= floor[:, None], cand, np.inf)
    cand.sort(axis=1)

    def feasible(threshold: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Probe ``threshold[i]`` for replica ``which[i]`` (only the replicas still searching)."""
        m = which.size
        critical = l_ol[which] > threshold[:, None]
        edges = critical[:, :, None] & (v[which] <= threshold[:, None, None])
        r, _, b = np.nonzero(edges)  # row-major: the CSR order of the block-diagonal graph
        indptr = np.concatenate(([0], np.cumsum(edges.sum(axis=2).ravel())))
        graph = csr_matrix((np.ones(r.size, dtype=np.int8), (r * n_ul + b).astype(np.int32), indptr.astype(np.int32)),
                           shape=(m * half, m * n_ul))
        match = maximum_bipartite_matching(graph, perm_type="column").reshape(m, half)
        ok = ((match >= 0) | ~critical).all(axis=1)
        return ok, critical, match - np.arange(m)[:, None] * n_ul

    # T* is at most what a greedy pairing reaches (heaviest first, each alone or with its
    # cheapest free partner), a feasible threshold by construction ...
    used = np.zeros((rows, n_ul), dtype=bool)
    reached = floor.copy()
    lanes = np.arange(rows)
    for a in range(half):
        cost = np.where(used, np.inf, v[:, a])
        j = cost.argmin(axis=1)
        paired = cost[lanes, j] < l_ol[:, a]
        used[lanes[paired], j[paired]] = True
        reached = np.maximum(reached, np.where(paired, cost[lanes, j], l_ol[:, a]))
    hi = np.count_nonzero(cand < reached[:, None], axis=1)
    # ... and at least what lets every overloaded microbatch run somewhere, alone or paired:
    # search between the two, probing the lower bound first (it is usually T* itself)
    bound = np.minimum(l_ol, v.min(axis=2)).max(axis=1)
    lo = np.minimum(np.count_nonzero(cand < bound[:, None], axis=1), hi)
    ok, _, _ = feasible(cand[lanes, lo], lanes)
    hi = np.where(ok, lo, hi)
    lo = np.where(ok, lo, lo + 1)
    while np.any(lo < hi):
        active = np.flatnonzero(lo < hi)
        mid = (lo[active] + hi[active]) // 2
        ok, _, _ = feasible(cand[active, mid], active)
        hi[active] = np.where(ok, mid, hi[active])
        lo[active] = np.where(ok, lo[active], mid + 1)
    ok, critical, match = feasible(cand[lanes, lo], lanes)
    # non-critical overloaded microbatches (heaviest first) take the lightest leftover partners
    partner = np.where(critical, match, -1)
    used = np.zeros((rows, n_ul), dtype=bool)
    rr, aa = np.nonzero(critical)
    used[rr, partner[rr, aa]] = True
    free = np.argsort(np.where(used, np.inf, l_ul), axis=1, kind="stable")
    waiting = np.argsort(critical, axis=1, kind="stable")  # non-critical first
    n_wait = (~critical).sum(axis=1)
    r, i = np.nonzero(np.arange(half)[None, :] < n_wait[:, None])  # the i-th waiting takes the i-th free
    partner[r, waiting[r, i]] = free[r, i]
    return partner, critical


def _keep_llm_nonempty(enc_slot: np.ndarray, llm_slot: np.ndarray, m: int, dp: int) -> np.ndarray:
    """Entrain may defer every sample of an overloaded microbatch (entrain.md §7 gap 9); loom
    keeps one (the last member) in place so no LLM microbatch is empty."""
    counts = np.bincount(llm_slot.ravel(), minlength=m)
    if counts.min() > 0:
        return llm_slot
    llm_slot = llm_slot.copy()
    for j in np.flatnonzero(counts == 0).tolist():
        mine = np.argwhere(enc_slot == j)
        if not mine.size:
            raise LayoutError(f"entrain left LLM microbatch {j} empty with nowhere to take a sample from")
        r, i = mine[-1]
        llm_slot[r, i] = j
    return llm_slot
