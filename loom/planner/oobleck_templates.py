"""Oobleck's pipeline templates: the GPU-stage mapping of one model replica for every node count
(oobleck.md §3.3, Eqs. 2.1-2.4), searched exactly and shared across template sizes.

A template for ``n`` nodes of ``M`` GPUs is a sequence of stages, each a contiguous run of
layers ``[b[s], b[s+1])`` on ``g_s`` GPUs of one node (a stage never spans nodes, §3.3's
"Conquer" rule), the stages filling every GPU of the ``n`` nodes in order. Several GPUs in a
stage run it tensor-parallel, priced by the per-layer costs `LayerTimes` holds for each GPU
count (loom's TP scaling, `loom.planner.oobleck_costs`).

**The objective** (gaps G5, G6 of oobleck.md §7). A stage's time per microbatch is
``t_s = F_s + B_s`` (Eq. 2.4's sums). A 1F1B pipeline's iteration over ``N_b`` microbatches is
priced as ``T = sum_s t_s + (N_b - 1) max_s t_s``: the critical path through the slowest stage
(fill and drain of the others plus ``N_b`` microbatches of the bottleneck). For uniform stages it
is the ``(N_b + S - 1)(F + B)`` that the paper's ``T1 + T2 + T3`` also gives; for uneven stages
the paper's T3 counts the stages after ``k*`` twice (once in T1), which we do not. The same
affine model ``T(N_b) = fill + N_b * bottleneck`` prices the batch distribution
(`loom.balance.oobleck`), so templates are compared and loaded under one cost model (G5).

**The search.** The paper's divide and conquer memoises only the fastest result per
subproblem, which is not exact (T depends on the sum *and* the maximum; G6: 1 in 300 random
cases suboptimal). We keep its structure, a memo over (layers consumed, GPUs consumed) shared by
every template size, but make it exact: for a cap ``tau`` on the stage time, a dynamic program
over GPU positions finds the least ``sum_s t_s`` with every ``t_s <= tau`` (stages may not
cross a node boundary), for *all* node counts at once; then ``min_tau (D(tau) + (N_b - 1) tau)``
over the candidate caps (every distinct stage time) is the optimum, since the optimal plan's
own maximum is one of them. The caps are searched by interval bisection with the bound
``D(tau_hi) + (N_b - 1) tau_lo`` (``D`` does not increase with ``tau``), which prunes all but a
few; every program is NumPy min-plus over ``(L+1)`` x ``(L+1)`` stage-time matrices, and the
tables of one cap serve every template size (the paper's cross-template memo reuse, §4.4).

``N_b`` at planning time (G5): ``planning_microbatches``, by default GPipe's ``4 x`` the
largest stage count the template can have (``4 S`` of the text for one GPU per node).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


class TemplateError(ValueError):
    """No template fits the request; the message names the numbers and the fix."""


@dataclass(frozen=True)
class LayerTimes:
    """Per-layer seconds for one microbatch: ``forward[g][l]`` and ``backward[g][l]`` with layer
    ``l`` on ``g`` GPUs (tensor-parallel), for each GPU count ``g`` a stage may have, and
    ``first_stage[g]``: the forward plus backward of the encoders a first stage hosts
    (``placement = "first_stage"``), added to whichever stage holds layer 0."""

    forward: Mapping[int, Sequence[float]]
    backward: Mapping[int, Sequence[float]]
    first_stage: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.forward:
            raise TemplateError("LayerTimes.forward is empty: give per-layer times for at least one GPU count")
        if set(self.forward) != set(self.backward):
            raise TemplateError(f"LayerTimes: forward has GPU counts {sorted(self.forward)} but backward has "
                                f"{sorted(self.backward)}; give both for the same counts")
        lengths = {len(v) for v in self.forward.values()} | {len(v) for v in self.backward.values()}
        if len(lengths) != 1 or 0 in lengths:
            raise TemplateError(f"LayerTimes: every GPU count needs one time per layer; got lengths {sorted(lengths)}")
        for g in self.forward:
            if not isinstance(g, int) or g < 1:
                raise TemplateError(f"LayerTimes: GPU count {g!r} must be a positive integer")
            for what in (self.forward[g], self.backward[g]):
                if not all(math.isfinite(x) and x >= 0 for x in what):
                    raise TemplateError(f"LayerTimes: times for {g} GPUs must be finite and non-negative")

    @property
    def num_layers(self) -> int:
        return len(next(iter(self.forward.values())))

    @property
    def gpu_counts(self) -> tuple[int, ...]:
        return tuple(sorted(self.forward))

    def layer_total(self, g: int) -> np.ndarray:
        return np.asarray(self.forward[g], dtype=float) + np.asarray(self.backward[g], dtype=float)

    def stage_time(self, lo: int, hi: int, g: int) -> float:
        """``F_s + B_s`` of layers ``[lo, hi)`` on ``g`` GPUs (Eq. 2.4), hosted encoders included."""
        return float(self.layer_total(g)[lo:hi].sum()) + (self.first_stage.get(g, 0.0) if lo == 0 else 0.0)


@dataclass(frozen=True)
class PipelineTemplate:
    """One pipeline specification (oobleck.md §2.2): ``num_nodes`` nodes of ``gpus_per_node``
    GPUs; stage ``s`` holds layers ``[stage_boundaries[s], stage_boundaries[s+1])`` on
    ``stage_gpus[s]`` GPUs; ``stage_times[s]`` is its ``F + B`` per microbatch."""

    num_nodes: int
    gpus_per_node: int
    stage_boundaries: tuple[int, ...]
    stage_gpus: tuple[int, ...]
    stage_times: tuple[float, ...]
    planning_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_gpus)

    @property
    def bottleneck(self) -> float:
        """The slowest stage's time per microbatch: each further microbatch costs this."""
        return max(self.stage_times)

    @property
    def fill(self) -> float:
        """``sum_s t_s - max_s t_s``: the fill and drain around the bottleneck's microbatches."""
        return sum(self.stage_times) - self.bottleneck

    def time(self, num_microbatches: int) -> float:
        """1F1B iteration time over ``num_microbatches`` (module docstring's objective)."""
        return self.fill + num_microbatches * self.bottleneck

    @property
    def iteration_time(self) -> float:
        """The objective the search minimised: `time` at ``planning_microbatches``."""
        return self.time(self.planning_microbatches)

    @property
    def tensor_parallel(self) -> int | None:
        """The one GPU count of every stage, or ``None`` if stages differ (not a loom `Plan`)."""
        return self.stage_gpus[0] if len(set(self.stage_gpus)) == 1 else None

    def stage_placement(self) -> list[tuple[int, int]]:
        """Per stage, ``(node index in the pipeline, first local GPU)``: stages fill nodes in order."""
        out, position = [], 0
        for g in self.stage_gpus:
            node, local = divmod(position, self.gpus_per_node)
            out.append((node, local))
            position += g
        return out

    def stage_of_layer(self, layer: int) -> int:
        for s in range(self.num_stages):
            if self.stage_boundaries[s] <= layer < self.stage_boundaries[s + 1]:
                return s
        raise IndexError(f"layer {layer} is outside the template's {self.stage_boundaries[-1]} layers")


