"""Entrain's macro planning (entrain.md §2.1, §3.1-3.3): the minimum stable profiling batch
``b_min`` (Algorithm 2) and the heterogeneous model-parallel configuration search (Algorithm 3),
as a strategy of loom's planner (`entrain_layouts`).

Algorithm 2 (§3.2, Appendix C.1-C.2): draw a reference batch of ``n`` samples, turn its
per-component workload proportions into per-replica GPU counts (`proportional_allocation`),
then draw ``k = ceil(ln alpha / ln(1 - p_error))`` further batches (eq. C.5, `validation_trials`);
if every one of them gives the reference's allocation, ``n`` is ``b_min``, else ``n`` doubles.
With confidence ``1 - alpha`` a fresh batch of ``b_min`` samples gives another allocation with
probability at most ``p_error``, and a larger batch concentrates more tightly around the same
mean (C.2.2), so any ``B_global >= b_min`` keeps it.

Algorithm 3 (§3.3): for each data-parallel degree ``DP`` (dividing the GPUs, ``B_global`` a
multiple of ``DP mu``), ``M`` = the proportional allocation of the ``N / DP`` GPUs of a replica;
for each component every ``TP x CP x PP = M_i`` (Tier 1: the min-bottleneck contiguous stage
split of eq. 4.1, `intra_module_balance`); Tier 2 prices the whole chain by eq. 4.2,

    T = sum_i sum_p tau_{i,p} + (K - 1) beta_max + P_reshard,     K = B_global / (DP mu),

and the fastest configurations are kept (`configuration_search`). Per-sample workloads come
from loom's analytic cost model on sample metadata (`scenario_workloads`), as §4.7.3 computes
them "using the cost model and the metadata of the samples".

The gaps of entrain.md §7, as decided here:

- 7.1 a sample's workload is the forward + backward seconds of the sample alone, frozen-aware
  (the analytic model's backward runs only what autograd runs), at TP = CP = 1: the compute
  split the allocation is proportional to; communication is priced by the search;
- 7.2 proportions are the ratio of summed workloads (what a batch executes), not the mean of
  per-sample ratios (`estimate_proportions`);
- 7.3 rounding: largest remainder at each component's granularity, every component at least
  one unit (`proportional_allocation`);
- 7.4 ``n0`` is the caller's (default 1); a batch holds distinct samples of the pool (drawn
  without replacement), batches are independent draws (they may share samples); ``b_min``
  depends on ``DP`` (the budget is per replica); the run stops with a ValueError naming
  ``max_n`` past the cap (`minimum_profiling_batch`); defaults alpha = p_error = 0.05 (k = 59).
  On a scenario the cap is the global batch and nothing enforces ``B_global >= b_min``:
  `scenario_macro_plan` reports ``b_min`` per DP (None where no batch up to ``B_global`` is
  stable) and Algorithm 3's ``P_pop`` is taken over the whole profiling pool, at least
  ``b_min`` samples, which the certificate says gives the same allocation;
- 7.5 the space: DP is searched (every divisor of the GPUs); per component every allowed TP
  (within a node, dividing its heads) and CP (the LLM's from the search space; encoders 1)
  whose ``TP x CP`` divides its ``M_i``: the allocation's granularity is the component's
  smallest ``TP x CP``, so one divides it (a depth past its layers is skipped); ``spread`` optionally lets ``M``
  stray a few units from the proportional allocation (Table C.1's configurations do; default
  0, the text's rule). Layer costs are evaluated at the mean microbatch of ``mu`` samples, for
  each ``mu`` of the search space; ``tau`` is forward + backward; the reshard cost and the
  memory check are `ScenarioPricing`'s. Several encoders run in parallel on ranks of their
  own in loom, so eq. 4.2's chain takes the *longest* encoder (the max over encoders of their
  stage sums), not their sum, and ``beta_max`` is over every component's stages: a deviation
  from the text, whose chain is linear and which merges encoders into one component (§2.3).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from loom.cost import comm
from loom.cost.analytic import AnalyticCostModel
from loom.cost.hardware import Cluster
from loom.cost.memory import DTYPE_BYTES
from loom.cost.model import Workload
from loom.plan.plan import LLM, RECOMPUTE_MODES, ModuleSpec, Plan, PlanError
from loom.planner.partition import partition
from loom.sim.scenario import Scenario



class SpaceChoices(Protocol):
    """What Entrain's planner reads of the search's space (`loom.planner.search.SearchSpace`,
    which imports this module: a protocol keeps the import one way)."""

    placements: tuple[str, ...]
    tensor_parallel: tuple[int, ...]
    context_parallel: tuple[int, ...]
    microbatch_samples: tuple[int, ...]
    recompute: tuple[str, ...]
    zero_stages: tuple[int, ...]

# (tensor_parallel, context_parallel) of a component
Parallel = tuple[int, int]


# ---- Algorithm 2: the minimum stable profiling batch ---------------------------------------------
def validation_trials(alpha: float, p_error: float) -> int:
    """``k = ceil(ln alpha / ln(1 - p_error))`` (eq. C.5): the zero-failure run of independent
    validation batches after which, with confidence ``1 - alpha``, a fresh batch fails with
    probability at most ``p_error`` (``(1 - p_error)^k <= alpha``, eq. C.4)."""
    for name, value in (("alpha", alpha), ("p_error", p_error)):
        if not 0 < value < 1:
            raise ValueError(f"{name} = {value!r}: must lie strictly between 0 and 1 (e.g. 0.05)")
    k = math.log(alpha) / math.log1p(-p_error)
    # ln(alpha)/ln(1-p) is an integer only by accident; a ratio a rounding error above one
    # must not cost a whole trial more
    return max(1, math.ceil(k - 1e-9))


def proportional_allocation(budget_per_replica: int, proportions: Sequence[float],
                            granularity: int | Sequence[int] = 1) -> tuple[int, ...]:
    """A replica's ``budget_per_replica`` GPUs shared among components in ``proportions``
    (non-negative, any scale): GPUs per component (entrain.md §3.2 ``ProportionalAllocation``).

    The rule (gap 7.3): component ``i`` takes whole units of ``granularity[i]`` GPUs (its smallest
    TP x CP), at least one, and the units fill the budget exactly. Its quota is ``q_i = budget
    P_i / g_i`` units; units are handed out one at a time, first one to each component, then each
    to the component furthest below its quota (the largest ``q_i - a_i``; ties to the earlier
    component) among those whose unit still fits. With one granularity this is Hamilton's
    largest-remainder method with a floor of one unit: a component with ``q_i >= 1`` gets
    ``floor(q_i)`` or ``ceil(q_i)`` units unless forced floors elsewhere take units, the leftover
    units going to the largest remainders, and the result minimises both ``sum |a_i - q_i|`` and
    ``sum (a_i - q_i)^2`` over every vector of at least one unit each that fills the budget
    (each unit goes where it lowers the separable convex deviation most). Under different
    granularities a budget the greedy cannot fill exactly is refused (ValueError).

    The paper's example (§3.2): 1:0.98 and 1:1.12 both give 1:1 with 2 GPUs."""
    p = np.asarray(proportions, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"proportions = {proportions!r}: give one non-negative number per component")
    if not (np.all(np.isfinite(p)) and np.all(p >= 0)) or p.sum() <= 0:
        raise ValueError(f"proportions = {list(p)}: must be finite, non-negative and not all zero")
    g = [granularity] * p.size if isinstance(granularity, int) else [int(x) for x in granularity]
    if len(g) != p.size or any(x < 1 for x in g):
        raise ValueError(f"granularity = {granularity!r}: one whole number >= 1 per component "
                         f"({p.size} components)")
    if budget_per_replica < sum(g):
        raise ValueError(f"budget_per_replica = {budget_per_replica} GPUs cannot give each of {p.size} components one "
                         f"unit of {g} GPUs; use fewer data-parallel replicas or more GPUs")
    quota = budget_per_replica * p / p.sum() / np.asarray(g, dtype=np.float64)
    units = [1] * p.size
    if len(set(g)) == 1:
        # the greedy from one unit each first fills every quota's whole part (a deficit of a unit
        # or more beats any remainder), when those parts fit: start there
        floors = [max(1, int(math.floor(q))) for q in quota]
        if sum(floors) * g[0] <= budget_per_replica:
            units = floors
    left = budget_per_replica - sum(u * x for u, x in zip(units, g))
    while left > 0:
        best = -1
        for i in range(p.size):
            if g[i] <= left and (best < 0 or quota[i] - units[i] > quota[best] - units[best]):
                best = i
        if best < 0:
            raise ValueError(f"budget_per_replica = {budget_per_replica} is not filled by units of granularity = {g} "
                             f"({left} GPUs left over); use one granularity for every component or a budget they add "
                             f"up to")
        units[best] += 1
        left -= g[best]
    return tuple(u * x for u, x in zip(units, g))


