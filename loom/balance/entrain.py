"""Entrain's hierarchical microbatch assignment with pairwise deferral (``entrain.md`` §3.4-§3.5).

Pure, deterministic functions over per-sample workloads (docs/architecture.md principle 4). A sample is an
index into ``encoder_work`` / ``llm_work``; every function returns indices, never copies of data.

Pipeline of Algorithm 4 (``entrain.md`` §3.5):

1. `dp_assignment` spreads the global batch over data-parallel replicas (§3.4, lines 1-2).
2. `effective_microbatches` caps the microbatch count at K_eff (§3.5.1, line 3).
3. `stratified_assignment` packs one replica's samples into encoder microbatches with a min-load
   greedy over a coarse/fine stratified list (§3.5.1, lines 4-6); any list order keeps Graham's
   ``(2 - 1/K)`` bound.
4. `deferral_sets` finds, for every overloaded/underloaded pair, the subset of the overloaded
   microbatch whose LLM work is closest to half the gap (subset-sum DP, §3.5.2 step 1), and
   `pair_bottleneck_costs` turns them into eq. 4.3's ``V_{i,j}``.
5. `bottleneck_matching` finds the smallest feasible bottleneck ``T*`` by binary search with a
   bipartite matching per probe (§3.5.2 step 3).
6. `interleaved_order` lays pairs out as ``(ol_0, ul_0, ol_1, ul_1, ...)`` so a deferred sample
   waits exactly one microbatch interval (§3.5.2, line 14).

`pairwise_deferral` runs steps 4-6 on given microbatches; `entrain_plan` runs 2-6 for one
replica; `entrain_replica_plans` runs 1-6 for a whole global batch.

Decisions where the digest leaves a gap (``entrain.md`` §7) or corrects the text:

- DP assignment fills replicas to exactly ``B_global / DP`` samples (§7.6: the capacity cap).
- Line 8 splits ``K_eff`` microbatches, not ``K`` (§7.7). With odd ``K_eff`` the middle microbatch
  joins the underloaded side, so one underloaded microbatch runs unpaired and last.
- The coarse/fine split (§7.8): the fine set is the lower ``fine_fraction`` of samples by LLM
  workload, grown to at least ``K_eff``. To make "every microbatch receives a fine sample" true
  (the text claims it but min-load greedy does not guarantee it), the ``K_eff`` fine samples with
  the largest encoder work go first in the list, one per microbatch; then the coarse set, then
  the rest of the fine set, each sorted by encoder work descending. Every step still places a
  sample on a least-loaded microbatch, so it is a list-scheduling run and Graham's bound holds.
- Subset-sum (§7.9): workloads are discretised to ``quantum`` units (exact when integral); ties
  prefer the smaller deferral (less buffering, fewer split backward passes). Deferring a whole
  microbatch is never chosen: the empty set is always at least as close to the target.
- ``T*`` is never below the heaviest underloaded microbatch: deferral only adds to the
  underloaded side, so candidate thresholds below it are infeasible whatever the matching
  (the text's feasibility test only looks at critical overloaded microbatches).
- The (MB6, MB5) and (MB3, MB5) cells of Fig 4.10b contradict eq. 4.3 (§3.5.3); this module
  follows eq. 4.3.
- Pair order in the interleaved sequence (§7.10): by overloaded LLM workload, heaviest first.
  Non-critical overloaded microbatches take the lightest leftover underloaded partner, with no
  deferral, as the text says.
"""

from __future__ import annotations

import numbers

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Discretisation of the subset-sum table when workloads are not integral: each overloaded
# microbatch's total is split into this many units (§3.5.2 leaves the unit open, §7.9). At
# 4096 the rounding error of a deferral is below 0.03% of the microbatch, far below cost-model
# error, and the bitset per table stays a few hundred bytes.
SUBSET_SUM_RESOLUTION = 4096

# Relative tolerance for comparing float sums: equal-valued choices that differ only in the last
# bits must tie, or tie-breaking would depend on summation order.
_REL_TOL = 1e-12


# ---- validation ----------------------------------------------------------------------------------