def default_planning_microbatches(num_nodes: int, gpus_per_node: int, smallest_stage: int, num_layers: int) -> int:
    """GPipe's ``N_b = 4 S`` (oobleck.md §3.3) at the largest stage count the template can have."""
    return 4 * min(num_layers, num_nodes * gpus_per_node // smallest_stage)


class _CapPrograms:
    """The min-sum programs of one set of stage-time matrices, per cap, cached: the memo every
    template size shares (module docstring)."""

    def __init__(self, costs: dict[int, np.ndarray], gpus_per_node: int, max_positions: int) -> None:
        self.costs = costs  # g -> (L+1, L+1) stage times, inf where v <= u
        self.M = gpus_per_node
        self.P = max_positions
        self.L = next(iter(costs.values())).shape[0] - 1
        self._cache: dict[float, np.ndarray] = {}

    def ends(self, tau: float) -> np.ndarray:
        """``D[p]``: the least sum of stage times covering all ``L`` layers with exactly ``p`` GPUs
        (stages within nodes, each ``<= tau``), for every ``p`` (``inf``: none)."""
        kept = self._cache.get(tau)
        if kept is None:
            kept = self._cache[tau] = self._program(tau)[0][:, self.L]
        return kept

    def _program(self, tau: float, backpointers: bool = False):
        L, M, P = self.L, self.M, self.P
        capped = {g: np.where(c <= tau, c, np.inf) for g, c in self.costs.items()}
        table = np.full((P + 1, L + 1), np.inf)
        table[0, 0] = 0.0
        back = np.full((P + 1, L + 1, 2), -1, dtype=np.int64) if backpointers else None
        for p in range(P):
            row = table[p]
            if not np.isfinite(row).any():
                continue
            room = M - p % M  # GPUs left in this node
            for g, c in capped.items():
                if g > room or p + g > P:
                    continue
                candidates = row[:, None] + c  # from u (rows) to v (columns)
                if backpointers:
                    u = candidates.argmin(axis=0)
                    best = candidates[u, np.arange(L + 1)]
                    better = best < table[p + g]
                    table[p + g] = np.where(better, best, table[p + g])
                    back[p + g][better] = np.stack([u[better], np.full(better.sum(), g)], axis=1)
                else:
                    np.minimum(table[p + g], candidates.min(axis=0), out=table[p + g])
        return table, back

    def stages(self, tau: float, positions: int) -> list[tuple[int, int, int]]:
        """The stages ``(lo, hi, g)`` of the least-sum plan for ``positions`` GPUs under ``tau``."""
        table, back = self._program(tau, backpointers=True)
        out, p, v = [], positions, self.L
        while p > 0:
            u, g = back[p, v]
            out.append((int(u), int(v), int(g)))
            p, v = p - int(g), int(u)
        if v != 0:
            raise AssertionError("template reconstruction did not reach layer 0")
        return out[::-1]


def _stage_matrices(times: LayerTimes, gpu_counts: Sequence[int]) -> dict[int, np.ndarray]:
    L = times.num_layers
    out = {}
    for g in gpu_counts:
        prefix = np.concatenate(([0.0], np.cumsum(times.layer_total(g))))
        c = prefix[None, :] - prefix[:, None]  # c[u, v] = sum of layers [u, v)
        c[0, :] += times.first_stage.get(g, 0.0)
        c[np.tril_indices(L + 1)] = np.inf  # a stage holds at least one layer
        out[g] = c
    return out


def _best_cap(programs: _CapPrograms, caps: np.ndarray, positions: int, weight: float) -> tuple[float, float]:
    """``min over caps of D(cap) + weight * cap`` for ``positions`` GPUs, exact (module docstring):
    interval bisection over the sorted caps, pruning an interval ``[i, j]`` whose bound
    ``D(caps[j]) + weight * caps[i]`` cannot beat the best found. Returns ``(objective, cap)``."""
    value = lambda k: programs.ends(float(caps[k]))[positions]
    best = (math.inf, math.inf)

    def consider(k: int) -> float:
        nonlocal best
        d = value(k)
        total = d + weight * float(caps[k])
        if total < best[0] or (total == best[0] and caps[k] < best[1]):
            best = (total, float(caps[k]))
        return d

    hi = len(caps) - 1
    if not math.isfinite(consider(hi)):
        return best
    stack = [(0, hi, None, value(hi))]
    while stack:
        i, j, d_i, d_j = stack.pop()
        if d_i is None:
            d_i = consider(i)
        if d_j + weight * float(caps[i]) >= best[0]:
            continue  # nothing in [i, j] can beat the best
        if j - i <= 1:
            continue  # both ends considered
        if d_i == d_j:
            continue  # D is flat on [i, j]: the smallest cap i is best there, and it was considered
        mid = (i + j) // 2
        d_mid = consider(mid)
        stack.append((mid, j, d_mid, d_j))
        stack.append((i, mid, d_i, d_mid))
    return best


def plan_templates(
    times: LayerTimes,
    node_counts: Sequence[int],
    gpus_per_node: int,
    *,
    tensor_parallel: str | int = "uniform",
    planning_microbatches: int | Mapping[int, int] | None = None,
) -> dict[int, PipelineTemplate]:
    """The fastest template for each node count of ``node_counts`` (oobleck.md §3.3), sharing
    every memoised program across them.

    ``tensor_parallel`` chooses the GPU counts a stage may have:

    - ``"uniform"`` (the default): every stage of a template on the same ``t`` GPUs, ``t`` one
      of `LayerTimes.gpu_counts` that divides ``gpus_per_node``; the best ``t`` per size wins.
      These are the templates loom's runtime executes (one TP degree per module in a `Plan`,
      `template_plan`).
    - ``"mixed"``: the paper's search, stages of any GPU count of `LayerTimes.gpu_counts` up to
      a node, mixed within a template. Such templates are priced but not executable by loom
      (`loom.planner.oobleck.template_plan` refuses a template with unequal stages).
    - an integer ``t``: uniform at that degree only.

    ``planning_microbatches``: the ``N_b`` of the objective, one number or one per node count;
    default `default_planning_microbatches`.
    """
    M = gpus_per_node
    if not isinstance(M, int) or M < 1:
        raise TemplateError(f"gpus_per_node = {M!r}: must be a positive integer")
    sizes = sorted(set(node_counts))
    if not sizes or sizes[0] < 1:
        raise TemplateError(f"node_counts = {list(node_counts)}: give node counts of at least 1")
    L = times.num_layers
    usable = [g for g in times.gpu_counts if g <= M]
    if tensor_parallel == "mixed":
        groups = [tuple(usable)]
    elif tensor_parallel == "uniform":
        groups = [(t,) for t in usable if M % t == 0]
    elif isinstance(tensor_parallel, int) and not isinstance(tensor_parallel, bool):
        if tensor_parallel not in usable or M % tensor_parallel:
            raise TemplateError(f"tensor_parallel = {tensor_parallel}: must divide gpus_per_node = {M} and be one of "
                                f"the GPU counts the layer times cover, {list(times.gpu_counts)}")
        groups = [(tensor_parallel,)]
    else:
        raise TemplateError(f"tensor_parallel = {tensor_parallel!r}: choose 'uniform', 'mixed' or a TP degree")
    if not groups or not groups[0]:
        raise TemplateError(f"no stage GPU count of {list(times.gpu_counts)} fits a node of {M} GPUs "
                            f"(uniform stages need a divisor of {M})")

    def nb(n: int) -> int:
        if planning_microbatches is None:
            return default_planning_microbatches(n, M, min(min(g) for g in groups), L)
        value = planning_microbatches[n] if isinstance(planning_microbatches, Mapping) else planning_microbatches
        if value < 1:
            raise TemplateError(f"planning_microbatches = {value} for {n} nodes: must be at least 1")
        return value

    best: dict[int, tuple[float, tuple[int, ...], float]] = {}  # n -> (objective, group, cap)
    programs: dict[tuple[int, ...], _CapPrograms] = {}
    for group in groups:
        costs = _stage_matrices(times, group)
        programs[group] = prog = _CapPrograms(costs, M, sizes[-1] * M)
        caps = np.unique(np.concatenate([c[np.isfinite(c)] for c in costs.values()]))
        for n in sizes:
            objective, cap = _best_cap(prog, caps, n * M, nb(n) - 1)
            if objective < best.get(n, (math.inf,))[0]:
                best[n] = (objective, group, cap)
    out = {}
    for n in sizes:
        if n not in best:
            raise TemplateError(
                f"no template for {n} nodes x {M} GPUs with {L} layers: every stage needs a layer and its own GPUs "
                f"(at most {L} stages, stage GPU counts {[list(g) for g in groups]}); use fewer nodes per pipeline "
                f"or tensor_parallel='mixed'/a larger TP degree")
        _, group, cap = best[n]
        stages = programs[group].stages(cap, n * M)
        out[n] = PipelineTemplate(
            num_nodes=n, gpus_per_node=M,
            stage_boundaries=tuple([stages[0][0]] + [hi for _, hi, _ in stages]),
            stage_gpus=tuple(g for _, _, g in stages),
            stage_times=tuple(times.stage_time(lo, hi, g) for lo, hi, g in stages),
            planning_microbatches=nb(n))
    return out