def estimate_proportions(workloads: np.ndarray, batch: np.ndarray | None = None) -> np.ndarray:
    """Each component's share of a batch's summed workload (``EstimateMacroscopicProportions``):
    ``workloads`` is ``(samples, components)``, ``batch`` the rows of the batch (all when None).
    The ratio of sums, what the batch executes (gap 7.2), not the mean of per-sample ratios."""
    w = np.asarray(workloads, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"workloads has shape {w.shape}: give a (samples, components) array of per-sample "
                         f"workloads, at least one of each")
    sums = (w if batch is None else w[batch]).sum(axis=0)
    total = sums.sum()
    if not total > 0:
        raise ValueError("the batch's workloads sum to zero: no component has work to allocate GPUs by")
    return sums / total


@dataclass(frozen=True)
class ProfilingRound:
    """One batch size tried by Algorithm 2: the reference batch's allocation and how many
    validation batches ran (``k`` when stable, fewer when one disagreed)."""

    batch_size: int
    reference: tuple[int, ...]
    validations: int
    stable: bool


@dataclass(frozen=True)
class ProfilingResult:
    """Algorithm 2's answer: ``b_min``, the trial count ``k`` it certifies with, the allocation
    at ``b_min``, and every round it ran (reference batches drawn apart from the validations)."""

    b_min: int
    trials: int
    allocation: tuple[int, ...]
    rounds: tuple[ProfilingRound, ...]

    @property
    def batches(self) -> int:
        """Batches drawn in all: each round's reference plus its validation batches."""
        return sum(1 + r.validations for r in self.rounds)