def _workloads(name: str, values: Sequence[float]) -> list[float]:
    """``values`` as a list of finite, non-negative floats, or ValueError naming ``name``."""
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of numbers: {exc}") from None
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise ValueError(
                f"{name}[{i}] = {v}: workloads must be finite and non-negative"
            )
    return out


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _matching_lengths(encoder_work: list[float], llm_work: list[float]) -> None:
    if len(encoder_work) != len(llm_work):
        raise ValueError(
            f"encoder_work has {len(encoder_work)} samples but llm_work has {len(llm_work)}"
        )


def _microbatches(
    name: str, microbatches: Sequence[Sequence[int]], num_samples: int
) -> list[list[int]]:
    """Check that ``microbatches`` hold valid, distinct sample indices."""
    # numpy integers are fine indices: normalise them to int so the checks below hold
    out = [[int(s) if isinstance(s, numbers.Integral) and not isinstance(s, bool) else s for s in mb]
           for mb in microbatches]
    seen: set[int] = set()
    for m, mb in enumerate(out):
        for s in mb:
            if (
                isinstance(s, bool)
                or not isinstance(s, int)
                or not 0 <= s < num_samples
            ):
                raise ValueError(
                    f"{name}[{m}] holds {s!r}, not a sample index in [0, {num_samples})"
                )
            if s in seen:
                raise ValueError(f"{name} holds sample {s} twice")
            seen.add(s)
    return out


# ---- §3.4: DP-level assignment ---------------------------------------------------------------------


def dp_assignment(
    encoder_work: Sequence[float], llm_work: Sequence[float], dp_degree: int
) -> list[list[int]]:
    """Split a global batch over ``dp_degree`` replicas (``entrain.md`` §3.4, Alg. 4 lines 1-2).

    Samples go in descending encoder workload (so the heaviest encoder samples land on different
    replicas) to the replica with the least accumulated LLM workload among those below the
    capacity ``B_global / dp_degree`` (§7.6: equal-count replicas need the cap). Ties break by
    sample index, then replica index, so the result is deterministic.
    """
    enc = _workloads("encoder_work", encoder_work)
    llm = _workloads("llm_work", llm_work)
    _matching_lengths(enc, llm)
    _positive_int("dp_degree", dp_degree)
    if len(enc) % dp_degree:
        raise ValueError(
            f"the global batch of {len(enc)} samples does not split evenly over dp_degree={dp_degree}"
        )
    capacity = len(enc) // dp_degree
    members: list[list[int]] = [[] for _ in range(dp_degree)]
    load = [0.0] * dp_degree
    for s in sorted(range(len(enc)), key=lambda s: (-enc[s], s)):
        r = min(
            (r for r in range(dp_degree) if len(members[r]) < capacity),
            key=lambda r: (load[r], r),
        )
        members[r].append(s)
        load[r] += llm[s]
    return members


# ---- §3.5.1: K_eff and stratified assignment -----------------------------------------------------


def effective_microbatches(encoder_work: Sequence[float], num_microbatches: int) -> int:
    """``K_eff = min(K, floor(sum w_enc / max w_enc))`` over one replica (§3.5.1, line 3).

    The heaviest sample bounds every microbatch's encoder work from below; more microbatches than
    ``sum / max`` would leave the others much lighter than the one holding it. With all-zero
    encoder work the cap is the sample count, so no microbatch is left empty.
    """
    enc = _workloads("encoder_work", encoder_work)
    _positive_int("num_microbatches", num_microbatches)
    if not enc:
        raise ValueError("encoder_work is empty: a replica needs at least one sample")
    peak = max(enc)
    if peak == 0:
        return min(num_microbatches, len(enc))
    # The small slack keeps e.g. 3 * (1/3) / (1/3) from flooring to 2 through rounding.
    return max(1, min(num_microbatches, math.floor(sum(enc) / peak * (1 + 1e-12))))


def split_by_llm_workload(
    llm_work: Sequence[float],
    samples: Sequence[int],
    num_microbatches: int,
    fine_fraction: float = 0.5,
) -> tuple[list[int], list[int]]:
    """Split ``samples`` into coarse (high LLM work) and fine (low LLM work) sets (§3.5.1 line 4).

    The threshold is a gap (§7.8): the fine set is the ``fine_fraction`` of samples with the least
    LLM work, at least ``num_microbatches`` of them (one per microbatch) when there are enough.
    Returns ``(coarse, fine)``, each in ascending sample order.
    """
    if not 0.0 <= fine_fraction <= 1.0:
        raise ValueError(f"fine_fraction must lie in [0, 1], got {fine_fraction}")
    by_llm = sorted(samples, key=lambda s: (llm_work[s], s))
    n_fine = min(
        len(by_llm), max(num_microbatches, math.ceil(fine_fraction * len(by_llm)))
    )
    return sorted(by_llm[n_fine:]), sorted(by_llm[:n_fine])


