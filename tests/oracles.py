"""Exhaustive oracles for the balancing tests (small instances only)."""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

from loom.balance.assignment import Assignment, _check_num_ranks
from loom.balance.nodewise import _send_volumes, _traffic_matrix
from loom.plan.plan import LLM


def brute_force_balance(
    num_samples: int, num_ranks: int, rank_cost: Callable[[np.ndarray], np.ndarray], max_states: int = 2_000_000
) -> Assignment:
    """Exhaustive optimum over all d^n assignments (test oracle).

    `rank_cost(rank_of_sample)` returns per-rank loads for one assignment; e.g.
    `lambda a: padded_loads(lengths, a, d)`. Ties: the first minimum in lexicographic order.
    """
    num_ranks = _check_num_ranks(num_ranks)
    if num_ranks**num_samples > max_states:
        raise ValueError(
            f"brute force over {num_ranks}^{num_samples} assignments exceeds max_states={max_states}; "
            "use a smaller instance"
        )
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for combo in itertools.product(range(num_ranks), repeat=num_samples):
        a = np.asarray(combo, dtype=np.int64)
        loads = rank_cost(a)
        m = float(loads.max()) if loads.size else 0.0
        if best is None or m < best[0]:
            best = (m, a, loads)
    assert best is not None
    return Assignment(best[1], np.asarray(best[2], dtype=np.float64))



def nodewise_brute_force(
    assignment: Assignment, source_rank: Sequence[int] | np.ndarray, volumes: Sequence[float] | np.ndarray, ranks_per_node: int
) -> float:
    """Exact optimum of Eq. 5 over all d! batch-to-rank permutations (test oracle, d <= 8)."""
    d = assignment.num_ranks
    if d > 8:
        raise ValueError(f"brute force over {d}! permutations is too large; use d <= 8")
    V = _traffic_matrix(np.asarray(source_rank, dtype=np.int64), assignment.rank_of_sample, np.asarray(volumes, float), d)
    best = math.inf
    for perm in itertools.permutations(range(d)):
        node_of_batch = np.asarray(perm) // ranks_per_node
        best = min(best, float(_send_volumes(V, node_of_batch, ranks_per_node).max()))
    return best


def cross_node_send(plan, layout, phase: str, sample_bytes, ranks_per_node: int, permuted: bool = True,
                    world_size: int | None = None) -> np.ndarray:
    """Per source rank, the bytes of ``phase`` it sends to ranks of other nodes (orchmllm.md
    §3.10, Eq. 5's per-rank term): the off-node entries of each row of the full ``world x
    world`` matrix (`loom.balance.payload.payload_matrix`), node of rank r = r // ranks_per_node."""
    from loom.balance.payload import payload_matrix

    matrix = payload_matrix(plan, layout, phase, sample_bytes, permuted, world_size)
    node = np.arange(matrix.shape[0]) // ranks_per_node
    return (matrix * (node[:, None] != node[None, :])).sum(axis=1)


def critical_load(layout, plan, costs, llm_padded: bool = True) -> dict[str, float]:
    """Per phase, the sum over rounds (one microbatch of every replica, which the replicas run
    in step) of the round's slowest slot, a slot costing the sum of its samples' costs, or for a
    right-padded LLM its row count times its longest row's cost (test oracle: a load measure
    that, with one replica, is the phase's total work whatever the layout, which is why
    `make_layout` compares layouts by their predicted step time, `loom.balance.predict`)."""
    m = layout.num_microbatches
    out = {}
    for phase in layout.arrays:
        idx = layout.slot_index(phase)
        if phase == LLM and llm_padded:
            peak = np.zeros(m)
            np.maximum.at(peak, idx, costs.llm_padded_weight())
            per_slot = np.bincount(idx, minlength=m) * peak
        else:
            per_slot = np.bincount(idx, weights=costs.work[phase], minlength=m)
        dp = plan.spec(phase).data_parallel
        rounds = -(-m // dp)
        padded_slots = np.zeros(rounds * dp)
        padded_slots[:m] = per_slot
        out[phase] = float(padded_slots.reshape(rounds, dp).max(axis=1).sum())
    return out