def minimum_profiling_batch(workloads: np.ndarray, budget_per_replica: int, granularity: int | Sequence[int] = 1,
                            *, max_n: int, alpha: float = 0.05, p_error: float = 0.05, n0: int = 1,
                            seed: int = 0) -> ProfilingResult:
    """Algorithm 2 over a pool of per-sample workloads ``(samples, components)``: the smallest
    ``n = n0 2^j`` whose reference batch's allocation of ``budget_per_replica`` GPUs
    (`proportional_allocation` at ``granularity``) every one of ``validation_trials(alpha,
    p_error)`` independent batches of ``n`` reproduces. Batches hold ``n`` distinct samples of
    the pool; the reference and every validation batch are fresh draws from one seeded
    generator (deterministic for a ``seed``). Raises ValueError naming ``max_n`` when no size up
    to it is stable (the paper's loop has no cap; a pool cannot give batches larger than itself)."""
    w = np.asarray(workloads, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] == 0:
        raise ValueError(f"workloads has shape {w.shape}: give a (samples, components) array")
    pool = w.shape[0]
    if n0 < 1:
        raise ValueError(f"n0 = {n0}: the first batch size must be at least 1")
    if not n0 <= max_n <= pool:
        raise ValueError(f"max_n = {max_n}: must lie between n0 = {n0} and the pool's {pool} samples (a batch holds "
                         f"distinct samples of the pool); give a larger pool or a smaller max_n")
    k = validation_trials(alpha, p_error)
    rng = np.random.default_rng(seed)

    def allocation(n: int) -> tuple[int, ...]:
        batch = rng.choice(pool, size=n, replace=False)
        return proportional_allocation(budget_per_replica, estimate_proportions(w, batch), granularity)

    rounds = []
    n = n0
    while n <= max_n:
        reference = allocation(n)
        ran, stable = 0, True
        for _ in range(k):
            ran += 1
            if allocation(n) != reference:
                stable = False
                break
        rounds.append(ProfilingRound(n, reference, ran, stable))
        if stable:
            return ProfilingResult(n, k, reference, tuple(rounds))
        n *= 2
    raise ValueError(f"no batch size from n0 = {n0} up to max_n = {max_n} gives a stable allocation of "
                     f"{budget_per_replica} GPUs ({k} validation batches, alpha = {alpha}, p_error = {p_error}): the "
                     f"workload ratio varies too much; raise max_n (and the global batch with it), use fewer "
                     f"data-parallel replicas, or accept a larger p_error")


# ---- Algorithm 3: the heterogeneous configuration search ------------------------------------------
def intra_module_balance(costs: Sequence[float], stages: int) -> tuple[list[int], list[float]]:
    """Tier 1 (eq. 4.1): the contiguous split of a component's per-layer costs into ``stages``
    minimising the slowest stage, by loom's exact dynamic program
    (`loom.planner.partition.partition`). Returns the boundaries (``[0, ..., L]``) and each
    stage's latency ``tau_p``; ``beta_i`` is their max."""
    bounds, _ = partition(costs, stages)
    c = [float(x) for x in costs]
    return bounds, [math.fsum(c[bounds[s]:bounds[s + 1]]) for s in range(stages)]


def iteration_time(encoders: Sequence[Sequence[float]], llm: Sequence[float], num_microbatches: int,
                   reshard: float = 0.0) -> float:
    """Eq. 4.2: ``sum of the chain's stage latencies + (K - 1) beta_max + P_reshard``, with the
    encoders (each a list of stage latencies) running in parallel before the LLM: the chain
    takes the longest encoder (module docstring), ``beta_max`` every component's slowest stage."""
    if num_microbatches < 1 or not llm:
        raise ValueError(f"num_microbatches = {num_microbatches}, llm = {list(llm)}: need at least one microbatch "
                         f"and one LLM stage")
    chain = max((math.fsum(e) for e in encoders), default=0.0) + math.fsum(llm)
    beta = max([max(llm), *(max(e) for e in encoders if e)])
    return chain + (num_microbatches - 1) * beta + reshard


