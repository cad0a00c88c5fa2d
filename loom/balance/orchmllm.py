"""OrchMLLM's post-balancing as a policy: each phase rebalanced on its own (orchmllm.md §3.4-3.5).

Inside each *round* (one microbatch of every replica, `round_size`) the round's samples are
rebalanced over the round's slots: LPT on per-sample cost for packed phases (the encoders,
whose attention is block-diagonal per item, so the quadratic-aware additive cost is exact,
§3.6), fed to the integer LPT core as quantised costs (`quantised_lpt`); the padded algorithm
(`padded_runs`, §3.5) for a right-padded LLM. Encoder outputs then go straight to the
LLM slot of their sample (rearrangement composition, §2.1). Everything is arrays: a round of
2560 slots x 60 samples is a few vectorised passes, no Python object per sample.
"""

from __future__ import annotations

import time

import numpy as np

from loom.balance.costs import SampleCosts
from loom.balance.disttrain import reorder_microbatches
from loom.balance.lpt import _quantised_lpt
from loom.balance.padded import padded_runs
from loom.balance.payload import loader_rank_of, slot_destinations
from loom.balance.rearrange import rearrange_round, round_time_limit
from loom.balance.sorting import stable_argsort
from loom.plan.plan import LLM, Plan
from loom.schedule.layout import BatchLayout, round_size


def contiguous_sizes(n: int, m: int) -> np.ndarray:
    """Slot sizes of the given (identity) split: contiguous, sizes differing by at most one,
    the larger first (`loom.data.collate.split_microbatches`)."""
    base, extra = divmod(n, m)
    sizes = np.full(m, base, dtype=np.int64)
    sizes[:extra] += 1
    return sizes