def stratified_assignment(
    encoder_work: Sequence[float],
    num_microbatches: int,
    llm_work: Sequence[float] | None = None,
    fine_fraction: float = 0.5,
) -> list[list[int]]:
    """Min-max greedy packing of samples into ``num_microbatches`` encoder microbatches (§3.5.1).

    Without ``llm_work`` this is LPT list scheduling on encoder work. With it, the list is
    stratified: one fine sample per microbatch first, then the coarse set, then the remaining fine
    samples, each group by encoder work descending (module docstring: the seeding fixes §7.8).
    Each sample goes to a least-loaded microbatch (ties: fewer samples, then lower index, which
    also spreads the seeds when their work is zero). Samples without encoder work after the
    seeds go where the LLM work is least, heaviest first (they cannot change the encoder loads;
    greedy on those alone would pile them on one microbatch). Every step is a list-scheduling step, so the
    encoder makespan is at most ``sum/K + (1 - 1/K) max <= (2 - 1/K) OPT`` (Graham; §3.5.1).

    The caller picks the count (normally `effective_microbatches`); sample counts per
    microbatch vary, by design (encoder balance over count uniformity).
    """
    enc = _workloads("encoder_work", encoder_work)
    k = _positive_int("num_microbatches", num_microbatches)
    samples = list(range(len(enc)))
    if llm_work is None:
        order = sorted(samples, key=lambda s: (-enc[s], s))
    else:
        llm = _workloads("llm_work", llm_work)
        _matching_lengths(enc, llm)
        coarse, fine = split_by_llm_workload(llm, samples, k, fine_fraction)
        fine = sorted(fine, key=lambda s: (-enc[s], s))
        coarse = sorted(coarse, key=lambda s: (-enc[s], s))
        order = fine[:k] + coarse + fine[k:]
    microbatches: list[list[int]] = [[] for _ in range(k)]
    # A heap keyed (load, sample count, index) pops exactly the argmin of that key: O(log K)
    # per sample instead of a scan, which is most of the planner's time at K = 32.
    heap = [(0.0, 0, m) for m in range(k)]
    no_encoder: list[int] = []
    for i, s in enumerate(order):
        if llm_work is not None and enc[s] == 0 and i >= k:
            no_encoder.append(s)
            continue
        load, count, m = heap[0]
        microbatches[m].append(s)
        heapq.heapreplace(heap, (load + enc[s], count + 1, m))
    if no_encoder:
        # Samples without encoder work (text only) change no encoder load, so min-load greedy
        # would put every one of them on the same microbatch (entrain.md leaves the case open).
        # They go, heaviest first, where the LLM work is least: the encoder makespan and its
        # bound are untouched, and deferral starts from balanced LLM loads (loom's decision).
        llm_load = [sum(llm[x] for x in mb) for mb in microbatches]
        for s in sorted(no_encoder, key=lambda x: (-llm[x], x)):
            m = min(range(k), key=lambda j: (llm_load[j], len(microbatches[j]), j))
            microbatches[m].append(s)
            llm_load[m] += llm[s]
    return microbatches


# ---- §3.5.2 step 1-2: subset-sum deferral sets and pair costs --------------------------------------


def _quantum(weights: Sequence[float], quantum: float | None) -> float:
    """The subset-sum unit: 1 for small integral workloads (exact), else total / resolution."""
    if quantum is not None:
        return quantum
    total = sum(weights)
    if total <= SUBSET_SUM_RESOLUTION and all(w == int(w) for w in weights):
        return 1.0
    return total / SUBSET_SUM_RESOLUTION


