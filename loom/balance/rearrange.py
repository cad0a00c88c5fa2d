"""OrchMLLM's node-wise rearrangement inside the policy (orchmllm.md §3.10, Algorithm 3; §3.9
for the cost): once a round's bins are balanced, which slot (hence which replica, hence which
ranks) takes which bin is free (§2.2: any permutation keeps the round's balance), so choose it
so that fewer payload bytes cross nodes on their way from the loader ranks (`loom.balance.payload`).

Three solvers, each given the bytes every loader rank holds of every bin:

- when the round has at most `EXACT_MAX_SLOTS` slots, each with one destination rank (a
  single-stage phase), and every node that hosts slots hosts equally many, the round *is*
  Algorithm 3's problem: slots are its
  ranks, grouped by node; `nodewise_rearrangement` (heuristic, certified bound, MILP under its
  time limit) minimises the largest per-rank inter-node send (Eq. 5). Loader ranks on a node
  without slots of the phase send every byte off-node whatever the permutation, so they drop
  out; a loader rank that is itself a destination speaks as its own slot, one on a slot-hosting
  node as that node's first slot;
- otherwise, up to `EXACT_MAX_SLOTS` slots (pipelined phases: a slot's payload goes to every
  stage's rank, on several nodes; or uneven nodes), the exact minimum of the total cross-node
  bytes, a linear assignment of bins to slots (`scipy.optimize.linear_sum_assignment`);
- above `EXACT_MAX_SLOTS` slots (both solvers above are dense in slots x slots: ~7 s at 2560),
  a greedy placement of bins on classes of slots with the same destination nodes (`_greedy`).

A permutation is kept only if it moves no more cross-node bytes (summed over every loader rank
and destination) than the placement it replaces, so the rearrangement never adds traffic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from loom.balance.assignment import Assignment
from loom.balance.nodewise import nodewise_rearrangement

# Above this many slots in a round, the greedy class placement replaces Algorithm 3 and the exact
# assignment (both dense in slots x slots: ~7 s at 2560 slots, 0.13 s at 256, on the 2-core machine;
# at 128 they keep the default 0.05 s budget)
EXACT_MAX_SLOTS = 128


@dataclass(frozen=True)
class RoundRearrangement:
    """One round's outcome: ``slot_of_bin`` (local slot per bin, the new placement or the
    given one), the round's cross-node bytes before and after (``after == before`` when the
    given placement was kept), the largest per-rank inter-node send before and after, and the
    solver (``nodewise-milp``, ``nodewise-heuristic``, ``assignment`` or ``none``)."""

    slot_of_bin: np.ndarray
    cross_before: float
    cross_after: float
    max_send_before: float
    max_send_after: float
    method: str
    applied: bool


def _cross(bins: np.ndarray, slot_of_bin: np.ndarray, src: np.ndarray, size: np.ndarray, dest: np.ndarray,
           ranks_per_node: int) -> tuple[float, float]:
    """(total cross-node bytes, largest per-source inter-node send) of one placement."""
    d_node = dest[slot_of_bin[bins]] // ranks_per_node  # (samples, stages)
    per_sample = size * (d_node != (src // ranks_per_node)[:, None]).sum(axis=1)
    if not per_sample.size:
        return 0.0, 0.0
    per_src = np.bincount(src, weights=per_sample)
    return float(per_sample.sum()), float(per_src.max())


def rearrange_round(bins: np.ndarray, slot_of_bin: np.ndarray, src: np.ndarray, size: np.ndarray, dest: np.ndarray,
                    ranks_per_node: int, time_limit: float) -> RoundRearrangement:
    """Permute one round's balanced bins over its slots (module docstring).

    ``bins[s]``: the bin of the round's sample ``s``; ``slot_of_bin[b]``: the local slot the
    policy gave bin ``b``; ``src[s]``: the rank that loaded sample ``s``; ``size[s]``: its payload
    bytes in this phase; ``dest[k, stage]``: the ranks slot ``k`` sends to; ``time_limit``:
    seconds for `nodewise_rearrangement`."""
    r = slot_of_bin.size
    c = ranks_per_node
    before = _cross(bins, slot_of_bin, src, size, dest, c)
    node_of_slot = dest // c
    new, method = None, "none"
    if np.unique(node_of_slot).size > 1:  # all slots on one node: every placement moves the same bytes
        nodes, per_node = np.unique(node_of_slot[:, 0], return_counts=True)
        if r > EXACT_MAX_SLOTS:
            new, method = _greedy(bins, src, size, node_of_slot, c, r), "greedy"
        elif dest.shape[1] == 1 and (per_node == per_node[0]).all():
            new, method = _nodewise(bins, slot_of_bin, src, size, dest[:, 0], c, nodes, int(per_node[0]), time_limit)
        else:
            new, method = _assignment(bins, src, size, node_of_slot, c, r), "assignment"
    if new is not None:
        after = _cross(bins, new, src, size, dest, c)
        if after[0] < before[0] or (after[0] == before[0] and after[1] < before[1]):
            return RoundRearrangement(new, before[0], after[0], before[1], after[1], method, True)
    return RoundRearrangement(slot_of_bin, before[0], before[0], before[1], before[1], method, False)


def _nodewise(bins, slot_of_bin, src, size, dest_rank, c, nodes, per_node, time_limit) -> tuple[np.ndarray, str]:
    """Algorithm 3 on the round: slots ordered by node are its ranks (``per_node`` a node)."""
    r = slot_of_bin.size
    slot_of_pseudo = np.argsort(dest_rank // c, kind="stable")
    pseudo_of_slot = np.empty(r, dtype=np.int64)
    pseudo_of_slot[slot_of_pseudo] = np.arange(r)
    # a loader rank's stand-in: its own slot if it receives one, else its node's first slot
    world = int(max(dest_rank.max(), src.max(initial=0))) + 1
    lut = np.full(world, -1, dtype=np.int64)
    on_slot_node = np.isin(np.arange(world) // c, nodes)
    lut[on_slot_node] = np.searchsorted(nodes, np.arange(world)[on_slot_node] // c) * per_node
    lut[dest_rank[::-1]] = pseudo_of_slot[::-1]  # the first slot of a rank wins
    stand_in = lut[src]
    keep = stand_in >= 0  # loader ranks on nodes without slots send every byte off-node anyway
    vol = np.where(keep, size, 0.0)
    assignment = Assignment(pseudo_of_slot[slot_of_bin[bins]], np.zeros(r))
    plan = nodewise_rearrangement(assignment, np.where(keep, stand_in, 0), vol, per_node, time_limit=time_limit)
    new = slot_of_pseudo[plan.rank_of_batch[pseudo_of_slot[slot_of_bin]]]
    return new, f"nodewise-{plan.method}"


def _held(bins, src, size, node_of_slot, c, r) -> np.ndarray:
    """``held[b, n]``: bytes of bin ``b`` loaded on node ``n``."""
    src_node = src // c
    num_nodes = int(max(node_of_slot.max(), src_node.max(initial=0))) + 1
    return np.bincount(bins * num_nodes + src_node, weights=size, minlength=r * num_nodes).reshape(r, num_nodes)


def _greedy(bins, src, size, node_of_slot, c, r, candidates: int = 3) -> np.ndarray:
    """Large rounds (thousands of slots, where Algorithm 3's dense d x d traffic matrix and the
    d x d assignment take seconds): slots with the same destination nodes form a class; each
    bin's ``candidates`` best classes by the bytes they keep on-node are taken greedily, the
    largest first, while the class has free slots (a 1/2-approximation of the best
    transportation); the other bins fill the free slots in order. O(bins log bins)."""
    classes, class_of_slot = np.unique(node_of_slot, axis=0, return_inverse=True)
    class_of_slot = class_of_slot.reshape(-1)
    held = _held(bins, src, size, node_of_slot, c, r)
    keep = held[:, classes].sum(axis=2)  # (bins, classes): bytes kept on-node, once per stage
    k = min(candidates, classes.shape[0])
    top = np.argpartition(keep, -k, axis=1)[:, -k:] if k < classes.shape[0] else np.tile(np.arange(k), (r, 1))
    value = np.take_along_axis(keep, top, axis=1).ravel()
    pair_bin = np.repeat(np.arange(r), k)
    pair_class = top.ravel()
    order = np.lexsort((pair_class, pair_bin, -value))
    free = np.bincount(class_of_slot, minlength=classes.shape[0]).tolist()
    class_of_bin = np.full(r, -1, dtype=np.int64)
    for b, q, v in zip(pair_bin[order].tolist(), pair_class[order].tolist(), value[order].tolist()):
        if v <= 0.0:
            break
        if class_of_bin[b] < 0 and free[q] > 0:
            class_of_bin[b] = q
            free[q] -= 1
    rest = np.flatnonzero(class_of_bin < 0)
    class_of_bin[rest] = np.repeat(np.arange(len(free)), free)
    # slots of a class in ascending order, to its bins in ascending order
    slot_order = np.argsort(class_of_slot, kind="stable")
    bin_order = np.argsort(class_of_bin, kind="stable")
    new = np.empty(r, dtype=np.int64)
    new[bin_order] = slot_order
    return new


def _assignment(bins, src, size, node_of_slot, c, r) -> np.ndarray:
    """The placement of least total cross-node bytes: bin ``b`` on slot ``k`` keeps on-node the
    bytes of its samples loaded on the nodes of ``k``'s destination ranks (once per stage)."""
    stay = _held(bins, src, size, node_of_slot, c, r)[:, node_of_slot].sum(axis=2)  # (bins, slots)
    rows, cols = linear_sum_assignment(-stay)
    new = np.empty(r, dtype=np.int64)
    new[rows] = cols
    return new


def round_time_limit(total: float, calls: int, start: float) -> float:
    """Each remaining call's share of what is left of ``total`` seconds (started at ``start``),
    at least 1 ms (the heuristic still runs; the MILP is skipped below its minimum)."""
    left = total - (time.perf_counter() - start)
    return max(left / max(calls, 1), 1e-3)
