"""loom's planner search (issue 12, item 2): the fastest plan that fits, over placements and
every module's parallel degrees, by analytic estimate first and the simulator last.

The space (`SearchSpace`):

- placement: ``first_stage`` (Megatron-LM's own layout: the encoders inside the LLM's first
  position), ``colocated`` with Optimus's bubble fill (optimus.md §2.3, §3.4-3.6; an encoder
  replica on every LLM unit, no ZeRO, no CP), ``disaggregated`` (encoders and generators on
  ranks of their own): Megatron-LM's MLLM layout, each at the LLM's TP and DP in one stage
  (disttrain.md §2; optimus.md §3.10's balanced baseline), DistTrain's orchestration
  (disttrain.md §3.2, Algorithm 1, `loom.planner.orchestration`), which sizes each module's GPUs
  and TP, and Cornstarch's loosely-coupled modality parallelism (cornstarch.md §2.6, Algorithm
  1; §3.1), which gives each encoder the pipeline depth that meets the LLM's stage time
  (`_cornstarch_layouts`); a disaggregated plan may leave GPUs idle, as both papers' budgets do;
- the LLM's TP (within a node, dividing every hosted module's heads), CP, pipeline depth and
  DP filling the GPUs; stage boundaries by cost (`loom.planner.partition.partition` over each
  layer's forward + backward, so an embedding and a large-vocabulary head weigh what they cost,
  and the first position carries its hosted encoders);
- samples per microbatch; schedule (1F1B, interleaved 1F1B with 2 chunks, ZB-H1);
- per module ZeRO stage and recompute: for each recompute mode (none, selective, full: more
  recompute is only slower) the lowest ZeRO stage that fits the GPU's memory (a higher stage
  only adds communication);
- the balancing policy, tried on the best plans by the simulator;
- the scenario's own plans (``[plans.<name>]``: a paper's baseline), always played.

Every layout is priced by `loom.planner.estimate` (stage times of the mean microbatch, the
memory each position holds at its peak); a plan over the GPU's memory is pruned, with the
memory it needs. The ``simulate_top`` fastest estimates are then played by the simulator on
the scenario's real microbatches (per-microbatch token counts from the data mix), under each
policy of ``policies``; a played plan whose simulated peak memory exceeds the GPU is pruned
too. The fastest played plan wins.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.cost.model import Workload
from loom.plan.plan import LLM, PLACEMENTS, RECOMPUTE_MODES, ModuleSpec, Plan, PlanError
from loom.planner.entrain_macro import entrain_layouts
from loom.planner.estimate import BUBBLE_SHARE, Estimate, TokenWindows, estimate, expected_max
from loom.planner.partition import SearchCandidate, loosely_coupled_search, partition
from loom.sim.result import SimResult
from loom.sim.scenario import Scenario, ScenarioError

GiB = 2**30
CORNSTARCH_SLACK = 2.0  # Cornstarch's layouts kept within this factor of the fastest one (`_cornstarch_layouts`)
SCHEDULE_CHOICES = ("1f1b", "interleaved", "zb-h1", "gpipe")


@dataclass(frozen=True)
class SearchSpace:
    """What the search varies (module docstring); every field narrows it."""

    placements: tuple[str, ...] = ("first_stage", "colocated", "disaggregated")
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    context_parallel: tuple[int, ...] = (1,)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    microbatch_samples: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb-h1")  # interleaved: 1F1B with 2 chunks
    orchestrations: int = 4  # DistTrain's fastest layouts taken as disaggregated candidates
    cornstarch: int = 2  # Cornstarch's fastest loosely-coupled layouts per (TP, CP, DP) taken likewise; 0: none
    entrain: int = 4  # Entrain's fastest macro-plan configurations (`loom.planner.entrain_macro`) likewise; 0: none
    policies: tuple[str, ...] = ("none",)
    simulate_top: int = 4  # plans simulated at least (`_play`)
    simulate_budget: int = 24_000  # and more while their units x microbatches per pipeline sum below this

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> "SearchSpace":
        """The ``[search]`` table of a scenario (`loom.sim.scenario`, types checked there):
        choices checked here, each error naming ``search.<field>``."""
        from loom.balance.policy import POLICIES

        choices = {"placements": PLACEMENTS, "schedules": SCHEDULE_CHOICES, "recompute": RECOMPUTE_MODES,
                   "zero_stages": (0, 1, 2, 3), "policies": tuple(POLICIES)}
        out = {}
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in table.items():
            if key not in known:
                raise ScenarioError(f"unknown field search.{key}; known: {sorted(known)}")
            if isinstance(value, list):
                if not value:
                    raise ScenarioError(f"search.{key} = []: give at least one choice")
                bad = [v for v in value if key in choices and v not in choices[key]]
                if bad:
                    raise ScenarioError(f"search.{key}: unknown choice(s) {bad}; choose among {list(choices[key])}")
                value = tuple(value)
            out[key] = value
        return cls(**out)


@dataclass
class Candidate:
    """One plan the search priced: its estimate, and when played its simulation under
    ``policy``; ``verdict`` says why it won, lost or was pruned."""

    layout: str
    plan: Plan | None
    estimate: Estimate | None
    verdict: str = ""
    simulated: SimResult | None = None
    policy: str = "none"
    batch_flops: float = 0.0  # the global batch's model FLOPs (an MFU for estimated rows)
    strategy: str = ""  # which strategy proposed the layout (`STRATEGIES`); "given": the scenario's own plan

    @property
    def iteration_time(self) -> float:
        if self.simulated is not None:
            return self.simulated.iteration_time
        return self.estimate.iteration_time if self.estimate is not None else math.inf


@dataclass
class SearchResult:
    """The winner, every candidate priced (the played ones first, fastest first) and counts."""

    best: Candidate
    candidates: list[Candidate]
    priced: int
    pruned_memory: int
    seconds: float
    techniques: list[str] = field(default_factory=list)


def search(scenario: Scenario, space: SearchSpace = SearchSpace()) -> SearchResult:
    """The fastest memory-feasible plan for ``scenario`` over ``space`` (module docstring).
    Raises `ScenarioError` when no plan fits, naming the least memory any layout needs."""
    t0 = time.perf_counter()
    capacity = scenario.memory_capacity()
    pricer = _Pricer(scenario)
    priced: list[Candidate] = []
    least = math.inf  # the least memory a pruned layout needs
    count = pruned = 0
    for strategy, layout in _strategy_layouts(scenario, space, pricer):
        # under a token budget the budget cuts the batch: one microbatch count per layout
        for samples in space.microbatch_samples[:1] if scenario.microbatch_tokens else space.microbatch_samples:
            mb = _microbatches(scenario, layout, samples, pricer)
            if mb is None:
                continue
            allowed = [z for z in space.zero_stages  # the colocated runtime runs no ZeRO
                       if not z or (min(s.data_parallel for s in layout.modules) > 1 and layout.placement != "colocated")]
            for name in space.schedules:
                schedule, chunks = ("1f1b", 2) if name == "interleaved" else (name, 1)
                zeros = list(allowed)
                for recompute in space.recompute:  # more recompute is only slower: worth it for a lower ZeRO stage
                    for zero in zeros:
                        try:
                            plan = pricer.plan(layout, mb, schedule, chunks, zero, recompute)
                        except PlanError:
                            break
                        count += 1
                        est = pricer.estimate(plan)
                        if est.peak_memory > capacity:
                            least = min(least, est.peak_memory)
                            pruned += 1
                            continue
                        priced.append(Candidate(_layout_label(plan), plan, est, batch_flops=pricer.batch_flops,
                                                strategy=strategy))
                        zeros = zeros[:zeros.index(zero)]  # a higher ZeRO stage only adds communication
                        break
                    if not zeros:
                        break
    if not priced:
        raise ScenarioError(
            f"no plan fits {scenario.cluster.num_gpus} x {scenario.cluster.spec.name} "
            f"({capacity / GiB:.0f} GiB each): the least memory any layout the search priced needs is "
            f"{least / GiB:.1f} GiB per GPU; use GPUs with more memory, more of them, or a smaller global batch")
    priced.sort(key=lambda c: c.iteration_time)
    played = _play(scenario, priced, space, capacity) + _play_given(scenario, pricer, space, capacity)
    was_played = {id(c.plan) for c in played}
    rest = [c for c in priced if id(c.plan) not in was_played]
    for c in rest:
        c.verdict = "not played"
    candidates = played + rest
    fitting = [c for c in played if not c.verdict.startswith("pruned")] if space.simulate_top else priced[:1]
    if not fitting:
        raise ScenarioError(f"every played plan exceeds {capacity / GiB:.0f} GiB per GPU in simulation; raise "
                            f"simulate_top or use GPUs with more memory")
    best = min(fitting, key=lambda c: c.iteration_time)
    for c in played:
        if c is best:
            c.verdict = "best"
        elif not c.verdict:
            c.verdict = f"lost: {c.iteration_time / best.iteration_time:.3f}x the best"
    candidates.sort(key=lambda c: (c.simulated is None, c.verdict.startswith("pruned"), c.iteration_time))
    return SearchResult(best, candidates, count, pruned, time.perf_counter() - t0, techniques(best))


def _play_given(scenario: Scenario, pricer: "_Pricer", space: SearchSpace, capacity: float) -> list[Candidate]:
    """The scenario's own plans (``[plans.<name>]``, e.g. the baseline a paper compares
    against) played as candidates too: the search never returns a plan slower than one it was
    given. Outside the budget, and never pruned by the estimate."""
    given = []
    for name, plan in scenario.plans.items():
        plan = plan.resolve(scenario.arch.layer_counts(), generators=scenario.arch.generator_names)
        est = estimate(plan, scenario.cost_model(plan), pricer.mean(plan.num_microbatches))
        given.append(Candidate(f"{_layout_label(plan)} [the scenario's plans.{name}]", plan, est, strategy="given",
                               batch_flops=pricer.batch_flops))
    return _play(scenario, given, dataclasses.replace(space, simulate_budget=0), capacity, limit=len(given))


def _play(scenario: Scenario, priced: list[Candidate], space: SearchSpace, capacity: float,
          limit: int | None = None) -> list[Candidate]:
    """Simulate the plans in order of their estimates, under each policy: at least
    ``simulate_top`` that fit the GPU's memory in simulation, then more while the simulation
    budget lasts (``simulate_budget``: pipeline units times microbatches per pipeline, summed
    over the played plans, what a simulation's work grows with): a small space is simulated
    far down its estimates, whose errors (tens of percent on skewed data) then cannot hide its
    best; a cluster-scale one as far as the time allows."""
    played: list[Candidate] = []
    fitting = spent = 0
    for c in priced:
        cost = c.plan.num_units * len(c.plan.microbatches_of(LLM, 0))
        if limit is None and fitting >= space.simulate_top and spent + cost > space.simulate_budget:
            break
        spent += cost
        fits = False
        for policy in space.policies:
            try:
                result = scenario.run_balanced(c.plan, policy).result  # with the dispatcher, as `loom simulate`
            except (PlanError, ScenarioError, ValueError) as e:  # a policy that does not apply to the plan
                played.append(dataclasses.replace(c, verdict=f"pruned: {e}", policy=policy))
                continue
            verdict = ""
            peak = max(result.peak_memory.values())
            if peak > capacity:
                verdict = f"pruned: simulated peak {peak / GiB:.1f} GiB > {capacity / GiB:.0f} GiB"
            else:
                fits = True
            played.append(dataclasses.replace(c, simulated=result, policy=policy, verdict=verdict))
        fitting += fits
    return played


def all_plans(scenario: Scenario, space: SearchSpace = SearchSpace()) -> Iterator[Plan]:
    """Every plan of ``space`` the search could price, without its memory pruning or its
    dominance rule (the lowest fitting ZeRO stage per recompute mode): the brute force the
    search is checked against (``benchmarks/plan_search.py``, ``search_regret``)."""
    pricer = _Pricer(scenario)
    for strategy, layout in _strategy_layouts(scenario, space, pricer):
        for samples in space.microbatch_samples[:1] if scenario.microbatch_tokens else space.microbatch_samples:
            mb = _microbatches(scenario, layout, samples, pricer)
            if mb is None:
                continue
            for name in space.schedules:
                schedule, chunks = ("1f1b", 2) if name == "interleaved" else (name, 1)
                for recompute in space.recompute:
                    for zero in space.zero_stages:
                        if zero and (min(s.data_parallel for s in layout.modules) < 2 or layout.placement == "colocated"):
                            continue
                        try:
                            yield pricer.plan(layout, mb, schedule, chunks, zero, recompute)
                        except PlanError:
                            continue


# ---- the layouts --------------------------------------------------------------------------------
# What proposed a layout, in the papers' words (`techniques` names the winner's)
STRATEGIES = {
    "megatron": "Megatron-LM layout",
    "megatron-mllm": "Megatron-LM's MLLM layout (encoders and generators as extra stages at the LLM's TP and DP)",
    "optimus": "Optimus (colocated encoders, bubble fill)",
    "cornstarch": "Cornstarch's loosely-coupled modality parallelism (each encoder its own pipeline depth)",
    "disttrain": "DistTrain's orchestration (each module its own GPUs and degrees)",
    "entrain": "Entrain's macro planning (GPUs per module in proportion to their work, each module its own degrees)",
}


def _layouts(scenario: Scenario, space: SearchSpace, pricer: "_Pricer | None" = None) -> Iterator[Plan]:
    """Plan templates: placement, each module's TP, CP, DP and stage count (module docstring);
    ZeRO, recompute, microbatches, schedule and boundaries are filled in later. ``pricer``
    (the search's own, to share its caches) ranks Cornstarch's candidates."""
    return (layout for _, layout in _strategy_layouts(scenario, space, pricer))


def _strategy_layouts(scenario: Scenario, space: SearchSpace,
                      pricer: "_Pricer | None" = None) -> Iterator[tuple[str, Plan]]:
    """`_layouts` with the strategy that proposed each (a key of `STRATEGIES`); a layout two
    strategies propose is priced once, under the first."""
    seen: set[tuple] = set()
    for strategy, layout in _proposals(scenario, space, pricer):
        key = (layout.placement, layout.bubble_fill, tuple(
            (m.name, m.data_parallel, m.tensor_parallel, m.context_parallel, m.num_stages) for m in layout.modules))
        if key not in seen:
            seen.add(key)
            yield strategy, layout


def _proposals(scenario: Scenario, space: SearchSpace, pricer: "_Pricer | None") -> Iterator[tuple[str, Plan]]:
    arch, cluster = scenario.arch, scenario.cluster
    n, layers = cluster.num_gpus, arch.layer_counts()
    others = arch.encoder_names + arch.generator_names
    for placement in space.placements:
        if placement != "disaggregated" and arch.generator_names:
            continue  # generators run on ranks of their own
        if placement == "disaggregated" and not others:
            continue  # a text-only model: the same as first_stage
        for tp in space.tensor_parallel:
            if tp > cluster.gpus_per_node or not _divides_heads(scenario, tp):
                continue
            for cp in space.context_parallel:
                if placement == "colocated" and (cp > 1 or not arch.encoder_names):
                    continue
                if placement == "disaggregated":
                    yield from (("megatron-mllm", p) for p in _megatron_layouts(scenario, tp, cp))
                    continue
                for pp in _divisors(n // (tp * cp)) if n % (tp * cp) == 0 else []:
                    dp = n // (tp * cp * pp)
                    if pp > layers[LLM]:
                        continue
                    units = pp * dp
                    encoders = [ModuleSpec(e, data_parallel=units if placement == "colocated" else dp, tensor_parallel=tp)
                                for e in arch.encoder_names]
                    llm = ModuleSpec(LLM, data_parallel=dp, num_stages=pp, tensor_parallel=tp, context_parallel=cp)
                    yield ("optimus" if placement == "colocated" else "megatron",
                           Plan([*encoders, llm], placement=placement,
                                bubble_fill="optimus" if placement == "colocated" else "none"))
    if "disaggregated" in space.placements and arch.encoder_names and space.cornstarch:
        yield from (("cornstarch", p) for p in _cornstarch_layouts(scenario, space, pricer or _Pricer(scenario)))
    if "disaggregated" in space.placements and others and space.orchestrations:
        yield from (("disttrain", p) for p in _orchestrated_layouts(scenario, space))
    yield from (("entrain", p) for p in entrain_layouts(scenario, space, space.entrain))


def _megatron_layouts(scenario: Scenario, tp: int, cp: int) -> Iterator[Plan]:
    """Each encoder and generator one stage at the LLM's TP and DP, the LLM on the rest."""
    arch, n = scenario.arch, scenario.cluster.num_gpus
    others = arch.encoder_names + arch.generator_names
    for dp in _divisors(n // tp):
        rest = n - len(others) * tp * dp
        if rest <= 0 or rest % (tp * cp * dp):
            continue
        pp = rest // (tp * cp * dp)
        if pp > arch.layer_counts()[LLM]:
            continue
        yield Plan([*(ModuleSpec(e, data_parallel=dp, tensor_parallel=tp) for e in arch.encoder_names),
                    ModuleSpec(LLM, data_parallel=dp, num_stages=pp, tensor_parallel=tp, context_parallel=cp),
                    *(ModuleSpec(g, data_parallel=dp, tensor_parallel=tp) for g in arch.generator_names)])


def _cornstarch_layouts(scenario: Scenario, space: SearchSpace, pricer: "_Pricer") -> Iterator[Plan]:
    """Cornstarch's loosely-coupled modality parallelism (cornstarch.md §2.6, Algorithm 1; §3.1),
    each encoder and generator at its own pipeline depth: for every TP (within a node, dividing
    the heads), CP and DP, the ``space.cornstarch`` fastest of Algorithm 1's candidates by the
    estimate (`_loosely_coupled`), of those within ``CORNSTARCH_SLACK`` times the fastest of
    them all. The slack spares the search the many layouts a large cluster's small TP and DP
    give (a 70B LLM at TP 1 estimates 5x slower than at TP 8), whose pricing would cost more
    than Algorithm 1 itself; it is wide, as the ranking sees one microbatch size and schedule
    of the many the search then prices. TPs are taken largest first, where a large LLM runs
    fastest, so that the bound cuts the rest early: which layouts are kept does not depend on
    the order. A candidate with every other module in one stage on all the GPUs is Megatron-LM's
    MLLM layout, which `_megatron_layouts` yields already."""
    n, per_node = scenario.cluster.num_gpus, scenario.cluster.gpus_per_node
    others = scenario.arch.encoder_names + scenario.arch.generator_names
    fastest = math.inf
    found = []
    for tp in sorted(space.tensor_parallel, reverse=True):
        if tp > per_node or not _divides_heads(scenario, tp):
            continue
        for cp in space.context_parallel:
            for dp in _divisors(n // tp):
                got = _loosely_coupled(scenario, space, pricer, tp, cp, dp, space.cornstarch,
                                       CORNSTARCH_SLACK * fastest)
                if got is not None:
                    found.append(got)
                    fastest = min(fastest, got[2][0][0])
    for template, _, ranked in found:
        for t, c in ranked[:space.cornstarch]:
            if t <= CORNSTARCH_SLACK * fastest and (c.devices < n or any(c.stage_counts[m] > 1 for m in others)):
                yield template(c.stage_counts)


def _loosely_coupled(scenario: Scenario, space: SearchSpace, pricer: "_Pricer", tp: int, cp: int, dp: int,
                     keep: int, cutoff: float = math.inf) -> tuple[Callable[[dict[str, int]], Plan],
                                                                   Callable[[dict[str, int]], float],
                                                                   list[tuple[float, SearchCandidate]]] | None:
    """Algorithm 1 (cornstarch.md §2.6) at this TP, CP and DP: ``(template, price, ranked)``,
    ``template(stage_counts)`` the layout, ``price(stage_counts)`` the iteration time that ranks
    it, ``ranked`` the candidates ``price`` puts first as ``(seconds, candidate)``, fastest first
    (those that fit the GPU's memory: at least the ``keep`` fastest, or every one faster than
    ``cutoff`` where fewer are); None when none is ranked.

    Every module's stage is replicated DP times at its TP (encoders and generators at CP 1:
    Cornstarch runs CP on the LLM only, cornstarch.md §4.2.1), so a stage costs that many of
    the budget's GPUs (``ranks_per_stage``) and a candidate may leave some idle, as the paper's
    "up to 24 GPUs" does. The layer costs are the frozen-aware ``F + B`` (§3.2.2) of the mean
    microbatch at the space's first microbatch size that gives this DP one; generators are
    matched to the LLM's stage time as encoders are (as `loom simulate --compare`'s
    frozen-aware plan does).

    `loosely_coupled_search` gives the candidates (Algorithm 1's first loop: per LLM depth
    ``i`` its bottleneck ``t_i`` and each other module's fewest stages meeting it; where those
    overshoot the budget, ``fill_budget``: the stages left, at their least bottleneck, so that
    a budget one encoder stage short of ``t_i`` still has its best split). Its second loop,
    the ranking, is by the search's estimate, not the simulator (the search simulates
    only its best): under the space's first schedule with its cheapest ZeRO stage and
    recompute mode, or where that is over the GPU's memory its leanest (``inf`` when neither
    fits). Estimates cost milliseconds and a deep LLM has a candidate per depth, so they are
    taken in order of a lower bound on it until the bound reaches the ``keep``-th fastest or
    ``cutoff``: exact. The estimate's pipeline term is ``spread (m t_max + f (sum_k t_k -
    t_max))`` (`loom.planner.estimate`: ``m`` microbatches per pipeline, ``f`` the schedule's
    bubble share), at least ``spread ((m - f) t_i + f W)`` with ``W`` the LLM's work, since the
    LLM's layers cost at least what Algorithm 1 partitioned (the same compute, TP within a
    node; ZeRO and recompute only add), so its slowest position at least ``t_i``, the least
    bottleneck of any split into ``i`` stages. Interleaved positions are not contiguous, and
    CP's links are not the partition's: there every candidate is priced.
    """
    arch, n = scenario.arch, scenario.cluster.num_gpus
    others = arch.encoder_names + arch.generator_names
    ranks = {**{m: tp * dp for m in others}, LLM: tp * cp * dp}
    if sum(ranks.values()) > n:  # not even one stage each
        return None

    def template(counts: dict[str, int]) -> Plan:
        return Plan([*(ModuleSpec(e, data_parallel=dp, tensor_parallel=tp, num_stages=counts[e])
                       for e in arch.encoder_names),
                     ModuleSpec(LLM, data_parallel=dp, num_stages=counts[LLM], tensor_parallel=tp, context_parallel=cp),
                     *(ModuleSpec(g, data_parallel=dp, tensor_parallel=tp, num_stages=counts[g])
                       for g in arch.generator_names)])

    one = template(dict.fromkeys(ranks, 1))
    sizes = (_microbatches(scenario, one, s, pricer) for s in space.microbatch_samples)
    mb = next((k for k in sizes if k is not None), None)
    zeros = sorted(z for z in space.zero_stages if not z or dp > 1)
    if mb is None or not zeros:
        return None
    modes = sorted(space.recompute, key=RECOMPUTE_MODES.index)
    one.num_microbatches = mb
    for spec in one.modules:
        spec.recompute = modes[0]
    costs = {m: pricer.layer_costs(one, m) for m in ranks}
    name = space.schedules[0]
    schedule, chunks = ("1f1b", 2) if name == "interleaved" else (name, 1)
    settings = [(zeros[0], modes[0]), (zeros[-1], modes[-1])]  # the cheapest, then the leanest

    def price(counts: dict[str, int]) -> float:
        layout = template(counts)
        for zero, recompute in settings:
            try:
                plan = pricer.plan(layout, mb, schedule, chunks, zero, recompute)
            except PlanError:
                continue
            t = pricer.estimate(plan).iteration_time  # inf over the GPU's memory
            if math.isfinite(t):
                return t
        return math.inf

    try:  # the first loop only: the candidates are ranked below
        found = loosely_coupled_search(costs[LLM], {m: costs[m] for m in others}, n, lambda counts: 0.0,
                                       ranks_per_stage=ranks, fill_budget=True)
    except ValueError:  # the fewest stages the other modules need leave the LLM none
        return None
    candidates = [c for c in found.candidates if c.within_budget]
    bound = dict.fromkeys(map(id, candidates), 0.0)
    if chunks == 1 and cp == 1 and scenario.cluster.gpus_per_node % tp == 0:
        m, f, work = mb // dp, BUBBLE_SHARE.get(schedule, 1.0), math.fsum(costs[LLM])
        pricer.mean(mb)  # the microbatch sizes the estimate's spread is drawn from
        for c in candidates:  # (m - f) x its slowest position (>= t_i) + f x all positions (>= the LLM's work)
            spread = expected_max(pricer._sizes[mb], sum(c.stage_counts.values()))
            bound[id(c)] = spread * ((m - f) * c.target_stage_time + f * work) * (1 - 1e-9)
    ranked: list[tuple[float, SearchCandidate]] = []
    for c in sorted(candidates, key=lambda c: (bound[id(c)], c.devices)):
        if bound[id(c)] >= min(cutoff, ranked[keep - 1][0] if len(ranked) >= keep else math.inf):
            break
        t = price(c.stage_counts)
        if math.isfinite(t):
            bisect.insort(ranked, (t, c), key=lambda r: (r[0], r[1].devices))
    return (template, price, ranked) if ranked else None


def _orchestrated_layouts(scenario: Scenario, space: SearchSpace) -> Iterator[Plan]:
    """DistTrain's orchestration's fastest layouts (`loom.planner.orchestration`)."""
    from loom.planner.orchestration import scenario_inputs

    tps = {m: [t for t in space.tensor_parallel if t <= scenario.cluster.gpus_per_node]
           for m in scenario.arch.module_names}
    try:
        layouts = scenario_inputs(scenario).orchestrate(tps, keep=space.orchestrations)
    except ValueError:  # nothing fits the formulation's memory check
        return
    for o in layouts:
        yield Plan([ModuleSpec(m, data_parallel=o.dp[m], tensor_parallel=o.tp[m], num_stages=o.pp[m])
                    for m in scenario.arch.module_names])


def _divides_heads(scenario: Scenario, tp: int) -> bool:
    return all(layer.heads % tp == 0 for name in [*scenario.arch.encoder_names, LLM]
               for layer in scenario.arch.module(name).layers if layer.kind == "block")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatches(scenario: Scenario, layout: Plan, samples: int, pricer: "_Pricer") -> int | None:
    """The plan's microbatch count for ``samples`` per microbatch: whole microbatches per LLM
    replica, the global batch shared among them (None when a replica would get none). Under a
    token budget (``data.microbatch_tokens``) the budget decides: its count, once."""
    dp = layout.spec(LLM).data_parallel
    if scenario.microbatch_tokens:
        try:
            return len(scenario.token_budget_sizes(pricer.metas, 1, dp))
        except ScenarioError:  # more microbatches than samples at this DP
            return None
    per_replica = scenario.global_batch_size // (dp * samples)
    if per_replica < 1:
        return None
    return per_replica * dp


class _Pricer:
    """Builds and prices plans, keeping what candidates share: each microbatch count's mean
    workload, each (module, TP, CP, recompute, microbatch) layer cost list for the partition."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.metas = scenario.metas()
        one = Plan([ModuleSpec(m) for m in scenario.arch.module_names]).resolve(
            scenario.arch.layer_counts(), generators=scenario.arch.generator_names)
        self._flops = scenario.cost_model(one)  # model FLOPs depend on the model only
        self.batch_flops = 0.0
        self._means: dict[int, dict[str, Workload]] = {}
        self._sizes: dict[int, list[float]] = {}
        self._tokens: dict[int, TokenWindows] = {}
        self._layer_costs: dict[tuple, list[float]] = {}
        self._partitions: dict[tuple, list[int]] = {}

    def mean(self, num_microbatches: int) -> dict[str, Workload]:
        """The mean microbatch of the first global batch cut into ``num_microbatches`` (as
        `Scenario.batch_work` cuts it: under a token budget, at least that many)."""
        m = self._means.get(num_microbatches)
        if m is None:
            work = self.scenario.batch_work(self.metas, num_microbatches)
            m = self._means[num_microbatches] = {
                name: Workload(*(round(sum(getattr(w.get(name, Workload()), f) for w in work) / len(work))
                                 for f in ("tokens", "attn_sq", "segments")))
                for name in self.scenario.arch.module_names}
            # each microbatch's model FLOPs over the mean: how unequal they are (`expected_max`)
            flops = np.array([self._flops.model_flops(w) for w in work])
            self.batch_flops = float(flops.sum())
            self._sizes[num_microbatches] = list(flops / flops.mean()) if flops.mean() > 0 else []
            self._tokens[num_microbatches] = TokenWindows([sum(x.tokens for x in w.values()) for w in work])
        return m

    def layer_costs(self, plan: Plan, name: str) -> list[float]:
        spec = plan.spec(name)
        key = (name, spec.tensor_parallel, spec.context_parallel, spec.recompute, plan.num_microbatches)
        costs = self._layer_costs.get(key)
        if costs is None:
            one = Plan([ModuleSpec(m.name, tensor_parallel=m.tensor_parallel, context_parallel=m.context_parallel,
                                   recompute=m.recompute) for m in plan.modules])
            one.resolve(self.scenario.arch.layer_counts(), generators=self.scenario.arch.generator_names)
            model = self.scenario.cost_model(one)
            mean = self.mean(plan.num_microbatches)
            for m in plan.modules:
                self._layer_costs[(m.name, m.tensor_parallel, m.context_parallel, m.recompute, plan.num_microbatches)] = [
                    c.forward + c.backward for c in model.module_layer_costs(m.name, mean[m.name])]
            costs = self._layer_costs[key]
        return costs

    def plan(self, layout: Plan, num_microbatches: int, schedule: str, chunks: int, zero: int, recompute: str) -> Plan:
        """``layout`` with these settings and its boundaries by cost (module docstring)."""
        modules = [dataclasses.replace(m, zero_stage=zero if m.data_parallel > 1 else 0, recompute=recompute,
                                       num_stages=m.num_stages * (chunks if m.name == LLM else 1),
                                       virtual_stages=chunks if m.name == LLM else 1, stage_boundaries=None)
                   for m in layout.modules]
        plan = Plan(modules, num_microbatches=num_microbatches, schedule=schedule, placement=layout.placement,
                    bubble_fill=layout.bubble_fill)
        for m in plan.modules:
            if m.num_stages > 1:
                costs = list(self.layer_costs(plan, m.name))
                if m.name == LLM and plan.placement == "first_stage":  # the hosted encoders run on position 0
                    costs[0] += sum(sum(self.layer_costs(plan, e)) for e in plan.encoder_names)
                if m.num_stages > len(costs):
                    raise PlanError(f"{m.name}: {m.num_stages} stages for {len(costs)} layers")
                key = (m.name, m.tensor_parallel, m.context_parallel, m.recompute, plan.num_microbatches,
                       plan.placement, m.num_stages)
                if key not in self._partitions:
                    self._partitions[key] = partition(costs, m.num_stages)[0]
                m.stage_boundaries = list(self._partitions[key])
        # a disaggregated plan may leave GPUs idle: DistTrain's x + y + z <= N (disttrain.md §3.1),
        # Cornstarch's device budget (cornstarch.md §2.6); every other placement fills them
        n = self.scenario.cluster.num_gpus
        plan.resolve(self.scenario.arch.layer_counts(), None if plan.placement == "disaggregated" else n,
                     generators=self.scenario.arch.generator_names)
        if plan.world_size > n:
            raise PlanError(f"plan needs {plan.world_size} ranks; the cluster has {n} GPUs")
        return plan

    def estimate(self, plan: Plan) -> Estimate:
        """`loom.planner.estimate.estimate`, unpriced over the GPU's memory."""
        mean = self.mean(plan.num_microbatches)
        n = plan.num_microbatches
        return estimate(plan, self.scenario.cost_model(plan), mean, self._sizes[n], self.scenario.memory_capacity(),
                        self._tokens[n])


# ---- reporting ----------------------------------------------------------------------------------
def _layout_label(plan: Plan) -> str:
    parts = []
    for m in plan.modules:
        if plan.hosted_by_llm(m.name):
            where = "in llm.0" if plan.placement == "first_stage" else f"dp {m.data_parallel} on the llm's units"
            parts.append(f"{m.name} {where} tp{m.tensor_parallel}")
        else:
            parts.append(f"{m.name} {m.pipeline_depth}x{m.data_parallel}x{m.tensor_parallel}x{m.context_parallel}")
    llm = plan.spec(LLM)
    sched = plan.schedule + (f" v{llm.virtual_stages}" if llm.virtual_stages > 1 else "")
    mb = plan.num_microbatches // llm.data_parallel
    return (", ".join(parts) + f"; {sched}, {mb} mb/pipeline, zero {llm.zero_stage}, recompute {llm.recompute}")


def techniques(c: Candidate) -> list[str]:
    """What the winning plan uses, in the papers' words."""
    plan, out = c.plan, []
    llm = plan.spec(LLM)
    given = "[the scenario's plans." in c.layout
    if given:  # the search's own candidates lost to it
        out.append("the scenario's own plan (played as a candidate; the search's space found nothing faster)")
    if c.strategy == "megatron":
        out.append(STRATEGIES["megatron"] + (" (encoders in the first stage)" if plan.encoder_names else ""))
    elif c.strategy in STRATEGIES:
        out.append(STRATEGIES[c.strategy])
    if llm.virtual_stages > 1:
        out.append(f"interleaved 1F1B ({llm.virtual_stages} chunks)")
    if plan.schedule == "zb-h1":
        out.append("zero-bubble ZB-H1")
    if not given and any(m.stage_boundaries and m.num_stages > 1 for m in plan.modules):
        out.append("stage boundaries by cost (frozen-aware partition)")
    if llm.zero_stage:
        out.append(f"ZeRO-{llm.zero_stage}")
    if llm.recompute != "none":
        out.append(f"{llm.recompute} recompute")
    if c.policy != "none":
        out.append(f"{c.policy} balancing")
    return out