class _SubsetSumTable:
    """Reachable discretised subset sums of one microbatch's LLM workloads (§3.5.2 step 1).

    Built once per overloaded microbatch and queried for each underloaded partner's target:
    the table does not depend on the partner, only the target does. Reachable sums are bits of
    a Python int (bit ``k`` set: some subset sums to ``k`` units), one int per prefix of items
    so a subset can be read back; this is the ``O(N_ol * w')`` DP at machine-word speed.
    """

    def __init__(self, weights: Sequence[float], quantum: float):
        self.weights = list(weights)
        self.units = [round(w / quantum) if quantum > 0 else 0 for w in self.weights]
        self.quantum = quantum
        reach = 1
        self.prefix = [reach]
        for u in self.units:
            reach |= reach << u
            self.prefix.append(reach)

    def _subset(self, units: int) -> list[int]:
        # Walk the prefixes backwards: skip an item whenever the sum is reachable without it,
        # so zero-unit items are never taken and the choice is deterministic.
        chosen = []
        for k in range(len(self.units), 0, -1):
            if not (self.prefix[k - 1] >> units) & 1:
                chosen.append(k - 1)
                units -= self.units[k - 1]
        return sorted(chosen)

    def closest(self, target: float) -> list[int]:
        """Positions of the subset whose real sum is closest to ``target``; ties: smaller sum."""
        if target <= 0 or self.quantum <= 0:
            return []
        reach = self.prefix[-1]
        t = min(math.floor(target / self.quantum), reach.bit_length() - 1)
        below = (reach & ((1 << (t + 1)) - 1)).bit_length() - 1
        candidates = [below]
        above_bits = reach >> (t + 1)
        if above_bits:
            candidates.append(t + 1 + (above_bits & -above_bits).bit_length() - 1)
        # Rounding to units can misorder near-ties, so the final choice compares real sums.
        best: list[int] = []
        best_key = (math.inf, math.inf)
        for units in candidates:
            subset = self._subset(units)
            real = sum(self.weights[p] for p in subset)
            gap = abs(target - real)
            if gap < best_key[0] - _REL_TOL * max(1.0, target) or (
                gap <= best_key[0] + _REL_TOL * max(1.0, target) and real < best_key[1]
            ):
                best, best_key = subset, (gap, real)
        return best


def closest_subset(
    weights: Sequence[float], target: float, quantum: float | None = None
) -> list[int]:
    """Positions into ``weights`` of the subset whose sum is closest to ``target`` (§3.5.2 step 1).

    Exact for integral weights (unit 1) up to `SUBSET_SUM_RESOLUTION` in total; otherwise exact
    up to one ``quantum`` of rounding per item. Ties prefer the smaller sum (§3.5.2 [derived]).
    """
    w = _workloads("weights", weights)
    if not math.isfinite(target):
        raise ValueError(f"target must be finite, got {target}")
    if quantum is not None and not (math.isfinite(quantum) and quantum > 0):
        raise ValueError(f"quantum must be a positive finite number, got {quantum}")
    return _SubsetSumTable(w, _quantum(w, quantum)).closest(target)


def _split_halves(loads: Sequence[float]) -> tuple[list[int], list[int]]:
    """Overloaded (top floor(K/2) by LLM load) and underloaded (the rest) microbatches.

    Line 8 of Alg. 4 with K_eff (§7.7); the odd middle microbatch joins the underloaded side.
    Both lists are heaviest first; ties break by microbatch index.
    """
    by_load = sorted(range(len(loads)), key=lambda m: (-loads[m], m))
    half = len(loads) // 2
    return by_load[:half], by_load[half:]


def deferral_sets(
    microbatches: Sequence[Sequence[int]],
    llm_work: Sequence[float],
    overloaded: Sequence[int],
    underloaded: Sequence[int],
    quantum: float | None = None,
) -> dict[tuple[int, int], tuple[int, ...]]:
    """For each pair (i overloaded, j underloaded), the samples of microbatch i to defer (§3.5.2).

    The chosen subset's LLM work is closest to ``delta = (w_i - w_j) / 2``, which by the identity
    ``V = (w_i + w_j)/2 + |delta - w_deferred|`` is exactly the subset minimising eq. 4.3's ``V``.
    Keys are microbatch indices; values are sample indices, in microbatch order.
    """
    llm = _workloads("llm_work", llm_work)
    mbs = _microbatches("microbatches", microbatches, len(llm))
    loads = [sum(llm[s] for s in mb) for mb in mbs]
    for name, group in (("overloaded", overloaded), ("underloaded", underloaded)):
        for m in group:
            if not 0 <= m < len(mbs):
                raise ValueError(f"{name} names microbatch {m}; there are {len(mbs)}")
    if quantum is not None and not (math.isfinite(quantum) and quantum > 0):
        raise ValueError(f"quantum must be a positive finite number, got {quantum}")
    sets: dict[tuple[int, int], tuple[int, ...]] = {}
    for i in overloaded:
        weights = [llm[s] for s in mbs[i]]
        table = _SubsetSumTable(weights, _quantum(weights, quantum))
        for j in underloaded:
            positions = table.closest((loads[i] - loads[j]) / 2)
            sets[(i, j)] = tuple(mbs[i][p] for p in positions)
    return sets