@dataclass(frozen=True)
class Component:
    """What Algorithm 3 knows of a modality component: its allowed ``(TP, CP)`` pairs and its
    per-layer forward + backward seconds of one microbatch at each (``costs(tp, cp)``)."""

    name: str
    parallel: tuple[Parallel, ...]
    costs: Callable[[int, int], Sequence[float]]

    @property
    def granularity(self) -> int:
        """The fewest GPUs a pipeline stage of it takes: its smallest ``TP x CP``."""
        return min(tp * cp for tp, cp in self.parallel)


@dataclass(frozen=True)
class ComponentLayout:
    """One component's part of a configuration: its GPUs per replica ``M_i = TP x CP x PP``, its
    stage boundaries and latencies ``tau_{i,p}`` (Tier 1)."""

    name: str
    gpus: int
    tensor_parallel: int
    context_parallel: int
    stages: int
    boundaries: tuple[int, ...]
    stage_times: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        """``beta_i``: the slowest stage."""
        return max(self.stage_times)

    @property
    def parallel(self) -> Parallel:
        return self.tensor_parallel, self.context_parallel


@dataclass(frozen=True)
class Configuration:
    """A static parallel configuration ``C = {DP, TP, CP, PP per component}`` with its eq. 4.2
    iteration time (the LLM last in ``components``)."""

    data_parallel: int
    microbatch: int  # mu, samples per microbatch
    num_microbatches: int  # K per replica
    components: tuple[ComponentLayout, ...]
    reshard: float
    iteration_time: float

    def component(self, name: str) -> ComponentLayout:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"the configuration has no component {name!r}; it has {[c.name for c in self.components]}")

    @property
    def bottleneck(self) -> float:
        """``beta_max``."""
        return max(c.bottleneck for c in self.components)

    @property
    def throughput(self) -> float:
        """Microbatches per second, ``DP K / T`` (Algorithm 3 line 14)."""
        return self.data_parallel * self.num_microbatches / self.iteration_time

    @property
    def samples_per_second(self) -> float:
        return self.microbatch * self.throughput


# ``fits(configuration)``: whether it fits the GPUs' memory
FitCheck = Callable[[Configuration], bool]
# ``reshard(encoder, its (TP, CP), the LLM's (TP, CP), K)``: seconds an iteration spends moving
# the encoder's boundary activations between the two layouts (called when they differ)
ReshardCost = Callable[[str, Parallel, Parallel, int], float]


