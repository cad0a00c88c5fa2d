"""DistTrain's disaggregated model orchestration (disttrain.md §3.1-3.2, Algorithm 1): how many
GPUs, and which TP, DP and pipeline depth, each module (encoders, the LLM, generators) gets.

The formulation (§3.1): with ``C_m(TP)`` module ``m``'s forward + backward seconds for one
microbatch (one sequence; TP communication inside), the LLM at ``TP_lm x DP_lm x PP_lm = y`` GPUs
and every other module one stage at ``TP_m x DP_m = x_m`` GPUs, a 1F1B iteration of ``BS``
sequences takes

    T = C_lm + sum_m b_m / x_m + K * max(a / y, max_m b_m / x_m)

with ``a = DP_lm TP_lm C_lm(TP_lm)``, ``b_m = DP_lm TP_m C_m(TP_m)`` and ``K = BS / DP_lm - 1``
(eqs. 1-2: the warm-up through every module, then the steady phase paced by the slowest stage;
an encoder's microbatch is ``DP_lm / DP_m`` sequences). ``sum x_m + y <= N``.

Solving it (§3.2): the parallelism set is the Cartesian product of TP in ``{1, 2, 4, 8}`` per
module and ``DP_lm`` a divisor of ``BS``; for each element the remaining problem in the GPU
counts is convex, and its continuous optimum has a closed form: GPUs in proportion ``y : x_m = a : b_m``, which equalises the stages. The integer plan is the best
of the pipeline depths around it (one below its floor to one above its ceiling), each module's
GPUs in whole TP groups around its share of the rest likewise; every candidate is priced with
the exact ``T`` above and kept only if ``fits`` (a memory check) accepts it. Algorithm 1 keeps
the fastest over the set. A depth whose LLM alone (``C_lm + K C_lm / PP`` plus its
communication) already takes longer than the layouts kept is skipped before its allocations
are priced: a bound, exact, since no allocation of the other modules shortens ``T`` below it. Against exhaustive enumeration of the same ``T`` on small instances
(`tests/test_orchestration.py`) the rounding stays within 1 %.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from loom.cost.model import Workload
from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError
from loom.sim.scenario import Scenario

TP_CHOICES = (1, 2, 4, 8)

# ``fits(module, tp, dp, pp)``: whether that module layout fits the GPUs' memory
FitCheck = Callable[[str, int, int, int], bool]


@dataclass(frozen=True)
class Orchestration:
    """The chosen layout: per module its TP, DP and pipeline depth (1 but for the LLM) and GPUs;
    the iteration time of the formulation, and how many (parallelism, allocation) candidates
    were priced."""

    tp: dict[str, int]
    dp: dict[str, int]
    pp: dict[str, int]
    iteration_time: float
    candidates: int = 0
    gpus: dict[str, int] = field(default_factory=dict)


def iteration_time(costs: Mapping[str, Mapping[int, float]], batch_size: int, tp: Mapping[str, int],
                   dp: Mapping[str, int], pp_llm: int) -> float:
    """``T`` of the module docstring for a whole layout (the LLM ``tp[llm] x dp[llm] x pp_llm``,
    every other module one stage of ``tp[m] x dp[m]``)."""
    dp_lm = dp[LLM]
    c_lm = costs[LLM][tp[LLM]]
    stage = c_lm / pp_llm
    warm = c_lm
    for m in costs:
        if m != LLM:
            t = dp_lm / dp[m] * costs[m][tp[m]]  # its microbatch: DP_lm / DP_m sequences
            warm += t
            stage = max(stage, t)
    return warm + (batch_size / dp_lm - 1) * stage


def orchestrate(costs: Mapping[str, Mapping[int, float]], batch_size: int, num_gpus: int, llm_layers: int,
                tp_choices: Mapping[str, Sequence[int]] | None = None, fits: FitCheck | None = None,
                keep: int = 1, overhead: Callable[[int, int, int], float] | None = None,
                encoders: Sequence[str] = (), align: int = 1) -> list[Orchestration]:
    """Algorithm 1 over ``costs[module][tp]`` (seconds per microbatch of one sequence, forward
    plus backward, for every TP the module may take; ``tp_choices`` narrows them per module,
    DistTrain's experiments fix encoder and generator TP to 1), ``batch_size`` sequences,
    ``num_gpus`` GPUs, an LLM of ``llm_layers`` layers (its depth at most that).
    ``overhead(tp_lm, dp_lm, pp)`` adds the LLM's communication the paper prices as volume over
    bandwidth (§3.1: its data-parallel gradient sync, ``PP`` times one stage's output message).
    ``encoders`` (the modules laid out before the LLM) take a multiple of ``align`` GPUs in all
    when the LLM runs TP (a node's GPUs: its TP groups then stay inside nodes, as DistTrain's
    do). Returns the
    ``keep`` fastest layouts by the formulation, fastest first (Algorithm 1 keeps one; a planner
    keeps several for the simulator to decide among). Raises ValueError naming what is missing
    when nothing fits."""
    if LLM not in costs:
        raise ValueError(f"costs has no {LLM!r} entry; give the LLM's seconds per microbatch by TP degree")
    if batch_size < 1 or num_gpus < 1 or llm_layers < 1:
        raise ValueError(f"batch_size = {batch_size}, num_gpus = {num_gpus}, llm_layers = {llm_layers}: all must be "
                         f"at least 1")
    others = [m for m in costs if m != LLM]
    choices = {m: sorted(set((tp_choices or {}).get(m, costs[m].keys())) & set(costs[m])) for m in costs}
    empty = [m for m, c in choices.items() if not c]
    if empty:
        raise ValueError(f"modules {empty} have no TP degree both in tp_choices and in costs; give costs for them")
    fits = fits or (lambda module, tp, dp, pp: True)
    # (time, order found, LLM dp, tp per module, pp, dp per other module): ties keep the first
    # the `keep` fastest so far, a max-heap on (time, order found): ties keep the first found
    kept: list[tuple[float, int, int, tuple[int, ...], int, tuple[int, ...]]] = []
    priced = order = 0
    fits_memo: dict[tuple[str, int, int], bool] = {}
    for dp_lm in _divisors(batch_size):
        steady = batch_size / dp_lm - 1  # K: microbatches of an LLM pipeline after the first
        for tp_lm in choices[LLM]:
            c_lm = costs[LLM][tp_lm]
            a = dp_lm * tp_lm * c_lm
            per_pp = dp_lm * tp_lm  # GPUs per LLM pipeline stage
            if per_pp > num_gpus:
                continue
            for tps in _product([choices[m] for m in others]):
                tp = dict(zip(others, tps))
                b = {m: dp_lm * tp[m] * costs[m][tp[m]] for m in others}
                total = a + sum(b.values())
                share = num_gpus * a / total if total > 0 else num_gpus  # the closed-form y
                lo = math.floor(share / per_pp)  # the depths around the closed form's share, one step wider
                depths = {max(1, min(llm_layers, d)) for d in range(lo - 1, lo + 3)}
                for pp in sorted(depths):
                    rest = num_gpus - pp * per_pp
                    if rest < sum(tps) or not fits(LLM, tp_lm, dp_lm, pp):
                        continue
                    extra = overhead(tp_lm, dp_lm, pp) if overhead is not None else 0.0
                    # branch and bound, exact: no allocation makes T shorter than the LLM alone does
                    if len(kept) >= keep and c_lm + steady * c_lm / pp + extra >= -kept[0][0]:
                        continue
                    before = [m for m in others if m in encoders] if tp_lm > 1 and align > 1 else []
                    for dp in _allocations(others, tp, b, rest, before, align):
                        priced += 1
                        if not all(_memo(fits_memo, fits, m, tp[m], dp[m]) for m in others):
                            continue
                        # `iteration_time`, inline: a / y = C_lm / PP, b_m / x_m = DP_lm C_m / DP_m
                        stage, warm = c_lm / pp, c_lm
                        for m in others:
                            t_m = b[m] / (tp[m] * dp[m])
                            warm += t_m
                            stage = max(stage, t_m)
                        t = warm + steady * stage + extra
                        order += 1
                        if len(kept) < keep:
                            heapq.heappush(kept, (-t, -order, dp_lm, (tp_lm, *tps), pp, tuple(dp[m] for m in others)))
                        elif (t, order) < (-kept[0][0], -kept[0][1]):
                            heapq.heapreplace(kept, (-t, -order, dp_lm, (tp_lm, *tps), pp,
                                                     tuple(dp[m] for m in others)))
    if not kept:
        raise ValueError(f"no layout of {list(costs)} fits {num_gpus} GPUs: every candidate failed the memory check "
                         f"or needs more GPUs; use more GPUs or a smaller batch")
    out = []
    for t, _, dp_lm, tps, pp, dps in sorted(((-t, -o, *rest) for t, o, *rest in kept)):
        tp = dict(zip([LLM, *others], tps))
        dp = {LLM: dp_lm, **dict(zip(others, dps))}
        gpus = {LLM: tp[LLM] * dp_lm * pp, **{m: tp[m] * dp[m] for m in others}}
        out.append(Orchestration(tp, dp, {LLM: pp, **{m: 1 for m in others}}, t, priced, gpus))
    return out


def _memo(memo: dict[tuple[str, int, int], bool], fits: FitCheck, module: str, tp: int, dp: int) -> bool:
    key = (module, tp, dp)
    got = memo.get(key)
    if got is None:
        got = memo[key] = fits(module, tp, dp, 1)
    return got


def _allocations(others: list[str], tp: Mapping[str, int], b: Mapping[str, float], rest: int,
                 aligned: Sequence[str] = (), align: int = 1) -> Iterable[dict[str, int]]:
    """Each non-LLM module's data-parallel degree: its share of the ``rest`` GPUs in proportion
    to ``b`` (the closed form), in whole TP groups from one below its floor to one above its
    ceiling, at least one replica, every combination that fits in ``rest``; the ``aligned`` modules' GPUs then rounded, by the
    first of them, down and up to a multiple of ``align`` in all."""
    if not others:
        yield {}
        return
    total = sum(b.values())
    options = []
    for m in others:
        share = rest * b[m] / total if total > 0 else rest / len(others)
        lo = math.floor(share / tp[m])
        options.append(sorted({max(1, d) for d in range(lo - 1, lo + 3)}))
    seen = set()
    for dps in _product(options):
        dp = dict(zip(others, dps))
        for fixed in _aligned(dp, tp, aligned, align):
            key = tuple(fixed[m] for m in others)
            if key not in seen and sum(fixed[m] * tp[m] for m in others) <= rest:
                seen.add(key)
                yield fixed


def _aligned(dp: dict[str, int], tp: Mapping[str, int], aligned: Sequence[str], align: int) -> list[dict[str, int]]:
    """``dp`` with the ``aligned`` modules' GPUs a multiple of ``align`` (the first of them
    grows or shrinks by whole TP groups to the multiples around), or ``dp`` itself."""
    if not aligned:
        return [dp]
    first, total = aligned[0], sum(dp[m] * tp[m] for m in aligned)
    out = []
    for target in {total // align * align, -(-total // align) * align}:
        extra = target - total
        if target > 0 and extra % tp[first] == 0 and dp[first] + extra // tp[first] >= 1:
            out.append({**dp, first: dp[first] + extra // tp[first]})
    return out


def _product(lists: Sequence[Sequence[int]]) -> Iterable[tuple[int, ...]]:
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for tail in _product(lists[1:]):
            yield (head, *tail)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# ---- on a scenario -----------------------------------------------------------------------------
def module_costs(scenario: Scenario, tp_choices: Sequence[int] = TP_CHOICES) -> dict[str, dict[int, float]]:
    """Per module and TP degree (those that fit a node and divide its heads), forward + backward
    seconds of the whole module, one stage, for the scenario's mean sequence (its first global
    batch's per-sample workloads, from metadata): the ``C_m(TP)`` of the formulation, from the
    analytic cost model (TP communication and frozen-aware backward included)."""
    mean = _mean_sequence(scenario)
    out: dict[str, dict[int, float]] = {m: {} for m in scenario.arch.module_names}
    for m in scenario.arch.module_names:
        for tp in tp_choices:
            if tp > scenario.cluster.gpus_per_node:
                continue
            try:
                plan = _one_stage_plan(scenario, {m: tp}, _node_aligned(scenario, m),
                                       microbatches=scenario.cluster.gpus_per_node)
                cost = scenario.cost_model(plan)
            except PlanError:  # this TP does not divide the module's heads
                continue
            out[m][tp] = cost.stage_time(m, 0, "forward", mean[m]) + cost.stage_time(m, 0, "backward", mean[m])
    return out


def _mean_sequence(scenario: Scenario) -> dict[str, Workload]:
    """Per module, the mean workload of one sequence of the scenario's first global batch."""
    samples = scenario.per_sample_work(scenario.metas())
    return {m: Workload(*(round(sum(getattr(w.get(m, Workload()), f) for w in samples) / len(samples))
                          for f in ("tokens", "attn_sq", "segments"))) for m in scenario.arch.module_names}


def _node_aligned(scenario: Scenario, module: str) -> dict[str, int]:
    """Data-parallel degrees that give the modules before ``module`` whole nodes (so its TP
    group is measured inside one, as it runs)."""
    before = scenario.arch.module_names[:scenario.arch.module_names.index(module)]
    return {m: scenario.cluster.gpus_per_node // len(before) or 1 for m in before} if before else {}


def _one_stage_plan(scenario: Scenario, tp: Mapping[str, int], dp: Mapping[str, int] | None = None,
                    pp_llm: int = 1, microbatches: int = 1) -> Plan:
    d = scenario.degrees
    specs = [ModuleSpec(m, data_parallel=(dp or {}).get(m, 1), tensor_parallel=tp.get(m, 1),
                        num_stages=pp_llm if m == LLM else 1, zero_stage=d.zero_stage if (dp or {}).get(m, 1) > 1 else 0,
                        recompute=d.recompute)
             for m in scenario.arch.module_names]
    plan = Plan(specs, num_microbatches=microbatches, schedule="1f1b")
    return plan.resolve(scenario.arch.layer_counts(), generators=scenario.arch.generator_names)


@dataclass
class ScenarioInputs:
    """What `orchestrate` takes on a scenario (`scenario_inputs`): the per-module costs, its
    batch, GPUs and LLM depth, and the memory check and the LLM's communication as callbacks
    (memoised: the first calls build cost models, the later ones read them)."""

    costs: dict[str, dict[int, float]]
    batch_size: int
    num_gpus: int
    llm_layers: int
    fits: FitCheck
    overhead: Callable[[int, int, int], float]
    encoders: list[str]
    align: int

    def orchestrate(self, tp_choices: Mapping[str, Sequence[int]] | None = None, keep: int = 1) -> list[Orchestration]:
        return orchestrate(self.costs, self.batch_size, self.num_gpus, self.llm_layers, tp_choices, self.fits, keep,
                           self.overhead, self.encoders, self.align)


def scenario_inputs(scenario: Scenario) -> ScenarioInputs:
    """`orchestrate`'s inputs on a scenario: `module_costs`, the scenario's global batch as ``BS``
    (one sequence per microbatch, as DistTrain runs the LLM), its GPUs, a memory check (a layout
    fits when its first stage's parameters, gradients, optimizer state and 1F1B's in-flight
    activations fit the GPU), the LLM's gradient sync and pipeline messages, and node alignment
    of the modules before the LLM."""
    costs = module_costs(scenario)
    capacity = scenario.memory_capacity()
    mean = _mean_sequence(scenario)
    memo: dict[tuple, bool] = {}

    def fits(module: str, tp: int, dp: int, pp: int) -> bool:
        key = (module, tp, min(dp, 2), pp)  # ZeRO shards over dp: 2 replicas bound the rest from above
        if key not in memo:
            try:
                plan = _one_stage_plan(scenario, {module: tp}, {module: min(dp, 2)}, pp, microbatches=2 * pp)
            except PlanError:
                memo[key] = False
                return False
            cost = scenario.cost_model(plan)
            held = cost.static_memory(module, 0) + pp * cost.activation_memory(module, 0, mean[module])
            memo[key] = held <= capacity
        return memo[key]

    comm_memo: dict[tuple[int, int, int], float] = {}

    def overhead(tp: int, dp: int, pp: int) -> float:
        """The LLM's gradient sync (ZeRO as the scenario sets it) and PP messages of a sequence."""
        if (tp, dp, pp) not in comm_memo:
            try:
                cost = scenario.cost_model(_one_stage_plan(scenario, {LLM: tp}, {LLM: dp}, pp, microbatches=dp))
            except PlanError:
                comm_memo[(tp, dp, pp)] = math.inf
                return math.inf
            first, last = cost.plan.unit_of(LLM, 0, 0), cost.plan.unit_of(LLM, pp - 1, 0)
            message = cost.transfer_time(first, last, LLM, 0, mean[LLM]) if pp > 1 else 0.0
            comm_memo[(tp, dp, pp)] = cost.grad_sync_time(LLM, 0) + 2 * (pp - 1) * message
        return comm_memo[(tp, dp, pp)]

    return ScenarioInputs(costs, scenario.global_batch_size, scenario.cluster.num_gpus,
                          scenario.arch.module(LLM).num_layers, fits, overhead, scenario.arch.encoder_names,
                          scenario.cluster.gpus_per_node)


def scenario_orchestration(scenario: Scenario, tp_choices: Mapping[str, Sequence[int]] | None = None,
                           simulate_top: int = 8) -> tuple[Orchestration, Plan, list[tuple[Orchestration, float]]]:
    """Algorithm 1 on a scenario (`scenario_inputs`). The formulation prices stages as equal, so
    its ``simulate_top`` fastest layouts are played by the simulator (real per-microbatch token
    counts, the stages the partition really gives, the messages) and the fastest played one is
    returned with its plan, beside every played ``(layout, simulated seconds)``."""
    layouts = scenario_inputs(scenario).orchestrate(tp_choices, keep=simulate_top)
    d = scenario.degrees
    played: list[tuple[Orchestration, float]] = []
    best: tuple[float, Orchestration, Plan] | None = None
    for layout in layouts:
        # x + y + z <= N (disttrain.md §3.1): the plan may leave GPUs idle
        specs = [ModuleSpec(m, data_parallel=layout.dp[m], tensor_parallel=layout.tp[m], num_stages=layout.pp[m],
                            zero_stage=d.zero_stage if layout.dp[m] > 1 else 0, recompute=d.recompute)
                 for m in scenario.arch.module_names]
        plan = Plan(specs, num_microbatches=scenario.global_batch_size, schedule="1f1b").resolve(
            scenario.arch.layer_counts(), generators=scenario.arch.generator_names)
        t = scenario.run(plan).iteration_time
        played.append((layout, t))
        if best is None or t < best[0]:
            best = (t, layout, plan)
    return best[1], best[2], played