def pair_bottleneck_costs(
    llm_loads: Sequence[float],
    deferred: Mapping[tuple[int, int], Sequence[int]],
    llm_work: Sequence[float],
) -> dict[tuple[int, int], float]:
    """Eq. 4.3: ``V_{i,j} = max(w_i - w_deferred, w_j + w_deferred)`` for every pair (§3.5.2)."""
    costs = {}
    for (i, j), samples in deferred.items():
        moved = sum(llm_work[s] for s in samples)
        costs[(i, j)] = max(llm_loads[i] - moved, llm_loads[j] + moved)
    return costs


# ---- §3.5.2 step 3: bottleneck matching ------------------------------------------------------------


@dataclass(frozen=True)
class BottleneckMatch:
    """Result of `bottleneck_matching` (§3.5.2 step 3).

    ``threshold`` is ``T*``; ``pairs`` lists (overloaded, underloaded) microbatches in
    interleaving order; ``deferring`` holds the overloaded microbatches that defer (the critical
    ones, ``L_i > T*``); ``unpaired`` the underloaded microbatches left alone (odd K only).
    """

    threshold: float
    pairs: tuple[tuple[int, int], ...]
    deferring: frozenset[int]
    unpaired: tuple[int, ...]


def _max_matching(
    left: Sequence[int], edges: Mapping[int, Sequence[int]]
) -> dict[int, int]:
    """Maximum bipartite matching by DFS augmenting paths (Kuhn), as a map right -> left.

    The "DFS-based bipartite matching" the text names (§3.5.2). Written by hand rather than via
    scipy's Hopcroft-Karp: with at most K_eff/2 (a few dozen) nodes per side a Python DFS is
    microseconds, while building a sparse matrix per binary-search probe costs more than the
    whole search; the O(V E) bound is irrelevant at this size (§7.10). Left nodes are tried in
    the given order and their edges in the given order, so the result is deterministic.
    """
    owner: dict[int, int] = {}

    def augment(u: int, visited: set[int]) -> bool:
        for v in edges[u]:
            if v in visited:
                continue
            visited.add(v)
            if v not in owner or augment(owner[v], visited):
                owner[v] = u
                return True
        return False

    for u in left:
        augment(u, set())
    return owner


