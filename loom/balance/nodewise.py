"""Algorithm 3 of OrchMLLM, node-wise rearrangement (orchmllm.md §3.10, corrections of §7.6):
permute a balanced plan's batches over ranks so the largest inter-node send is small. A MILP
(SciPy HiGHS, time limit) backed by an assignment heuristic with local search, its gap
certified by a Lagrangian bound."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linear_sum_assignment, milp
from scipy.sparse import csc_array

from loom.balance.assignment import Assignment, _check_num_ranks, _check_workloads


@dataclass(frozen=True)
class NodewisePlan:
    """Result of node-wise rearrangement (section 3.10).

    `rank_of_batch[j]` is the rank that gets new batch j; `assignment` is the balanced
    assignment with batches moved accordingly (same loads, permuted). `max_internode_send` is
    Eq. 5's objective (max over source ranks of volume sent off-node), `identity_max_send` the
    same for the unpermuted plan. `gap` = (objective - lower_bound) / objective, with
    `lower_bound` the best certified bound on the optimum: the MILP's dual bound when the solver
    produced one, the per-node Lagrangian bound of `_nodewise_node_bound` and the per-rank bound
    of `_nodewise_lower_bound`. `method` says which solution won: "milp" or "heuristic".
    """

    rank_of_batch: np.ndarray
    assignment: Assignment
    max_internode_send: float
    identity_max_send: float
    lower_bound: float
    gap: float
    method: str
    milp_status: str
    seconds: float


def _traffic_matrix(source_rank: np.ndarray, batch_of_sample: np.ndarray, volumes: np.ndarray, d: int) -> np.ndarray:
    # V[i, j]: volume that source rank i must send to whichever rank gets new batch j (Alg. 3 l.1-4).
    V = np.zeros((d, d))
    np.add.at(V, (source_rank, batch_of_sample), volumes)
    return V


def _send_volumes(V: np.ndarray, node_of_batch: np.ndarray, c: int) -> np.ndarray:
    # Per source rank, total volume to batches placed on other nodes (Eq. 5).
    node_of_rank = np.arange(V.shape[0]) // c
    on_node = node_of_batch[None, :] == node_of_rank[:, None]
    return V.sum(axis=1) - (V * on_node).sum(axis=1)


def _nodewise_lower_bound(V: np.ndarray, c: int) -> float:
    # Rank i keeps at most its c largest row entries on its own node (its node holds c batches).
    top = -np.sort(-V, axis=1)[:, :c].sum(axis=1)
    return float(max((V.sum(axis=1) - top).max(), 0.0))


def _nodewise_node_bound(V: np.ndarray, c: int, deadline: float, iters: int = 40) -> float:
    """Lower bound on Eq. 5 from each node's Lagrangian relaxation (any multipliers are valid).

    Node n holds some c batches S, shared by its c source ranks. For any weights lam >= 0 on
    those ranks with sum 1, max_i send_i >= sum_i lam_i send_i = lam . rowsum - sum_{j in S}
    (lam V)_j >= lam . rowsum - (sum of the c largest entries of lam V). Unit weights give
    `_nodewise_lower_bound`; better weights couple the ranks that compete for the node's c
    slots, which is where the MILP's LP relaxation gets its strength (the maximum over nodes
    of the best such bound is the LP bound of the per-node relaxation, within a fraction of a
    percent of the full LP bound on the benchmark instances). The weights are improved by
    exponentiated subgradient ascent for up to `iters` steps or until `deadline`; every step's
    value is a valid bound, so stopping early only weakens it.
    """
    d = V.shape[0]
    num_nodes = d // c
    R = V.reshape(num_nodes, c, d)  # R[n, r, j] = V[n * c + r, j]
    rs = R.sum(axis=2)  # (nodes, c): each source rank's total volume
    scale = float(rs.max())
    if scale <= 0:
        return 0.0
    lam = np.full((num_nodes, c), 1.0 / c)
    best = -np.inf
    nodes = np.arange(num_nodes)[:, None]
    rank_idx = np.arange(c)[None, :, None]
    for k in range(iters):
        y = np.matmul(lam[:, None, :], R)[:, 0, :]  # (nodes, d): lam-weighted volume per batch
        top = np.argpartition(y, d - c, axis=1)[:, d - c :]  # the c largest per node
        f = (lam * rs).sum(axis=1) - y[nodes, top].sum(axis=1)
        best = max(best, float(f.max()))
        if time.perf_counter() > deadline:
            break
        g = rs - R[nodes[:, :, None], rank_idx, top[:, None, :]].sum(axis=2)  # subgradient in lam
        lam *= np.exp((c / np.sqrt(k + 1.0) / scale) * g)
        lam /= lam.sum(axis=1, keepdims=True)
    return max(best, 0.0)


def _heuristic_nodes(V: np.ndarray, c: int, deadline: float) -> np.ndarray:
    """Min-sum assignment of batches to node slots (section 6.4 [impl. suggestion]), then a
    swap local search on the bottleneck source rank, since Eq. 5 minimises the max, not the sum."""
    d = V.shape[0]
    num_nodes = d // c
    # G[j, n]: volume of batch j already on node n; maximise the total that stays on-node.
    G = V.reshape(num_nodes, c, d).sum(axis=1).T  # (d batches, nodes)
    rows, cols = linear_sum_assignment(-np.repeat(G, c, axis=1))
    node_of_batch = np.empty(d, dtype=np.int64)
    node_of_batch[rows] = cols // c
    send = _send_volumes(V, node_of_batch, c)
    node_of_rank = np.arange(d) // c
    for _ in range(4 * d):
        if time.perf_counter() > deadline:
            break
        worst = int(np.argmax(send))
        a = node_of_rank[worst]
        best_val, best_swap = float(send.max()), None
        in_a = np.flatnonzero(node_of_batch == a)
        out_a = np.flatnonzero(node_of_batch != a)
        ranks_a = np.arange(a * c, (a + 1) * c)
        # Swapping batch j (on a) with batch k (on node b): ranks of a gain V[:, j] - V[:, k],
        # ranks of b gain V[:, k] - V[:, j]; every other rank is unchanged.
        new_a = (send[ranks_a][:, None, None] + V[np.ix_(ranks_a, in_a)][:, :, None] - V[np.ix_(ranks_a, out_a)][:, None, :]).max(axis=0)
        b_of_k = node_of_batch[out_a]
        ranks_b = b_of_k[:, None] * c + np.arange(c)[None, :]  # (|out_a|, c)
        Vb_k = V[ranks_b, out_a[:, None]]  # (|out_a|, c)
        Vb_j = V[ranks_b[:, :, None], in_a[None, None, :]]  # (|out_a|, c, |in_a|)
        new_b = (send[ranks_b][:, :, None] + Vb_k[:, :, None] - Vb_j).max(axis=1).T  # (|in_a|, |out_a|)
        node_max = send.reshape(num_nodes, c).max(axis=1)
        rest = node_max.copy()
        rest[a] = -np.inf
        # Max over nodes other than a and b: top-2 of the remaining node maxima.
        top2 = np.argsort(-rest)[:2]
        other = np.where(b_of_k == top2[0], rest[top2[1]] if num_nodes > 2 else -np.inf, rest[top2[0]])
        cand = np.maximum(np.maximum(new_a, new_b), other[None, :])
        jj, kk = np.unravel_index(int(np.argmin(cand)), cand.shape)
        if cand[jj, kk] < best_val - 1e-12 * max(best_val, 1.0):
            best_swap = (in_a[jj], out_a[kk])
        if best_swap is None:
            break
        j, k = best_swap
        node_of_batch[j], node_of_batch[k] = node_of_batch[k], node_of_batch[j]
        send = _send_volumes(V, node_of_batch, c)
    return node_of_batch


def _milp_nodes(
    V: np.ndarray, c: int, upper: float, time_limit: float
) -> tuple[np.ndarray | None, float | None, str]:
    """Algorithm 3 as a MILP (section 3.10, corrected shape d x d/c): binary x[j, n] (batch j on
    node n) and t; minimise t s.t. each batch on one node, c batches per node, and for each node
    n and source rank i on n: sum_j V[i, j] (1 - x[j, n]) <= t. The heuristic's value is added as
    t <= upper: SciPy's HiGHS interface takes no initial solution, so the incumbent enters as a
    cutoff instead, pruning every node of the search that cannot beat it."""
    d = V.shape[0]
    num_nodes = d // c
    nv = d * num_nodes + 1  # x[j, n] at j * num_nodes + n, then t
    cost = np.zeros(nv)
    cost[-1] = 1.0
    # Rows: 0..d-1 each batch on exactly one node; d..d+nodes-1 c batches per node; then per
    # source rank i on node n: sum_j V[i,j] x[j,n] + t >= rowsum_i. Built directly in CSC form
    # (column x[j, n]: its batch row, its node row and the c rank rows of node n; column t: the
    # d rank rows), not as a dense (2d + nodes) x (d * nodes) matrix.
    per_col = 2 + c
    idx = np.empty((d, num_nodes, per_col), dtype=np.int32)
    val = np.empty((d, num_nodes, per_col))
    idx[:, :, 0] = np.arange(d)[:, None]
    val[:, :, 0] = 1.0
    idx[:, :, 1] = d + np.arange(num_nodes)[None, :]
    val[:, :, 1] = 1.0
    idx[:, :, 2:] = (d + num_nodes + np.arange(d, dtype=np.int32).reshape(num_nodes, c))[None, :, :]
    val[:, :, 2:] = V.reshape(num_nodes, c, d).transpose(2, 0, 1)  # [j, n, r] = V[n * c + r, j]
    indices = np.concatenate([idx.ravel(), np.arange(d + num_nodes, 2 * d + num_nodes, dtype=np.int32)])
    data = np.concatenate([val.ravel(), np.ones(d)])
    indptr = np.append(np.arange(0, d * num_nodes * per_col + 1, per_col), d * num_nodes * per_col + d)
    A = csc_array((data, indices, indptr.astype(np.int32)), shape=(2 * d + num_nodes, nv))
    A.eliminate_zeros()  # V is sparse: most ranks send to few batches
    lbs = np.concatenate([np.ones(d), np.full(num_nodes, float(c)), V.sum(axis=1)])
    ubs = np.concatenate([np.ones(d), np.full(num_nodes, float(c)), np.full(d, np.inf)])
    integrality = np.ones(nv)
    integrality[-1] = 0
    bounds = Bounds(np.zeros(nv), np.concatenate([np.ones(nv - 1), [upper]]))
    res = milp(
        cost,
        constraints=LinearConstraint(A, lbs, ubs),
        integrality=integrality,
        bounds=bounds,
        options={"time_limit": max(time_limit, 1e-3), "disp": False},
    )
    dual = getattr(res, "mip_dual_bound", None)
    dual = float(dual) if dual is not None and np.isfinite(dual) else None
    if res.x is None:
        return None, dual, str(res.message)
    x = res.x[:-1].reshape(d, num_nodes)
    node_of_batch = np.argmax(x, axis=1).astype(np.int64)
    if np.bincount(node_of_batch, minlength=num_nodes).max() != c:
        return None, dual, "milp returned an inconsistent solution"
    return node_of_batch, dual, str(res.message)


def _place_within_nodes(V: np.ndarray, node_of_batch: np.ndarray, c: int) -> np.ndarray:
    # Section 7.6: placement inside a node is open; keep the most data on its own GPU (c x c Hungarian).
    d = V.shape[0]
    rank_of_batch = np.empty(d, dtype=np.int64)
    for n_ in range(d // c):
        batches = np.flatnonzero(node_of_batch == n_)
        ranks = np.arange(n_ * c, (n_ + 1) * c)
        r_idx, b_idx = linear_sum_assignment(-V[np.ix_(ranks, batches)])
        rank_of_batch[batches[b_idx]] = ranks[r_idx]
    return rank_of_batch


# Time budget of `nodewise_rearrangement` (fractions of what is left of `time_limit`).
_BOUND_SHARE = 0.15  # at most this share of time_limit for the Lagrangian bound (~5 ms at d=128)
_MILP_OVERHEAD_S = 0.02  # HiGHS setup and teardown outside its own time limit
_MILP_OVERRUN_SHARE = 0.25  # and its overrun past the limit, which grows with it and with load
_MILP_MIN_S = 0.005  # below this HiGHS cannot finish presolve; skip the MILP


def nodewise_rearrangement(
    assignment: Assignment,
    source_rank: Sequence[int] | np.ndarray,
    volumes: Sequence[float] | np.ndarray,
    ranks_per_node: int,
    time_limit: float = 0.1,
    use_milp: bool = True,
) -> NodewisePlan:
    """Algorithm 3, node-wise rearrangement (orchmllm.md section 3.10, corrections of 7.6).

    `assignment` is a balanced plan whose rank ids are read as new-batch ids j; any permutation
    of the batches over ranks keeps the balance objective. `source_rank[k]` is where sample k
    lives now and `volumes[k]` its payload size. We choose the permutation minimising the
    maximum per-source-rank inter-node send volume (Eq. 5, inter- not intra-node): a heuristic
    (min-sum assignment + bottleneck swaps) first, then a certified lower bound
    (`_nodewise_node_bound`), then the MILP with the heuristic's value as a cutoff; the better
    solution wins. `time_limit` (seconds) bounds the whole call: the MILP's own limit is what is
    left after the heuristic and the bound, less a reserve for HiGHS's setup and overrun. `gap`
    is measured against the best certified bound (see `NodewisePlan`). Ranks are 0..d-1, node
    of rank r = r // ranks_per_node (homogeneous nodes).
    """
    start = time.perf_counter()
    d = assignment.num_ranks
    c = _check_num_ranks(ranks_per_node, "ranks_per_node")
    if d % c:
        raise ValueError(
            f"ranks_per_node={c} does not divide the {d} ranks; nodes must be homogeneous (pad the mesh)"
        )
    if not np.isfinite(time_limit) or time_limit <= 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit!r}")
    src = np.asarray(source_rank)
    if src.shape != (assignment.num_samples,) or (src.size and not np.issubdtype(src.dtype, np.integer)):
        raise ValueError(
            f"source_rank must hold one int rank per sample ({assignment.num_samples}), got shape {src.shape}"
        )
    if src.size and (src.min() < 0 or src.max() >= d):
        raise ValueError(f"source_rank values must be in [0, {d}); got range [{src.min()}, {src.max()}]")
    vol = _check_workloads(volumes, "volumes")
    if vol.size != assignment.num_samples:
        raise ValueError(f"volumes must have one entry per sample ({assignment.num_samples}), got {vol.size}")
    src = src.astype(np.int64)
    V = _traffic_matrix(src, assignment.rank_of_sample, vol, d)
    identity = float(_send_volumes(V, np.arange(d) // c, c).max())
    deadline = start + time_limit
    if d == c:  # one node: nothing crosses nodes
        nodes, method, status, lower = np.zeros(d, dtype=np.int64), "heuristic", "single node", 0.0
        best = float(_send_volumes(V, nodes, c).max())
    else:
        nodes = _heuristic_nodes(V, c, start + 0.5 * time_limit if use_milp else deadline)
        best = float(_send_volumes(V, nodes, c).max())
        method, status = "heuristic", "not run"
        # A certified lower bound for the gap: the per-rank bound, raised by the per-node
        # Lagrangian bound (about the LP relaxation's) within a small share of the budget.
        lower = min(
            best,
            max(
                _nodewise_lower_bound(V, c),
                _nodewise_node_bound(V, c, min(deadline, time.perf_counter() + _BOUND_SHARE * time_limit)),
            ),
        )
        # HiGHS's time limit covers its own run only: model hand-over, presolve steps that do not
        # check the clock and the result's read-back come on top (10-40 ms at d=128 on the
        # 2-core machine, more under load). Reserve that so the whole call keeps `time_limit`.
        remaining = deadline - time.perf_counter()
        milp_limit = remaining - (_MILP_OVERHEAD_S + _MILP_OVERRUN_SHARE * remaining)
        if use_milp and milp_limit >= _MILP_MIN_S and best > lower:
            milp_nodes, dual, status = _milp_nodes(V, c, best, milp_limit)
            if dual is not None:
                lower = max(lower, min(dual, best))
            if milp_nodes is not None:
                val = float(_send_volumes(V, milp_nodes, c).max())
                if val < best:
                    nodes, best, method = milp_nodes, val, "milp"
                    lower = min(lower, best)
    rank_of_batch = _place_within_nodes(V, nodes, c)
    new_rank = rank_of_batch[assignment.rank_of_sample]
    loads = np.empty(d)
    loads[rank_of_batch] = assignment.loads
    gap = (best - lower) / best if best > 0 else 0.0
    return NodewisePlan(
        rank_of_batch=rank_of_batch,
        assignment=Assignment(new_rank, loads),
        max_internode_send=best,
        identity_max_send=identity,
        lower_bound=lower,
        gap=float(max(gap, 0.0)),
        method=method,
        milp_status=status,
        seconds=time.perf_counter() - start,
    )