def nonempty_bins(bins: np.ndarray, cost: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Move the cheapest sample (ties: lowest position) of the fullest bin (ties: lowest bin)
    into each empty bin: zero-cost samples (text-only ones in an encoder phase) all land on one
    bin under LPT, and the padded algorithm may need fewer runs than bins. Keeps every sample.
    Returns the bins (``bins`` itself when none was empty) and each bin's sample count."""
    counts = np.bincount(bins, minlength=num_bins)
    empty = np.flatnonzero(counts == 0)
    if not empty.size:
        return bins, counts
    bins = bins.copy()
    for b in empty.tolist():
        donor = int(np.argmax(counts))
        members = np.flatnonzero(bins == donor)
        s = int(members[np.lexsort((members, cost[members]))[0]])
        bins[s] = b
        counts[donor] -= 1
        counts[b] += 1
    return bins, counts


def balance_round(phase: str, costs: SampleCosts, lo: int, hi: int, num_bins: int, llm_padded: bool,
                  groups: list | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bins of positions ``lo..hi-1`` (one round), the bins' loads under the phase's own cost
    (padded for a padded LLM, summed otherwise) and their sample counts. ``groups`` (a list):
    receives, where LPT gives them (`_lpt_integer_core`: every batch full), each bin's
    positions (relative to ``lo``), ascending, as a ``(num_bins, count)`` array."""
    if phase == LLM and llm_padded:
        a, sizes = padded_runs(costs.llm_lengths[lo:hi], num_bins, costs.llm_alpha, costs.llm_beta)
        if sizes.size == num_bins:  # a run per bin: the counts are the run sizes, no bin is empty
            return a.rank_of_sample, a.loads, sizes
        bins, counts = nonempty_bins(a.rank_of_sample, costs.work[LLM][lo:hi], num_bins)
        if bins is a.rank_of_sample:  # no bin was empty: the search's loads are the padded ones
            return bins, a.loads, counts
        w = costs.llm_padded_weight()[lo:hi]
        peak = np.zeros(num_bins)
        np.maximum.at(peak, bins, w)
        return bins, counts * peak, counts
    cost = costs.work[phase][lo:hi]
    got: list = []
    a = _quantised_lpt(cost, num_bins, groups=got if groups is not None else None)
    if got:  # every bin took one sample per LPT batch: equal counts, none empty
        groups.append(got[0])
        return a.rank_of_sample, a.loads, np.full(num_bins, got[0].shape[1], dtype=np.int64)
    bins, counts = nonempty_bins(a.rank_of_sample, cost, num_bins)
    loads = a.loads if bins is a.rank_of_sample else np.bincount(bins, weights=cost, minlength=num_bins)
    return bins, loads, counts


def place_bins(loads: np.ndarray, dp: int, carried: np.ndarray) -> np.ndarray:
    """Slot (within the round) of each balanced bin (slot ``b`` is replica ``b % dp``'s): the
    heaviest bin to the replica with the least load so far. Any permutation keeps the round's
    balance (orchmllm.md §2.2's observation behind node-wise rearrangement); this one also
    balances each replica's total over the iteration, which its data-parallel peers wait for
    at the gradient all-reduce. Updates ``carried``. Vectorised when every replica has one
    slot per round (``len(loads) == dp``)."""
    r = loads.size
    slot_of_bin = np.empty(r, dtype=np.int64)
    heavy_first = np.lexsort((np.arange(r), -loads))
    if r == dp:
        slot_of_bin[heavy_first] = np.lexsort((np.arange(r), carried))
        carried += loads[np.argsort(slot_of_bin)]
        return slot_of_bin
    free = list(range(r))
    for b in heavy_first.tolist():
        slot = min(free, key=lambda x: (carried[x % dp], x))
        free.remove(slot)
        slot_of_bin[b] = slot
        carried[slot % dp] += loads[b]
    return slot_of_bin


def orchmllm_layout(plan: Plan, costs: SampleCosts, chosen: dict[str, str], order: str, llm_padded: bool,
                    ranks_per_node: int = 1, nodewise_time_limit: float = 0.05) -> BatchLayout:
    """Per-phase policies (``orchmllm`` or ``none`` per phase), rounds ordered by ``order``.

    With ``ranks_per_node > 1`` (and per-sample payload bytes in ``costs``), each balanced
    round's bins are then permuted over its slots so that fewer payload bytes cross nodes
    (node-wise rearrangement, orchmllm.md §3.10, `loom.balance.rearrange`), within
    ``nodewise_time_limit`` seconds for the whole layout. The layout records it:
    ``unpermuted_slot[phase][j]`` is the slot whose samples slot ``j`` holds without the
    permutation, ``nodewise[phase]`` the cross-node bytes before and after (JSON-ready). Undone,
    the permutation gives exactly the layout made without it: later rounds' replica placement
    (`place_bins`) still balances against the unpermuted placement, so the per-replica totals
    over several rounds may pair up differently (each round's slowest slot is unchanged)."""
    start = time.perf_counter()
    n, m = costs.num_samples, plan.num_microbatches
    r = round_size(plan)
    rounds = m // r
    bounds = np.concatenate(([0], np.cumsum(contiguous_sizes(n, m))))
    base = None  # the given slots, built only for a phase under "none"
    slot_of: dict[str, np.ndarray] = {}
    nodewise = ranks_per_node > 1 and costs.payload_bytes is not None
    balanced = [p for p, policy in chosen.items() if policy != "none"]
    unpermuted: dict[str, np.ndarray] = {}
    record: dict[str, dict] = {}
    loader = loader_rank_of(n, plan.world_size) if nodewise else None
    calls = len(balanced) * rounds
    slot_load: dict[str, np.ndarray] = {}  # per balanced phase, each slot's load (its bin's)
    slot_counts: dict[str, np.ndarray] = {}  # and its sample count
    presorted: dict[str, np.ndarray] = {}  # per phase, the slots' positions where LPT grouped them
    for phase, policy in chosen.items():
        if policy == "none":
            if base is None:
                base = np.repeat(np.arange(m, dtype=np.int64), np.diff(bounds))
            slot_of[phase] = base
            continue
        dp = plan.spec(phase).data_parallel
        carried = np.zeros(dp)
        idx = np.empty(n, dtype=np.int64)
        per_slot = slot_load[phase] = np.zeros(m)
        slot_count = np.empty(m, dtype=np.int64)
        if nodewise:
            dest_all = slot_destinations(plan, phase, m)
            undo = np.arange(m, dtype=np.int64)
            stats = np.zeros(4)
            methods: set[str] = set()
            applied = 0
        # each round's slots' positions, when LPT gives them grouped (`balance_round`): the layout's
        # order without a sort of all n (not when rounds are reordered below)
        pieces: list | None = None if order == "disttrain" and rounds > 1 else []
        for t in range(rounds):
            lo, hi = int(bounds[t * r]), int(bounds[(t + 1) * r])
            groups: list | None = [] if pieces is not None else None
            bins, loads, counts = balance_round(phase, costs, lo, hi, r, llm_padded, groups)
            slot_of_bin = place_bins(loads, dp, carried)
            if nodewise:
                got = rearrange_round(bins, slot_of_bin, loader[lo:hi], costs.payload_bytes[phase][lo:hi],
                                      dest_all[t * r:(t + 1) * r], ranks_per_node,
                                      round_time_limit(nodewise_time_limit, calls, start))
                calls -= 1
                undo[t * r + got.slot_of_bin] = t * r + slot_of_bin
                stats += (got.cross_before, got.cross_after, got.max_send_before, got.max_send_after)
                methods.add(got.method)
                applied += got.applied
                slot_of_bin = got.slot_of_bin
            np.take(slot_of_bin, bins, out=idx[lo:hi], mode="clip")  # "raise" would buffer the output
            if t:
                idx[lo:hi] += t * r
            per_slot[t * r + slot_of_bin] = loads
            slot_count[t * r + slot_of_bin] = counts
            if groups:
                bin_of_slot = np.empty(r, dtype=np.int64)
                bin_of_slot[slot_of_bin] = np.arange(r)
                piece = groups[0][bin_of_slot].reshape(-1).astype(np.int64)
                if lo:
                    piece += lo
                pieces.append(piece)
            else:
                pieces = None
        if pieces:
            presorted[phase] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        slot_of[phase] = idx
        slot_counts[phase] = slot_count
        if nodewise:
            unpermuted[phase] = undo
            record[phase] = {"ranks_per_node": ranks_per_node, "rounds_permuted": applied, "rounds": rounds,
                             "method": sorted(methods), "cross_node_bytes": [float(stats[0]), float(stats[1])],
                             "max_send_bytes_round_sum": [float(stats[2]), float(stats[3])]}
    if order == "disttrain" and rounds > 1:
        perm = np.asarray(round_order(plan, costs, slot_of, r), dtype=np.int64)
        new_round = np.empty_like(perm)
        new_round[perm] = np.arange(perm.size)
        move = lambda v: new_round[v // r] * r + v % r  # noqa: E731 (slot after the round reorder)
        slot_of = {p: move(v) for p, v in slot_of.items()}
        for held in (slot_load, slot_counts):
            for p, v in held.items():
                held[p] = np.empty_like(v)
                held[p][move(np.arange(m))] = v
        for p, undo in unpermuted.items():
            moved = np.empty_like(undo)
            moved[move(np.arange(m))] = move(undo)
            unpermuted[p] = moved
    arrays = {p: (presorted[p], np.concatenate(([0], np.cumsum(slot_counts[p])))) if p in presorted
              else slot_arrays(v, m, slot_counts.get(p)) for p, v in slot_of.items()}
    layout = BatchLayout(None, dict(chosen), arrays=arrays)
    for p, v in slot_of.items():
        layout.set_slot_index(p, v)  # the arrays were sorted from it: the check and the prediction read it
    # the balanced loads are the never-slower prediction's per-slot costs (`predict.slot_costs`):
    # the same padded products, the same sums up to rounding
    layout.known_slot_costs = (costs, llm_padded, slot_load)
    layout.unpermuted_slot = unpermuted
    layout.nodewise = record
    return layout


def slot_arrays(slot_of: np.ndarray, num_slots: int, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`BatchLayout`'s ``(order, bounds)`` of one phase from each sample's slot (positions
    ascending inside a slot), as `BatchLayout.from_slot_index`, but sorting packed 32-bit
    ``slot << b | position`` keys when they fit (`stable_argsort`, which falls back to a stable
    argsort). ``counts``: each slot's sample count, when known."""
    order = stable_argsort(slot_of, num_slots)
    if counts is None:
        counts = np.bincount(slot_of, minlength=num_slots)
    return order, np.concatenate(([0], np.cumsum(counts)))


def round_order(plan: Plan, costs: SampleCosts, slot_of: dict[str, np.ndarray], r: int) -> list[int]:
    """DistTrain Algorithm 3 over rounds: a round's encoder time is its slowest encoder slot,
    its LLM time the slowest LLM slot (per LLM stage)."""
    m = plan.num_microbatches
    rounds = m // r

    def slowest(phase: str) -> np.ndarray:
        return np.bincount(slot_of[phase], weights=costs.work[phase], minlength=m).reshape(rounds, r).max(axis=1)

    enc = np.max([slowest(e) for e in plan.encoder_names], axis=0) if plan.encoder_names else np.zeros(rounds)
    p_llm = plan.spec(LLM).num_stages
    return reorder_microbatches(enc.tolist(), (slowest(LLM) / p_llm).tolist(), 1 + p_llm)