def allocations(budget_per_replica: int, proportions: Sequence[float], granularity: Sequence[int],
                spread: int = 0) -> list[tuple[int, ...]]:
    """The proportional allocation (`proportional_allocation`) and, with ``spread > 0``, every
    other allocation of the budget whose units each lie within ``spread`` of it (at least one
    unit each): Table C.1's configurations stray from the stable allocations (gap 7.5), which a
    spread lets the search reach. The proportional one first."""
    base = proportional_allocation(budget_per_replica, proportions, granularity)
    if spread <= 0:
        return [base]
    ranges = [range(max(1, b // g - spread), b // g + spread + 1) for b, g in zip(base, granularity)]
    out = [base]
    for units in itertools.product(*ranges):
        gpus = tuple(u * g for u, g in zip(units, granularity))
        if sum(gpus) == budget_per_replica and gpus != base:
            out.append(gpus)
    return out


def configuration_search(components: Sequence[Component], proportions: Sequence[float], num_gpus: int,
                         global_batch: int, microbatch: int, *, fits: FitCheck | None = None,
                         reshard: ReshardCost | None = None, keep: int = 1,
                         data_parallel: Sequence[int] | None = None, spread: int = 0) -> list[Configuration]:
    """Algorithm 3: the ``keep`` fastest configurations by eq. 4.2 (fastest first), over every
    ``DP`` of ``data_parallel`` (default: the divisors of ``num_gpus``) with ``global_batch``
    a multiple of ``DP microbatch``; per replica the GPUs are allocated in ``proportions``
    (`allocations`, at each component's granularity), each component then takes every allowed
    ``(TP, CP)`` dividing its GPUs with ``PP = M_i / (TP CP)`` (at most its layers), split by eq.
    4.1. ``components`` lists the encoders (in parallel), the LLM last. ``fits`` is asked only
    of a configuration fast enough to be kept (a memory check is the costly part); ``reshard``
    of every encoder whose ``(TP, CP)`` differs from the LLM's. Ties keep the first found.
    Raises ValueError when nothing is valid or fits."""
    if len(components) < 1:
        raise ValueError("components is empty: give the encoders and then the LLM")
    if len(proportions) != len(components):
        raise ValueError(f"proportions has {len(proportions)} entries for {len(components)} components")
    if min(num_gpus, global_batch, microbatch, keep) < 1:
        raise ValueError(f"num_gpus = {num_gpus}, global_batch = {global_batch}, microbatch = {microbatch}, keep = "
                         f"{keep}: all must be at least 1")
    empty = [c.name for c in components if not c.parallel]
    if empty:
        raise ValueError(f"components {empty} have no allowed (TP, CP); give at least one")
    granularity = [c.granularity for c in components]
    dps = sorted(data_parallel) if data_parallel is not None else _divisors(num_gpus)
    tier1: dict[tuple[int, int, int, int], ComponentLayout | None] = {}
    reshard_memo: dict[tuple[str, Parallel, Parallel, int], float] = {}
    kept: list[tuple[float, int, Configuration]] = []  # max-heap on (time, order found)
    order = 0
    for dp in dps:
        if num_gpus % dp or global_batch % (dp * microbatch):
            continue
        budget = num_gpus // dp
        k = global_batch // (dp * microbatch)
        try:
            candidates = allocations(budget, proportions, granularity, spread)
        except ValueError:  # a replica too small to give every component a unit
            continue
        for gpus in candidates:
            options = []
            for i, c in enumerate(components):
                layouts = []
                for tp, cp in c.parallel:
                    if gpus[i] % (tp * cp):
                        continue
                    key = (i, tp, cp, gpus[i] // (tp * cp))
                    if key not in tier1:
                        tier1[key] = _tier1(c, gpus[i], tp, cp)
                    if tier1[key] is not None:
                        layouts.append(tier1[key])
                options.append(layouts)
            for chosen in itertools.product(*options):
                llm = chosen[-1]
                extra = 0.0
                for e in chosen[:-1]:
                    if reshard is not None and e.parallel != llm.parallel:
                        key = (e.name, e.parallel, llm.parallel, k)
                        if key not in reshard_memo:
                            reshard_memo[key] = reshard(*key)
                        extra += reshard_memo[key]
                t = iteration_time([e.stage_times for e in chosen[:-1]], llm.stage_times, k, extra)
                order += 1
                if len(kept) >= keep and (t, order) >= (-kept[0][0], -kept[0][1]):
                    continue
                config = Configuration(dp, microbatch, k, tuple(chosen), extra, t)
                if fits is not None and not fits(config):
                    continue
                item = (-t, -order, config)
                if len(kept) < keep:
                    heapq.heappush(kept, item)
                else:
                    heapq.heapreplace(kept, item)
    if not kept:
        raise ValueError(f"no configuration of {[c.name for c in components]} on {num_gpus} GPUs fits: no data-parallel "
                         f"degree divides global_batch = {global_batch} in microbatches of {microbatch}, every "
                         f"allocation lacks a (TP, CP) that divides it, or the memory check refused them all; use "
                         f"another batch or more GPUs")
    return [c for _, _, c in sorted(kept, key=lambda x: (-x[0], -x[1]))]


def _tier1(c: Component, gpus: int, tp: int, cp: int) -> ComponentLayout | None:
    costs = c.costs(tp, cp)
    pp = gpus // (tp * cp)
    if not 1 <= pp <= len(costs):
        return None
    bounds, taus = intra_module_balance(costs, pp)
    return ComponentLayout(c.name, gpus, tp, cp, pp, tuple(bounds), tuple(taus))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- on a scenario ------------------------------------------------------------------------------
def pool_work(scenario: Scenario, samples: int | None = None) -> list[dict[str, Workload]]:
    """Each sample's own per-module `Workload` (from metadata) over a pool of the scenario's
    samples: the first ``samples`` (default ``max(2 B_global, 1024)``) of its data stream, whole
    global batches drawn in order."""
    batch = scenario.global_batch_size
    samples = samples or max(2 * batch, 1024)
    metas = [m for step in range(-(-samples // batch)) for m in scenario.metas(step)][:samples]
    return scenario.per_sample_work(metas)


def scenario_workloads(scenario: Scenario, samples: int | None = None,
                       work: Sequence[Mapping[str, Workload]] | None = None) -> tuple[list[str], np.ndarray]:
    """Per-sample workloads over a pool of the scenario's samples (`pool_work`, or ``work``
    when given): the encoders' and the LLM's names, and a ``(samples, components)`` array of
    each sample's forward + backward seconds in each, priced alone by the analytic cost model,
    one stage at TP = CP = 1, frozen-aware (gap 7.1). Generators are not components (Entrain has
    none)."""
    names = [*scenario.arch.encoder_names, LLM]
    work = pool_work(scenario, samples) if work is None else work
    plan = Plan([ModuleSpec(m) for m in scenario.arch.module_names]).resolve(
        scenario.arch.layer_counts(), generators=scenario.arch.generator_names)
    model = scenario.cost_model(plan)
    kept: dict[tuple[str, Workload], float] = {}  # samples repeat their token counts
    out = np.zeros((len(work), len(names)))
    for s, w in enumerate(work):
        for i, name in enumerate(names):
            load = w.get(name, Workload())
            t = kept.get((name, load))
            if t is None:
                t = kept[(name, load)] = math.fsum(c.forward + c.backward for c in model.module_layer_costs(name, load))
            out[s, i] = t
    return names, out


def mean_microbatch(work: Sequence[Mapping[str, Workload]], microbatch: int) -> dict[str, Workload]:
    """Per module, the mean sample's `Workload` times ``microbatch`` (rounded): the microbatch
    Algorithm 3's layer costs are evaluated at (gap 7.5; packed sequences, whose ``attn_sq`` adds
    up sample by sample)."""
    if not work:
        raise ValueError("work is empty: give at least one sample's workload")
    names = {name for w in work for name in w}
    return {name: Workload(*(round(microbatch * sum(getattr(w.get(name, Workload()), f) for w in work) / len(work))
                             for f in ("tokens", "attn_sq", "segments")))
            for name in sorted(names)}


class ScenarioPricing:
    """Algorithm 3's inputs on a scenario for the microbatch ``work`` (`mean_microbatch`): each
    component's per-layer seconds (`costs`), the memory check (`fits`) and the reshard cost
    (`reshard`), all from the scenario's analytic cost model. Answers are kept: the search asks
    each often.

    - Layer costs: the component alone, one stage at ``(TP, CP)``, its TP group inside a node
      (the modules before it take whole nodes of a pricing copy of the cluster, as loom lays a
      node-aligned plan out), recompute off.
    - Memory: every stage of every component holds its parameters, gradients and optimizer
      state, one layer's backward working set, and 1F1B's in-flight activations: at stage ``s``
      of an encoder ``min(K, PP_e - s + PP_llm)`` microbatches (the LLM's stages follow it), of
      the LLM ``min(K, PP_llm - s)`` (`loom.planner.estimate`'s rule with the encoders side by
      side). ZeRO and recompute are the most memory-saving ``zero_stage`` and ``recompute`` the
      search may still choose (it fills them in later), so a layout is kept whenever some
      setting of them fits.
    - Reshard (gap 7.5): when an encoder's ``(TP, CP)`` differs from the LLM's, each
      microbatch's boundary activation (the encoder's last layer's output, ``tokens_out x
      out_width x dtype bytes``) is re-laid out across the larger of the two groups, priced as
      an all-gather of it there, forward and again for its gradient backward, over the link
      that group spans (intra-node when it fits one node): ``P_reshard = K x 2 x
      all_gather(V, max(TP_e CP_e, TP_l CP_l))``, paid serially at the boundary each microbatch.
    """

    def __init__(self, scenario: Scenario, work: Mapping[str, Workload], zero_stage: int = 0,
                 recompute: str = "none") -> None:
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute = {recompute!r}: choose one of {list(RECOMPUTE_MODES)}")
        self.scenario = scenario
        self.zero_stage = zero_stage
        self.recompute = recompute
        self.work = {name: work.get(name, Workload()) for name in scenario.arch.module_names}
        self.components = [*scenario.arch.encoder_names, LLM]
        self._costs: dict[tuple[str, int, int], list[float]] = {}
        self._memory: dict[tuple, list[tuple[float, float]]] = {}
        self._fits: dict[tuple, bool] = {}

    def _model(self, name: str, tp: int, cp: int, pp: int = 1, dp: int = 1, zero: int = 0, recompute: str = "none",
               boundaries: Sequence[int] | None = None, num_microbatches: int = 1) -> AnalyticCostModel:
        """A cost model of ``name`` at these degrees, the other components one rank each, the
        ones before it a whole node each (so its TP group sits inside a node), on a copy of the
        cluster large enough to hold the layout."""
        sc = self.scenario
        gpn = sc.cluster.gpus_per_node
        before = self.components[:self.components.index(name)]
        nodes = len(before) + -(-tp * cp * pp * dp // gpn) + 1
        specs = []
        for m in sc.arch.module_names:
            if m == name:
                specs.append(ModuleSpec(m, data_parallel=dp, tensor_parallel=tp, context_parallel=cp, num_stages=pp,
                                        stage_boundaries=list(boundaries) if boundaries is not None else None,
                                        zero_stage=zero if dp > 1 else 0, recompute=recompute))
            else:
                specs.append(ModuleSpec(m, data_parallel=gpn if m in before else 1))
        # at least a replica's worth of microbatches for the whole-node modules before it (only
        # whether a replica accumulates over several, ZeRO-2/3's gradients, can change with it)
        plan = Plan(specs, num_microbatches=max(num_microbatches, gpn)).resolve(
            sc.arch.layer_counts(), generators=sc.arch.generator_names)
        cluster = Cluster(sc.cluster.gpu, num_gpus=nodes * gpn, gpus_per_node=gpn)
        return AnalyticCostModel(sc.arch, plan, cluster, dtype_bytes=DTYPE_BYTES[sc.dtype], efficiency=sc.efficiency,
                                 tp_comm_overlap=sc.tp_comm_overlap)

    def costs(self, name: str, tp: int, cp: int) -> list[float]:
        """Per layer of ``name``, forward + backward seconds of the mean microbatch at ``(tp, cp)``."""
        key = (name, tp, cp)
        if key not in self._costs:
            model = self._model(name, tp, cp)
            self._costs[key] = [c.forward + c.backward for c in model.module_layer_costs(name, self.work[name])]
        return self._costs[key]

    def _stage_memory(self, layout: ComponentLayout, dp: int, k: int) -> list[tuple[float, float]]:
        """Per stage: (static + transient bytes, activation bytes of one microbatch)."""
        key = (layout.name, layout.parallel, layout.boundaries, dp, k)
        if key not in self._memory:
            model = self._model(layout.name, layout.tensor_parallel, layout.context_parallel, layout.stages, dp,
                                self.zero_stage, self.recompute, layout.boundaries, dp * k)
            w = self.work[layout.name]
            self._memory[key] = [(model.static_memory(layout.name, s) + model.transient_memory(layout.name, s, w),
                                  model.activation_memory(layout.name, s, w)) for s in range(layout.stages)]
        return self._memory[key]

    def fits(self, config: Configuration) -> bool:
        """Whether every stage of ``config`` fits the GPU's memory (class docstring)."""
        capacity = self.scenario.memory_capacity()
        llm = config.components[-1]
        for c in config.components:
            after = llm.stages if c is not llm else 0
            key = (c.name, c.parallel, c.boundaries, config.data_parallel, config.num_microbatches, after)
            if key not in self._fits:
                self._fits[key] = all(
                    held + min(config.num_microbatches, c.stages - s + after) * act <= capacity
                    for s, (held, act) in enumerate(self._stage_memory(c, config.data_parallel,
                                                                       config.num_microbatches)))
            if not self._fits[key]:
                return False
        return True

    def reshard(self, encoder: str, src: Parallel, dst: Parallel, num_microbatches: int) -> float:
        """``P_reshard`` of one encoder-to-LLM boundary (class docstring)."""
        sc = self.scenario
        last = sc.arch.module(encoder).layers[-1]
        nbytes = last.tokens_out(self.work[encoder].tokens) * last.out_width * DTYPE_BYTES[sc.dtype]
        group = max(src[0] * src[1], dst[0] * dst[1])
        link = comm.intra_node_link(sc.cluster) if group <= sc.cluster.gpus_per_node else comm.inter_node_link(sc.cluster)
        return num_microbatches * 2 * comm.all_gather_time(nbytes, group, link)


@dataclass
class MacroPlan:
    """Entrain's macro plan of a scenario: the components, their workload proportions over the
    profiling pool, ``b_min`` per data-parallel degree (None where no batch up to the global
    batch is stable: Entrain then "does not guarantee optimal load balance"), and the fastest
    configurations by eq. 4.2, fastest first."""

    components: list[str]
    proportions: dict[str, float]
    b_min: dict[int, int | None]
    configurations: list[Configuration] = field(default_factory=list)


def _parallel_options(scenario: Scenario, space: SpaceChoices) -> dict[str, tuple[Parallel, ...]]:
    """Per component its allowed ``(TP, CP)``: TP of the space within a node dividing every
    block's heads; CP of the space for the LLM, 1 for an encoder (loom runs no encoder CP)."""
    out = {}
    for name in [*scenario.arch.encoder_names, LLM]:
        heads = [layer.heads for layer in scenario.arch.module(name).layers if layer.kind == "block"]
        tps = [t for t in space.tensor_parallel
               if t <= scenario.cluster.gpus_per_node and all(h % t == 0 for h in heads)]
        cps = space.context_parallel if name == LLM else (1,)
        out[name] = tuple((t, c) for t in sorted(set(tps)) for c in sorted(set(cps)))
    return out


def scenario_macro_plan(scenario: Scenario, space: SpaceChoices, keep: int = 4, *, alpha: float = 0.05,
                        p_error: float = 0.05, seed: int = 0, samples: int | None = None,
                        spread: int = 0) -> MacroPlan:
    """Algorithms 2 and 3 on a scenario: per-sample workloads of a pool of its samples
    (`scenario_workloads`), ``b_min`` for each data-parallel degree the search may take (capped
    at the global batch), the proportions over the pool (any batch of at least ``b_min``
    samples gives their allocation), and `configuration_search` under each microbatch size of
    ``space.microbatch_samples`` with `ScenarioPricing`, the ``keep`` fastest distinct layouts
    kept. Raises ValueError when the scenario has generators (Entrain has none) or no encoder."""
    if scenario.arch.generator_names:
        raise ValueError(f"the model has generators {scenario.arch.generator_names}: Entrain's macro plan covers "
                         f"encoders and an LLM only; drop the generators or use DistTrain's orchestration")
    if not scenario.arch.encoder_names:
        raise ValueError("the model has no encoder: Entrain's macro plan balances encoders against the LLM; use the "
                         "search's first_stage layouts for a text-only model")
    work = pool_work(scenario, samples)
    names, workloads = scenario_workloads(scenario, work=work)
    options = _parallel_options(scenario, space)
    proportions = estimate_proportions(workloads)
    n, batch = scenario.cluster.num_gpus, scenario.global_batch_size
    plan = MacroPlan(names, dict(zip(names, proportions.tolist())), {})
    if any(not options[c] for c in names):
        return plan
    granularity = [min(t * c for t, c in options[name]) for name in names]
    mus = sorted(set(space.microbatch_samples))
    for dp in _divisors(n):
        if any(batch % (dp * mu) == 0 for mu in mus) and n // dp >= sum(granularity):
            try:
                plan.b_min[dp] = minimum_profiling_batch(
                    workloads, n // dp, granularity, max_n=min(batch, len(workloads)), alpha=alpha, p_error=p_error,
                    seed=seed).b_min
            except ValueError:
                plan.b_min[dp] = None
    recompute = max(space.recompute, key=RECOMPUTE_MODES.index)  # the most memory-saving the search may pick
    found: list[Configuration] = []
    for mu in mus:
        pricing = ScenarioPricing(scenario, mean_microbatch(work, mu), max(space.zero_stages), recompute)
        components = [Component(name, options[name], lambda tp, cp, name=name, p=pricing: p.costs(name, tp, cp))
                      for name in names]
        try:
            found += configuration_search(components, proportions, n, batch, mu, fits=pricing.fits,
                                          reshard=pricing.reshard, keep=keep, spread=spread)
        except ValueError:  # no DP divides the batch in microbatches of mu, or nothing fits
            continue
    seen = set()
    for c in sorted(found, key=lambda c: c.iteration_time):
        key = _template_key(c)
        if key not in seen and len(plan.configurations) < keep:
            seen.add(key)
            plan.configurations.append(c)
    return plan


def _template_key(c: Configuration) -> tuple:
    return c.data_parallel, tuple((x.name, x.tensor_parallel, x.context_parallel, x.stages) for x in c.components)


def configuration_plan(config: Configuration) -> Plan:
    """``config`` as a loom plan template (placement ``disaggregated``, the shape the search's
    `_megatron_layouts` and `_orchestrated_layouts` yield): each encoder and the LLM at its TP,
    CP, stages and the configuration's DP; 1F1B over ``DP K`` microbatches. The search fills in
    ZeRO, recompute, microbatches, schedule and stage boundaries."""
    specs = [ModuleSpec(c.name, data_parallel=config.data_parallel, tensor_parallel=c.tensor_parallel,
                        context_parallel=c.context_parallel, num_stages=c.stages)
             for c in config.components]
    return Plan(specs, num_microbatches=config.data_parallel * config.num_microbatches, schedule="1f1b",
                placement="disaggregated")


def entrain_layouts(scenario: Scenario, space: SpaceChoices, keep: int) -> Iterator[Plan]:
    """Entrain's ``keep`` fastest configurations (`scenario_macro_plan`) as plan templates for
    loom's search (`configuration_plan`). Yields nothing for a model with generators or no
    encoder, a space without the ``disaggregated`` placement, or when nothing fits."""
    if keep < 1 or "disaggregated" not in space.placements:
        return
    if scenario.arch.generator_names or not scenario.arch.encoder_names:
        return
    try:
        macro = scenario_macro_plan(scenario, space, keep)
    except (ValueError, PlanError):
        return
    for config in macro.configurations:
        yield configuration_plan(config)


__all__ = [
    "Component", "ComponentLayout", "Configuration", "MacroPlan", "ProfilingResult", "ProfilingRound",
    "ScenarioPricing", "allocations", "configuration_plan", "configuration_search", "entrain_layouts",
    "estimate_proportions", "intra_module_balance", "iteration_time", "mean_microbatch", "minimum_profiling_batch",
    "pool_work",
    "proportional_allocation", "scenario_macro_plan", "scenario_workloads", "validation_trials",
]
