"""Frozen-aware stage partitioning and the loosely-coupled multimodal stage search.

Three pieces, all pure functions over per-layer costs (docs/architecture.md principle 4):

- `frozen_aware_layer_costs`: the per-layer cost ``T_l = F_l + B_l (+ R_l)`` of one forward
  plus one backward under each layer's frozen status and position (``cornstarch.md`` §3.2.2,
  eqs. 3.1-3.3 and the cross-modality rule; recomputation as in §3.2.1).
- `partition`: the contiguous min-bottleneck split of one module's layers into stages, the
  dynamic program of eq. 3.5 (``cornstarch.md`` §3.2.2, "Partitioner [D §3.4.1]"), with
  `brute_force_partition` as its exact oracle.
- `loosely_coupled_search`: Cornstarch's Algorithm 1 (``cornstarch.md`` §2.6), which picks each
  module's stage count for a device budget: every candidate LLM depth fixes a target stage time
  that each encoder then matches with as few stages as possible, and a caller-supplied
  iteration-time function (a simulator run) ranks the candidates.

`frozen_aware_boundaries` and `plan_with_stage_counts` write the results into a `Plan`. This
module only needs per-layer numbers, so it sits below `loom.sim`: the search receives the
simulator as a callable instead of importing it.
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from loom.cost.frozen import needs_from_flags
from loom.plan.plan import LLM, RECOMPUTE_MODES, Plan, PlanError

# Two split candidates whose bottlenecks differ by less than this fraction of the module's total
# cost are treated as tied: prefix sums make equal-valued splits differ in the last bits, and
# without a tolerance the tie-breaking rule would depend on rounding noise.
TIE_TOLERANCE = 1e-9


# ---- frozen-aware per-layer costs ---------------------------------------------------------------


@dataclass(frozen=True)
class LayerCost:
    """One layer's share of a training step (cornstarch.md §3.2.2, eqs. 3.1-3.2).

    ``backward_weight`` is counted only for a trainable layer, ``backward_input`` only when the
    layer has trainable parameters at or before it (``p(L_l)``, eq. 3.3), ``recompute`` (one more
    forward, or under ``selective`` its attention core's) only under activation recomputation and
    only when some backward runs (§3.2.1).
    """

    forward: float
    backward_weight: float
    backward_input: float
    recompute: float
    trainable: bool
    backpropagates: bool  # p(L_l)

    @property
    def backward(self) -> float:
        """``B_l = B_w + B_d`` as counted (eq. 3.1), plus the recomputed forward."""
        return self.backward_weight + self.backward_input + self.recompute

    @property
    def total(self) -> float:
        """``T_l``: what the partitioner balances."""
        return self.forward + self.backward


def _check_layer_list(what: str, name: str, values: Sequence[float], length: int | None) -> list[float]:
    out = [float(v) for v in values]
    if length is not None and len(out) != length:
        raise ValueError(f"{what}[{name!r}] has {len(out)} entries; forward[{name!r}] has {length}")
    for i, v in enumerate(out):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{what}[{name!r}][{i}] = {v}: layer costs must be finite and non-negative")
    return out


def frozen_aware_layer_breakdown(
    forward: Mapping[str, Sequence[float]],
    backward_input: Mapping[str, Sequence[float]],
    backward_weight: Mapping[str, Sequence[float]],
    trainable: Mapping[str, Sequence[bool]],
    module_order: Sequence[str],
    recompute: Mapping[str, str] | str = "none",
    reads_data: Mapping[str, Sequence[bool]] | None = None,
    attention_forward: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, list[LayerCost]]:
    """Per module, per layer: the (F, B_w, B_d, R) that `frozen_aware_layer_costs` sums.

    ``module_order`` lists the encoders in graph order and then, if present, ``"llm"`` (last).
    Each encoder's list covers its whole chain (encoder layers, then projector layers). The
    arguments ``forward``, ``backward_input`` and ``backward_weight`` hold the *profiled* (or
    analytic) times of each phase as if it ran; this function decides which phases do run:

    - ``p`` propagates along each encoder chain from ``False`` (eq. 3.3: ``p(L_l) = p(L_{l-1})
      or not f(L_l)``, so a trainable layer counts its own input gradient, as the equation
      states; see `cornstarch.md` §8 item 3 for the stricter alternative, not taken here);
    - the LLM's chain starts from the OR over the encoders' final ``p`` (the cross-modality
      rule: a trainable encoder makes every LLM layer back-propagate, since the LLM sits after
      it);
    - ``recompute`` (one `ModuleSpec.recompute` mode for all modules, or one per module; a
      missing module means ``"none"``): ``"full"`` adds one forward to every layer that has any
      backward, ``"selective"`` the layer's attention-core forward from ``attention_forward``
      (per module, per layer; 0 for layers without attention);
    - ``reads_data`` (optional, per layer) marks layers that read raw data (front-ends, the
      token embedding): they take ``B_d`` only when something strictly before them is
      trainable, the refinement of `loom.cost.frozen` that matches autograd.

    The rule itself is `loom.cost.frozen.needs_from_flags`, shared with the cost models.
    """
    names = list(module_order)
    if len(set(names)) != len(names):
        raise ValueError(f"module_order names a module twice: {names}")
    if LLM in names and names[-1] != LLM:
        raise ValueError(f"module_order must end with {LLM!r} (encoders first, in graph order); got {names}")
    for what, table in (("forward", forward), ("backward_input", backward_input),
                        ("backward_weight", backward_weight), ("trainable", trainable)):
        missing = [n for n in names if n not in table]
        if missing:
            raise ValueError(f"{what} has no entry for {missing}; module_order is {names}")
        extra = [n for n in table if n not in names]
        if extra:
            raise ValueError(f"{what} has modules {extra} that module_order = {names} does not list")
    if isinstance(recompute, str):
        recompute_of = {n: recompute for n in names}
    else:
        extra = [n for n in recompute if n not in names]
        if extra:
            raise ValueError(f"recompute has modules {extra} that module_order = {names} does not list")
        recompute_of = {n: recompute.get(n, "none") for n in names}
    for n, mode in recompute_of.items():
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute[{n!r}] = {mode!r}: use one of {list(RECOMPUTE_MODES)}")
        if mode == "selective" and (attention_forward is None or n not in attention_forward):
            raise ValueError(f'recompute[{n!r}] = "selective" needs attention_forward[{n!r}], the attention '
                             f"core's forward time per layer")

    checked: dict[str, tuple[list[float], list[float], list[float], list[bool]]] = {}
    again_of: dict[str, list[float]] = {}  # per layer, the forward recomputed in backward
    for name in names:
        fwd = _check_layer_list("forward", name, forward[name], None)
        n = len(fwd)
        b_in = _check_layer_list("backward_input", name, backward_input[name], n)
        b_w = _check_layer_list("backward_weight", name, backward_weight[name], n)
        train = [bool(t) for t in trainable[name]]
        if len(train) != n:
            raise ValueError(f"trainable[{name!r}] has {len(train)} entries; forward[{name!r}] has {n}")
        checked[name] = (fwd, b_in, b_w, train)
        if recompute_of[name] == "selective":
            again_of[name] = _check_layer_list("attention_forward", name, attention_forward[name], n)
        elif recompute_of[name] == "full":
            again_of[name] = fwd
        else:
            again_of[name] = [0.0] * n
    # the one frozen-aware rule (eqs. 3.2-3.3, the cross-modality start of the LLM's chain)
    needs = needs_from_flags({name: checked[name][3] for name in names}, reads_data)
    out: dict[str, list[LayerCost]] = {}
    for name in names:
        fwd, b_in, b_w, train = checked[name]
        layers = []
        for f, r, bd, bw, t, need in zip(fwd, again_of[name], b_in, b_w, train, needs[name]):
            weight = bw if need.weight else 0.0
            data = bd if need.input else 0.0
            again = r if weight + data > 0 else 0.0
            layers.append(LayerCost(f, weight, data, again, t, need.input))
        out[name] = layers
    return out


def frozen_aware_layer_costs(
    forward: Mapping[str, Sequence[float]],
    backward_input: Mapping[str, Sequence[float]],
    backward_weight: Mapping[str, Sequence[float]],
    trainable: Mapping[str, Sequence[bool]],
    module_order: Sequence[str],
    recompute: Mapping[str, str] | str = "none",
    reads_data: Mapping[str, Sequence[bool]] | None = None,
    attention_forward: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, list[float]]:
    """Per module, the per-layer ``T_l = F_l + B_w + B_d + R`` to balance (cornstarch.md §3.2.2,
    eqs. 3.1-3.3 and the pseudocode ``layer_costs``). See `frozen_aware_layer_breakdown` for
    the rules and for the parts of each ``T_l``."""
    breakdown = frozen_aware_layer_breakdown(forward, backward_input, backward_weight, trainable,
                                             module_order, recompute, reads_data, attention_forward)
    return {name: [layer.total for layer in layers] for name, layers in breakdown.items()}


# ---- the partitioner (eq. 3.5) ------------------------------------------------------------------


def _check_costs(costs: Sequence[float], num_stages: int | None) -> np.ndarray:
    arr = np.asarray(costs, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"costs must be a flat list of per-layer costs; got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("costs is empty: a module needs at least one layer to partition")
    bad = np.flatnonzero(~(np.isfinite(arr) & (arr >= 0)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"costs[{i}] = {arr[i]}: layer costs must be finite and non-negative")
    if num_stages is not None:
        try:
            num_stages = operator.index(num_stages)
        except TypeError:
            raise ValueError(f"num_stages = {num_stages!r}: must be an integer") from None
        if not 1 <= num_stages <= arr.size:
            raise ValueError(
                f"num_stages = {num_stages}: must be between 1 and len(costs) = {arr.size} "
                f"(every stage holds at least one layer)"
            )
    return arr


class _StageTable:
    """The table ``D(i, s)`` of eq. 3.5 for one module, for every stage count up to
    ``max_stages`` at once (Algorithm 1 asks one module for many stage counts; one table
    answers them all).

    ``D(i, s)`` is the least bottleneck of splitting layers ``0..i-1`` into ``s`` non-empty
    contiguous stages. Row ``s`` is computed from row ``s-1`` as an ``(N+1) x (N+1)`` array
    (``i`` by ``j``), so the whole table costs O(N^2 S) arithmetic in O(S) numpy calls.

    Tie-breaking: among the splits ``j`` within the tolerance of the minimum, the *earliest*
    ``j`` wins, i.e. the last stage is as long as possible, and the prefix is split by the same
    rule. Equal-cost plans thus put spare layers in later stages: under 1F1B an earlier stage
    keeps more microbatches' activations alive, so later stages are the cheaper place for them.
    """

    def __init__(self, costs: np.ndarray, max_stages: int):
        n = costs.size
        self.costs = costs
        self.num_layers = n
        prefix = np.zeros(n + 1)
        np.cumsum(costs, out=prefix[1:])
        self.prefix = prefix
        tolerance = TIE_TOLERANCE * prefix[-1]
        index = np.arange(n + 1)
        span = prefix[:, None] - prefix[None, :]  # span[i, j] = P_i - P_j, the last stage's cost
        later = index[None, :] >= index[:, None]  # j >= i would leave the last stage empty
        best = np.full((max_stages + 1, n + 1), np.inf)
        choice = np.full((max_stages + 1, n + 1), -1, dtype=np.int64)
        best[1, 1:] = prefix[1:]  # D(i, 1) = P_i; D(0, 1) stays inf (an empty stage)
        rows = np.arange(n + 1)
        for s in range(2, max_stages + 1):
            # D(j, s-1) is inf for j < s-1, which enforces s-1 <= j by itself.
            candidate = np.maximum(best[s - 1][None, :], span)
            candidate[later] = np.inf
            low = candidate.min(axis=1)
            reachable = np.isfinite(low)
            first = np.argmax(candidate <= (low + tolerance)[:, None], axis=1)
            best[s] = np.where(reachable, candidate[rows, first], np.inf)
            choice[s] = np.where(reachable, first, -1)
        self.choice = choice

    def boundaries(self, num_stages: int) -> list[int]:
        """Backtrack from ``(N, num_stages)``: the split ``j*`` stored at ``(i, s)`` makes layers
        ``j*..i-1`` the last stage; recurse on ``(j*, s-1)`` until ``s = 1``."""
        cuts = [self.num_layers]
        i = self.num_layers
        for s in range(num_stages, 1, -1):
            i = int(self.choice[s, i])
            cuts.append(i)
        cuts.append(0)
        return cuts[::-1]

    def bottleneck(self, num_stages: int) -> float:
        return stage_bottleneck(self.costs, self.boundaries(num_stages))


def stage_bottleneck(costs: Sequence[float], boundaries: Sequence[int]) -> float:
    """The largest stage cost of a split: ``max_s sum(costs[b[s]:b[s+1]])``, summed exactly
    (``math.fsum``) so that results compare across methods without rounding noise."""
    c = [float(x) for x in costs]
    return max(math.fsum(c[boundaries[s]:boundaries[s + 1]]) for s in range(len(boundaries) - 1))


def partition(costs: Sequence[float], num_stages: int) -> tuple[list[int], float]:
    """Split layers with per-layer costs ``costs`` into ``num_stages`` contiguous, non-empty
    stages minimising the most expensive stage (cornstarch.md §3.2.2, eq. 3.5):

    ``D(i, 1) = P_i``; ``D(i, s) = min_{s-1 <= j < i} max(D(j, s-1), P_i - P_j)``, with
    ``P_i`` the cost of layers ``0..i-1``. Returns ``(boundaries, bottleneck)``: boundaries in
    `Plan` form (``[0, b1, ..., N]``, ``num_stages + 1`` entries, strictly increasing) and the
    cost of the most expensive stage.

    Ties (splits within ``TIE_TOLERANCE`` of the total cost of each other) go to the earliest
    split: the last stage is as long as possible and the rest is split by the same rule. The
    recurrence does not know which layers are frozen; frozen status lives in the costs
    (`frozen_aware_layer_costs`). O(N^2 S) time, O(N^2) memory.
    """
    arr = _check_costs(costs, num_stages)
    table = _StageTable(arr, num_stages)
    bounds = table.boundaries(num_stages)
    return bounds, stage_bottleneck(arr, bounds)


def brute_force_partition(costs: Sequence[float], num_stages: int) -> tuple[list[int], float]:
    """Exact oracle for `partition`: tries every choice of ``num_stages - 1`` cut points.

    Returns the same tie-broken partition as `partition` (the last stage as long as possible,
    the prefix split by the same rule), found by enumeration instead of the recurrence; ties are
    exact here, so use costs whose sums are exact in floating point (small integers) when
    comparing boundaries. Exponential: for tests on small cases only.
    """
    arr = _check_costs(costs, num_stages)
    c = [float(x) for x in arr]
    n = len(c)
    if num_stages == 1:
        return [0, n], math.fsum(c)
    best_value = math.inf
    best_last_cut = n
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        value = stage_bottleneck(c, bounds)
        # The earliest last cut wins among equal bottlenecks; combinations() enumerates every
        # last cut, so keep the smallest one seen at the best value.
        if value < best_value or (value == best_value and cuts[-1] < best_last_cut):
            best_value, best_last_cut = value, cuts[-1]
    prefix, _ = brute_force_partition(c[:best_last_cut], num_stages - 1)
    return prefix + [n], best_value


# ---- writing boundaries into a plan -----------------------------------------------------------


def frozen_aware_boundaries(plan: Plan, layer_costs: Mapping[str, Sequence[float]], override: bool = False) -> Plan:
    """A copy of ``plan`` whose modules get their stage boundaries from `partition` over
    ``layer_costs`` (per module, per layer ``T_l``, e.g. from `frozen_aware_layer_costs`),
    for each module's ``num_stages``. Boundaries the plan already gives are kept unless
    ``override``. This is how a plan's default boundaries follow frozen status when a cost
    model is available (cornstarch.md §3.2); without one, `Plan.resolve` splits evenly."""
    out = copy.deepcopy(plan)
    for spec in out.modules:
        if spec.stage_boundaries is not None and not override:
            continue
        if spec.name not in layer_costs:
            raise PlanError(
                f"layer_costs has no entry for plan.modules[{spec.name!r}]; it has {sorted(layer_costs)}"
            )
        costs = layer_costs[spec.name]
        if not 1 <= spec.num_stages <= len(costs):
            raise PlanError(
                f"plan.modules[{spec.name!r}].num_stages = {spec.num_stages}: must be between 1 and "
                f"the module's {len(costs)} layers"
            )
        spec.stage_boundaries, _ = partition(costs, spec.num_stages)
    return out


def plan_with_stage_counts(plan: Plan, stage_counts: Mapping[str, int],
                           layer_costs: Mapping[str, Sequence[float]]) -> Plan:
    """A copy of ``plan`` with the named modules set to ``stage_counts`` stages and partitioned
    afresh by `partition`; every other module without boundaries is filled the same way, and
    given boundaries elsewhere are kept. The usual body of the ``iteration_time`` callable of
    `loosely_coupled_search`: build this plan, then simulate it."""
    out = copy.deepcopy(plan)
    unknown = [n for n in stage_counts if n not in out.module_names]
    if unknown:
        raise PlanError(f"stage_counts names {unknown}, which plan.modules = {out.module_names} lacks")
    for spec in out.modules:
        if spec.name in stage_counts:
            spec.num_stages = int(stage_counts[spec.name])
            spec.stage_boundaries = None  # stale for the new stage count
    return frozen_aware_boundaries(out, layer_costs)


# ---- loosely-coupled multimodal search (Algorithm 1) ------------------------------------------


@dataclass(frozen=True)
class SearchCandidate:
    """One option of Algorithm 1: an LLM depth and the encoder depths it implies.

    ``target_stage_time`` is ``t_i``, the LLM's bottleneck stage cost (forward + backward) at
    this depth; ``stage_times`` is every module's bottleneck at its chosen depth. An encoder's
    may exceed ``t_i`` only when even one layer per stage cannot meet it. ``iteration_time`` is
    ``None`` for a candidate over the device budget (never evaluated)."""

    stage_counts: dict[str, int]
    boundaries: dict[str, list[int]]
    target_stage_time: float
    stage_times: dict[str, float]
    devices: int
    iteration_time: float | None

    @property
    def within_budget(self) -> bool:
        return self.iteration_time is not None


@dataclass(frozen=True)
class SearchResult:
    """The candidate of least iteration time, and every candidate considered (in order of
    LLM depth, over-budget ones included with ``iteration_time = None``)."""

    stage_counts: dict[str, int]
    boundaries: dict[str, list[int]]
    iteration_time: float
    devices: int
    candidates: list[SearchCandidate] = field(default_factory=list)


def loosely_coupled_search(
    llm_layer_costs: Sequence[float],
    encoder_layer_costs: Mapping[str, Sequence[float]],
    device_budget: int,
    iteration_time: Callable[[dict[str, int]], float],
    max_llm_stages: int | None = None,
    ranks_per_stage: Mapping[str, int] | None = None,
    fill_budget: bool = False,
) -> SearchResult:
    """Cornstarch's loosely-coupled multimodal parallelization (cornstarch.md §2.6, Algorithm 1).

    For each LLM depth ``i`` (1 up to ``max_llm_stages``, at most the LLM's layer count):

    1. partition the LLM into ``i`` stages (eq. 3.5); ``t_i`` is its bottleneck stage cost.
       The costs should be frozen-aware ``T_l`` (`frozen_aware_layer_costs`), so ``t_i`` is the
       "time of a single stage forward pass + backward pass";
    2. give each encoder the *fewest* stages whose bottleneck is at most ``t_i`` (the
       ``target_stage_time`` constraint, so that the modules stay balanced although each is
       partitioned on its own), or one layer per stage if even that exceeds ``t_i``;
    3. count devices, ``sum(stages x ranks_per_stage[m])`` (``ranks_per_stage`` defaults to 1
       per module; pass DP x TP x CP to count whole stage replicas), and skip the candidate if
       that exceeds ``device_budget``;
    4. otherwise ``iteration_time(stage_counts)`` ranks it (``stage_counts``: encoders in the
       given order, then ``"llm"``; `plan_with_stage_counts` then a simulator run is the usual
       implementation).

    ``fill_budget`` (not in the paper) keeps an LLM depth whose encoders overshoot the budget:
    they take the devices left instead, as the fewest stages that reach the least bottleneck
    those devices allow (`_least_bottleneck`), above ``t_i``. Algorithm 1 alone then misses
    splits such as (encoder 11, LLM 4) in a budget of 16 stages where meeting ``t_4`` takes
    13 encoder stages; with it, the candidates hold, for every LLM depth, a split of the least
    bottleneck (the largest stage cost of any module) at that depth, and so one of the least
    bottleneck of all splits of the budget.

    Returns the candidate of least iteration time; ties go to the fewer LLM stages, which is
    also the fewer devices (a deeper LLM lowers ``t_i``, so no encoder gets shallower). Raises
    ValueError naming the minimum device count when no candidate fits the budget.
    """
    llm = _check_costs(llm_layer_costs, None)
    try:
        device_budget = operator.index(device_budget)
    except TypeError:
        raise ValueError(f"device_budget = {device_budget!r}: must be an integer") from None
    if device_budget < 1:
        raise ValueError(f"device_budget = {device_budget}: must be at least 1")
    if LLM in encoder_layer_costs:
        raise ValueError(f"encoder_layer_costs has an entry named {LLM!r}; pass the LLM as llm_layer_costs")
    names = [*encoder_layer_costs, LLM]
    ranks = {n: 1 for n in names}
    if ranks_per_stage is not None:
        unknown = [n for n in ranks_per_stage if n not in ranks]
        if unknown:
            raise ValueError(f"ranks_per_stage names {unknown}; the modules are {names}")
        for n, r in ranks_per_stage.items():
            if operator.index(r) < 1:
                raise ValueError(f"ranks_per_stage[{n!r}] = {r}: must be at least 1")
            ranks[n] = int(r)
    depth_limit = llm.size
    if max_llm_stages is not None:
        if operator.index(max_llm_stages) < 1:
            raise ValueError(f"max_llm_stages = {max_llm_stages}: must be at least 1")
        depth_limit = min(depth_limit, int(max_llm_stages))

    llm_table = _StageTable(llm, depth_limit)
    encoders: dict[str, _StageTable] = {}
    for name, costs in encoder_layer_costs.items():
        try:
            arr = _check_costs(costs, None)
        except ValueError as e:
            raise ValueError(f"encoder_layer_costs[{name!r}]: {e}") from None
        encoders[name] = _StageTable(arr, arr.size)
    # bottleneck(k) is non-increasing in k, so the fewest stages meeting a target is the first
    # k that does; cache the bottlenecks since every LLM depth asks again.
    encoder_bottlenecks = {n: [t.bottleneck(k) for k in range(1, t.num_layers + 1)] for n, t in encoders.items()}

    candidates: list[SearchCandidate] = []
    best: SearchCandidate | None = None
    for depth in range(1, depth_limit + 1):
        target = llm_table.bottleneck(depth)
        counts: dict[str, int] = {}
        times: dict[str, float] = {}
        for name, table in encoders.items():
            values = encoder_bottlenecks[name]
            slack = TIE_TOLERANCE * float(table.prefix[-1])
            k = next((k for k, v in enumerate(values, start=1) if v <= target + slack), table.num_layers)
            counts[name], times[name] = k, values[k - 1]
        counts[LLM], times[LLM] = depth, target
        devices = sum(counts[n] * ranks[n] for n in names)
        if fill_budget and devices > device_budget and encoders:
            left = device_budget - depth * ranks[LLM]
            filled = _least_bottleneck(encoder_bottlenecks, {n: ranks[n] for n in encoders}, left)
            if filled is not None:
                counts.update(filled)
                times.update({n: encoder_bottlenecks[n][k - 1] for n, k in filled.items()})
                devices = sum(counts[n] * ranks[n] for n in names)
        bounds = {n: (encoders[n].boundaries(k) if n != LLM else llm_table.boundaries(k)) for n, k in counts.items()}
        value: float | None = None
        if devices <= device_budget:
            value = float(iteration_time(dict(counts)))
            if math.isnan(value):
                raise ValueError(f"iteration_time({counts}) returned NaN")
        candidate = SearchCandidate(counts, bounds, target, times, devices, value)
        candidates.append(candidate)
        if value is not None and (best is None or value < best.iteration_time):
            best = candidate
    if best is None:
        smallest = min(candidates, key=lambda c: c.devices)
        layout = ", ".join(f"{n} {k} stage{'s' if k > 1 else ''} x {ranks[n]} rank{'s' if ranks[n] > 1 else ''}"
                           for n, k in smallest.stage_counts.items())
        raise ValueError(
            f"device_budget = {device_budget} fits no loosely-coupled plan: the smallest ({layout}) "
            f"needs {smallest.devices} devices"
        )
    return SearchResult(dict(best.stage_counts), dict(best.boundaries), float(best.iteration_time),
                        best.devices, candidates)


def _least_bottleneck(bottlenecks: Mapping[str, Sequence[float]], ranks: Mapping[str, int],
                      devices: int) -> dict[str, int] | None:
    """The encoders' stage counts within ``devices`` (each stage ``ranks[n]`` of them) whose
    largest bottleneck is least, each encoder at the fewest stages reaching it; None when one
    stage each does not fit. ``bottlenecks[n][k - 1]``, encoder ``n``'s bottleneck at ``k``
    stages, does not grow with ``k``: the fewer stages a level needs the higher it is, so the
    levels that fit are those from the least one up, which bisection over them finds."""
    def fewest(level: float) -> dict[str, int] | None:
        out = {}
        for n, values in bottlenecks.items():
            k = next((k for k, v in enumerate(values, start=1) if v <= level), None)
            if k is None:
                return None
            out[n] = k
        return out

    def fits(counts: dict[str, int] | None) -> bool:
        return counts is not None and sum(k * ranks[n] for n, k in counts.items()) <= devices

    levels = sorted({v for values in bottlenecks.values() for v in values})
    lo, hi = 0, len(levels) - 1
    if not fits(fewest(levels[hi])):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(fewest(levels[mid])):
            hi = mid
        else:
            lo = mid + 1
    return fewest(levels[lo])