def bottleneck_matching(
    pair_costs: Mapping[tuple[int, int], float],
    standalone: Mapping[int, float],
    overloaded: Sequence[int],
    underloaded: Sequence[int],
    underloaded_loads: Mapping[int, float] | None = None,
) -> BottleneckMatch:
    """Smallest ``T*`` such that every microbatch finishes its LLM work within it (§3.5.2 step 3).

    ``pair_costs`` is ``V`` (eq. 4.3), ``standalone`` is ``L_i = w_{LLM,i}`` for overloaded i.
    A threshold T is feasible when the critical microbatches (``L_i > T``) can each be matched
    to a distinct underloaded partner with ``V_{i,j} <= T``; feasibility is monotone in T, so a
    binary search over the sorted candidates ``V u L`` finds ``T*``. Candidates below the
    heaviest underloaded load (``underloaded_loads``, if given) are dropped: deferral only adds
    to that side. Non-critical microbatches take the lightest leftover partners, without
    deferral. Needs ``len(underloaded) >= len(overloaded)``.
    """
    ol = list(overloaded)
    ul = list(underloaded)
    if len(set(ol)) != len(ol) or len(set(ul)) != len(ul) or set(ol) & set(ul):
        raise ValueError(
            "overloaded and underloaded must be disjoint lists of distinct microbatches"
        )
    if len(ul) < len(ol):
        raise ValueError(
            f"{len(ol)} overloaded microbatches cannot pair with only {len(ul)} underloaded ones"
        )
    for i in ol:
        if i not in standalone:
            raise ValueError(f"standalone has no cost for overloaded microbatch {i}")
        for j in ul:
            if (i, j) not in pair_costs:
                raise ValueError(f"pair_costs has no cost for pair ({i}, {j})")
    floor_load = (
        max((underloaded_loads[j] for j in ul), default=0.0)
        if underloaded_loads
        else 0.0
    )
    candidates = sorted(
        {
            c
            for c in (
                *(pair_costs[(i, j)] for i in ol for j in ul),
                *(standalone[i] for i in ol),
            )
            if c >= floor_load
        }
        | {floor_load}
    )
    # Critical microbatches are matched heaviest first, each trying its cheapest partners first,
    # so the matching at T* is deterministic and prefers small bottlenecks.
    ol_by_load = sorted(ol, key=lambda i: (-standalone[i], i))
    partners = {i: sorted(ul, key=lambda j: (pair_costs[(i, j)], j)) for i in ol}

    def match(threshold: float) -> tuple[list[int], dict[int, int]]:
        critical = [i for i in ol_by_load if standalone[i] > threshold]
        edges = {
            i: [j for j in partners[i] if pair_costs[(i, j)] <= threshold]
            for i in critical
        }
        return critical, _max_matching(critical, edges)

    lo, hi = (
        0,
        len(candidates) - 1,
    )  # the largest candidate is >= every L_i: nothing is critical
    while lo < hi:
        mid = (lo + hi) // 2
        critical, owner = match(candidates[mid])
        if len(owner) == len(critical):
            hi = mid
        else:
            lo = mid + 1
    threshold = candidates[lo]
    critical, owner = match(threshold)
    partner_of = {i: j for j, i in owner.items()}
    # Leftover partners lightest first, so a non-critical microbatch pairs with room to spare.
    if underloaded_loads is not None:
        light_first = sorted(ul, key=lambda j: (underloaded_loads[j], j))
    else:
        light_first = list(reversed(ul))  # by convention ul is heaviest first
    leftover = [j for j in light_first if j not in owner]
    for i in ol_by_load:
        if i not in partner_of:
            partner_of[i] = leftover.pop(0)
    pairs = tuple((i, partner_of[i]) for i in ol_by_load)
    return BottleneckMatch(threshold, pairs, frozenset(critical), tuple(leftover))


def interleaved_order(
    pairs: Sequence[tuple[int, int]], unpaired: Sequence[int] = ()
) -> list[int]:
    """Execution order ``(ol_0, ul_0, ol_1, ul_1, ..., unpaired...)`` (§3.5.2, Alg. 4 line 14).

    Each underloaded partner runs right after its overloaded microbatch, so deferred encoder
    activations are buffered for one microbatch interval at most. Unpaired microbatches (odd K)
    have nothing deferred to them and run last.
    """
    order = [m for pair in pairs for m in pair] + list(unpaired)
    if len(set(order)) != len(order):
        raise ValueError(f"pairs and unpaired name a microbatch twice: {order}")
    return order


# ---- whole plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deferral:
    """LLM work of ``samples`` moves from position ``source`` to ``destination = source + 1``."""

    samples: tuple[int, ...]
    source: int
    destination: int


@dataclass(frozen=True)
class EntrainPlan:
    """One replica's microbatches in execution order (§3.5, Alg. 4 output).

    Position ``p`` runs encoder microbatch ``encoder_microbatches[p]`` and LLM microbatch
    ``llm_microbatches[p]``; they differ only by ``deferrals``. ``order[p]`` is the index of that
    microbatch before interleaving (in `pairwise_deferral`'s input). ``bottleneck`` is ``T*``,
    the largest LLM microbatch workload after deferral.
    """

    encoder_microbatches: tuple[tuple[int, ...], ...]
    llm_microbatches: tuple[tuple[int, ...], ...]
    deferrals: tuple[Deferral, ...]
    bottleneck: float
    order: tuple[int, ...]

    @property
    def num_microbatches(self) -> int:
        return len(self.encoder_microbatches)

    def encoder_loads(self, encoder_work: Sequence[float]) -> list[float]:
        return [sum(encoder_work[s] for s in mb) for mb in self.encoder_microbatches]

    def llm_loads(self, llm_work: Sequence[float]) -> list[float]:
        return [sum(llm_work[s] for s in mb) for mb in self.llm_microbatches]


def pairwise_deferral(
    microbatches: Sequence[Sequence[int]],
    llm_work: Sequence[float],
    quantum: float | None = None,
) -> EntrainPlan:
    """Pairwise deferral over given encoder microbatches (§3.5.2, Alg. 4 lines 7-15)."""
    llm = _workloads("llm_work", llm_work)
    mbs = _microbatches("microbatches", microbatches, len(llm))
    if not mbs:
        raise ValueError("microbatches is empty")
    loads = [sum(llm[s] for s in mb) for mb in mbs]
    overloaded, underloaded = _split_halves(loads)
    sets = deferral_sets(mbs, llm, overloaded, underloaded, quantum)
    costs = pair_bottleneck_costs(loads, sets, llm)
    match = bottleneck_matching(
        costs,
        {i: loads[i] for i in overloaded},
        overloaded,
        underloaded,
        {j: loads[j] for j in underloaded},
    )
    order = interleaved_order(match.pairs, match.unpaired)
    position = {m: p for p, m in enumerate(order)}
    llm_mbs = [list(mbs[m]) for m in order]
    deferrals = []
    for i, j in match.pairs:
        moved = sets[(i, j)] if i in match.deferring else ()
        if not moved:
            continue
        gone = set(moved)
        llm_mbs[position[i]] = [s for s in llm_mbs[position[i]] if s not in gone]
        llm_mbs[position[j]] = llm_mbs[position[j]] + list(moved)
        deferrals.append(Deferral(tuple(moved), position[i], position[j]))
    return EntrainPlan(
        encoder_microbatches=tuple(tuple(mbs[m]) for m in order),
        llm_microbatches=tuple(tuple(mb) for mb in llm_mbs),
        deferrals=tuple(deferrals),
        # The realised maximum, which equals T* (every microbatch ends within T*, and some pair,
        # standalone or underloaded load attains it); recomputed so it is the plan's own number.
        bottleneck=max(sum(llm[s] for s in mb) for mb in llm_mbs),
        order=tuple(order),
    )


def entrain_plan(
    encoder_work: Sequence[float],
    llm_work: Sequence[float],
    num_microbatches: int,
    fine_fraction: float = 0.5,
    quantum: float | None = None,
) -> EntrainPlan:
    """Hierarchical microbatch assignment for one replica (§3.5, Alg. 4 lines 3-15).

    K_eff, stratified encoder microbatches, then pairwise deferral of LLM work. Samples are
    indices into the two workload sequences; each appears once among the encoder microbatches
    and once among the LLM microbatches.
    """
    enc = _workloads("encoder_work", encoder_work)
    llm = _workloads("llm_work", llm_work)
    _matching_lengths(enc, llm)
    k_eff = effective_microbatches(enc, num_microbatches)
    microbatches = stratified_assignment(enc, k_eff, llm, fine_fraction)
    return pairwise_deferral(microbatches, llm, quantum)


def entrain_replica_plans(
    encoder_work: Sequence[float],
    llm_work: Sequence[float],
    dp_degree: int,
    num_microbatches: int,
    fine_fraction: float = 0.5,
    quantum: float | None = None,
) -> list[EntrainPlan]:
    """Alg. 4 end to end: DP assignment (§3.4), then `entrain_plan` per replica.

    Sample indices in the returned plans are global (indices into the inputs).
    """
    enc = _workloads("encoder_work", encoder_work)
    llm = _workloads("llm_work", llm_work)
    plans = []
    for members in dp_assignment(enc, llm, dp_degree):
        local = entrain_plan(
            [enc[s] for s in members],
            [llm[s] for s in members],
            num_microbatches,
            fine_fraction,
            quantum,
        )
        plans.append(_relabel(local, members))
    return plans


def _relabel(plan: EntrainPlan, members: Sequence[int]) -> EntrainPlan:
    """``plan`` with replica-local sample indices replaced by the global ``members[s]``."""

    def to_global(samples: Sequence[int]) -> tuple[int, ...]:
        return tuple(members[s] for s in samples)

    return EntrainPlan(
        encoder_microbatches=tuple(to_global(mb) for mb in plan.encoder_microbatches),
        llm_microbatches=tuple(to_global(mb) for mb in plan.llm_microbatches),
        deferrals=tuple(
            Deferral(to_global(d.samples), d.source, d.destination)
            for d in plan.deferrals
        ),
        bottleneck=plan.bottleneck,
        order=plan.order,
    )
