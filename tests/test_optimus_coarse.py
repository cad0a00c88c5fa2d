"""Optimus's coarse bubble schedule (loom.planner.optimus.coarse; optimus.md §3.4, §3.6, §6.1)
and the LLM timeline adapter (loom.planner.optimus.timeline)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from loom.cost.uniform import UniformCostModel
from loom.plan.plan import ModuleSpec, Plan
from loom.planner.optimus import (
    EncoderStageTimes,
    LLMParallel,
    LLMTimeline,
    ScheduleViolation,
    StageTimeline,
    best_coarse_schedule,
    check_bubble_schedule,
    coarse_schedule,
    compositions,
    llm_timeline_from_sim,
    optimus_search,
)
from loom.planner.optimus.coarse import _EPS
from loom.schedule.generators import build_schedule
from loom.sim import simulate
from tests.test_optimus_planner import plan_tiny

FWD = {0: 1.0, 1: 1.5, 2: 1.0, 3: 2.0}
BWD = {0: 2.0, 1: 3.0, 2: 2.5, 3: 4.0}


def llm_sim(stages: int, microbatches: int, dp: int = 1, fwd=FWD, bwd=BWD, grad_sync: float = 3.0,
            optimizer: float = 0.5):
    plan = Plan([ModuleSpec("llm", data_parallel=dp, num_stages=stages)], num_microbatches=microbatches * dp)
    plan.resolve({"llm": 8})
    cost = UniformCostModel(plan, forward={("llm", s): fwd[s] for s in range(stages)},
                            backward={("llm", s): bwd[s] for s in range(stages)}, transfer=0.1,
                            grad_sync=grad_sync, optimizer=optimizer)
    return simulate(build_schedule(plan), plan, cost)


def candidate(pp_llm: int, tp_llm: int, pp_enc: int, tp_enc: int, n_mb: int):
    llm = LLMParallel(data_parallel=1, pipeline_parallel=pp_llm, tensor_parallel=tp_llm)
    planned = plan_tiny(llm, n_mb=n_mb)
    return next(c for c in planned.candidates
                if (c.encoder.pipeline_parallel, c.encoder.tensor_parallel) == (pp_enc, tp_enc))


# ---- the adapter ----------------------------------------------------------------------------------


def test_timeline_from_the_simulator():
    res = llm_sim(4, 6, dp=2)
    tl = llm_timeline_from_sim(res, replica=1)
    assert tl.num_stages == 4 and tl.num_microbatches == 6
    assert tl.microbatches == (1, 3, 5, 7, 9, 11)  # replica 1's microbatches, round robin
    stage0 = [e for e in res.timeline if e.rank == res.first_rank[1] and e.module == "llm"]
    assert tl.forward_points == tuple(e.start_s for e in stage0 if e.kind == "forward")
    ends = {e.microbatch: e.end_s for e in stage0 if e.kind == "backward"}
    assert tl.backward_points == tuple(ends[j] for j in tl.microbatches)
    for p, st in enumerate(tl.stages):
        # every stage runs 6 forwards and backwards and one optimizer step
        assert st.busy_time == pytest.approx(6 * (FWD[p] + BWD[p]) + 0.5)
        assert st.compute_start == pytest.approx(sum(FWD[q] + 0.1 for q in range(p)))
        assert st.busy[-1][1] > st.compute_end  # the optimizer step follows the grad sync
    assert tl.end == res.iteration_time


def test_timeline_from_a_zero_bubble_schedule():
    """ZB-H1's split backward: both passes are busy; a stage's compute ends with its last
    deferred weight pass."""
    plan = Plan([ModuleSpec("llm", num_stages=3)], num_microbatches=4, schedule="zb-h1")
    plan.resolve({"llm": 8})
    cost = UniformCostModel(plan, forward=1.0, backward=2.0, backward_weight=0.8, optimizer=0.5)
    res = simulate(build_schedule(plan), plan, cost)
    tl = llm_timeline_from_sim(res)
    for p, st in enumerate(tl.stages):
        assert st.busy_time == pytest.approx(4 * 3.0 + 0.5)
        weight = [e.end_s for e in res.timeline if e.stage == p and e.kind == "backward_weight"]
        if weight:
            assert st.compute_end == pytest.approx(max(weight))
    assert all(b >= f for f, b in zip(tl.forward_points, tl.backward_points))


def test_timeline_rejects_bad_input():
    with pytest.raises(ValueError, match="B_i"):
        LLMTimeline((StageTimeline((), 0, 0),), (1.0,), (0.5,), 2.0)
    with pytest.raises(ValueError, match="sorted"):
        StageTimeline(((2.0, 3.0), (1.0, 1.5)), 1.0, 3.0)
    with pytest.raises(ValueError, match="replicas"):
        llm_timeline_from_sim(llm_sim(2, 2), replica=3)


# ---- invariants on every schedule -----------------------------------------------------------------


CASES = [
    # (pp_llm, tp_llm, pp_enc, tp_enc, n_mb, encoder forward, backward per stage)
    (4, 2, 2, 2, 8, (0.6, 0.4), (1.0, 0.9)),  # Fig. 5
    (4, 2, 1, 1, 8, (0.9,), (1.7,)),
    (4, 1, 4, 1, 6, (0.3, 0.2, 0.4, 0.3), (0.5, 0.4, 0.7, 0.6)),
    (2, 2, 1, 1, 5, (2.5,), (4.0,)),  # heavy encoder: the LLM must shift
]


@pytest.mark.parametrize("case", CASES)
def test_every_partition_obeys_the_dependency_and_placement_rules(case):
    pp_llm, tp_llm, pp_enc, tp_enc, n_mb, f, b = case
    tl = llm_timeline_from_sim(llm_sim(pp_llm, n_mb))
    cand = candidate(pp_llm, tp_llm, pp_enc, tp_enc, n_mb)
    times = EncoderStageTimes(f, b, transfer=0.05, to_llm=tuple(0.02 * (a + 1) for a in range(cand.groups)))
    for parts in compositions(n_mb, cand.m):
        sched = coarse_schedule(tl, cand, times, parts)
        check_bubble_schedule(sched, tl, times)  # EF_i <= F_i, EB_i >= B_i, stage order, no overlap, regions
        for i, (j, k) in enumerate(sched.feeds):
            assert sched.encoder_forward_end[i] <= tl.forward_points[i] + sched.shift + _EPS
            assert sched.encoder_backward_start[i] >= tl.backward_points[i] + sched.shift
        assert sched.latency >= tl.end + sched.shift - _EPS
        assert 0 <= sched.bubble_fill_fraction <= 1 and 0 <= sched.encoder_in_bubbles <= 1
        assert sched.encoder_time == pytest.approx(n_mb * (sum(f) + sum(b)))


def test_the_checker_rejects_broken_schedules():
    tl = llm_timeline_from_sim(llm_sim(4, 8))
    cand = candidate(4, 2, 2, 2, 8)
    times = EncoderStageTimes((0.6, 0.4), (1.0, 0.9), transfer=0.05)
    sched = coarse_schedule(tl, cand, times, (3, 5))
    blocks = list(sched.blocks)

    def with_block(idx, **change):
        bl = list(blocks)
        bl[idx] = dataclasses.replace(bl[idx], **change)
        return dataclasses.replace(sched, blocks=tuple(bl))

    # an encoder output that arrives after the LLM needs it: named by microbatch
    last_fwd = max((i for i, b in enumerate(blocks) if b.direction == "forward" and b.stage == 1),
                   key=lambda i: blocks[i].end)
    late = with_block(last_fwd, start=blocks[last_fwd].start + 50, end=blocks[last_fwd].end + 50)
    with pytest.raises(ScheduleViolation, match="LLM microbatch 7: EF_i"):
        check_bubble_schedule(late, tl, times)
    # a backward that starts before the LLM's gradient
    i0 = next(i for i, b in enumerate(blocks) if b.direction == "backward" and b.stage == 1 and b.llm_microbatch == 0)
    early = with_block(i0, start=0.0, end=blocks[i0].end - blocks[i0].start)
    with pytest.raises(ScheduleViolation, match="LLM microbatch 0: EB_i"):
        check_bubble_schedule(early, tl, times)
    # forward stage order broken
    f1 = next(i for i, b in enumerate(blocks) if b.direction == "forward" and b.stage == 1 and b.microbatch == 0)
    order = with_block(f1, start=0.0, end=0.4)
    with pytest.raises(ScheduleViolation, match="before stage 0's output arrives"):
        check_bubble_schedule(order, tl, times)
    # LLM compute where an encoder backward runs: the same schedule against a timeline whose
    # stage 0 is busy then
    last = max((b for b in blocks if b.direction == "backward" and b.ranks == cand.ranks(0, 0)), key=lambda b: b.start)
    st = tl.stages[0]
    busy = tuple(sorted(st.busy + ((last.start - sched.shift + 0.01, last.start - sched.shift + 0.02),)))
    tl2 = dataclasses.replace(tl, stages=(dataclasses.replace(st, busy=busy),) + tl.stages[1:])
    with pytest.raises(ScheduleViolation, match="overlaps the LLM's compute"):
        check_bubble_schedule(sched, tl2, times)


# ---- brute force on tiny instances ----------------------------------------------------------------


def random_instance(seed: int):
    rng = random.Random(seed)
    pp_llm, pp_enc = rng.choice([(2, 1), (2, 2), (4, 2), (4, 1)])
    n_mb = rng.randint(pp_llm // pp_enc, 5)
    fwd = {s: rng.choice([0.5, 1.0, 1.5]) for s in range(4)}
    bwd = {s: rng.choice([1.0, 2.0, 2.5]) for s in range(4)}
    tl = llm_timeline_from_sim(llm_sim(pp_llm, n_mb, fwd=fwd, bwd=bwd, optimizer=rng.choice([0.0, 1.0])))
    cand = candidate(pp_llm, 1, pp_enc, 1, n_mb)
    times = EncoderStageTimes(tuple(rng.choice([0.2, 0.6, 1.3]) for _ in range(pp_enc)),
                              tuple(rng.choice([0.4, 1.1, 2.2]) for _ in range(pp_enc)), transfer=0.1,
                              to_llm=tuple(rng.choice([0.0, 0.2]) for _ in range(cand.groups)))
    return tl, cand, times


def fit(t: float, d: float, busy, shift: float) -> float:
    for lo, hi in busy:
        if t + d <= lo + shift + _EPS:
            break
        t = max(t, hi + shift)
    return t


@pytest.mark.parametrize("seed", range(12))
def test_sorted_global_ordering_gives_the_least_shift(seed):
    """Over every assignment of encoder outputs to LLM microbatches, none needs a smaller shift
    than the sorted one (optimus.md §3.6's global ordering)."""
    tl, cand, times = random_instance(seed)
    for parts in compositions(tl.num_microbatches, cand.m):
        sched = coarse_schedule(tl, cand, times, parts)
        fwd = [b for b in sched.blocks if b.direction == "forward"]
        device = max(0.0, max(b.end - tl.stages[b.llm_stage].compute_start for b in fwd))
        arrivals = [sched.encoder_forward_end[i] for i in range(tl.num_microbatches)]
        best = min(max((arrivals[p] - f for p, f in zip(perm, tl.forward_points)), default=0.0)
                   for perm in itertools.permutations(range(len(arrivals))))
        assert sched.shift == pytest.approx(max(device, best))


@pytest.mark.parametrize("seed", range(12))
def test_backward_order_by_arrival_is_optimal_per_pipeline(seed):
    tl, cand, times = random_instance(seed)
    S = times.num_stages
    for parts in compositions(tl.num_microbatches, cand.m):
        sched = coarse_schedule(tl, cand, times, parts)
        for j in range(cand.m):
            a = j // cand.group_size
            releases = [tl.backward_points[i] + sched.shift + times.to_llm_of(a)
                        for i, (jj, _) in enumerate(sched.feeds) if jj == j]
            ours = max(b.end for b in sched.blocks if b.direction == "backward" and b.pipeline == j and b.stage == 0)
            brute = float("inf")
            for order in itertools.permutations(releases):
                prev = [tl.stages[cand.llm_stage(j, s)].compute_end + sched.shift for s in range(S)]
                for r in order:
                    ready = r
                    for s in reversed(range(S)):
                        st = tl.stages[cand.llm_stage(j, s)]
                        t = fit(max(ready, prev[s]), times.backward[s], st.busy, sched.shift)
                        prev[s] = t + times.backward[s]
                        ready = prev[s] + times.transfer
                brute = min(brute, prev[0])
            assert ours == pytest.approx(brute)


@pytest.mark.parametrize("seed", range(12))
def test_search_finds_the_best_composition(seed):
    """The symmetric enumeration and the lower-bound pruning lose nothing: the search's latency
    is the minimum over every composition."""
    tl, cand, times = random_instance(seed)
    every = min(coarse_schedule(tl, cand, times, p).latency for p in compositions(tl.num_microbatches, cand.m))
    best, count = best_coarse_schedule(tl, cand, times, max_partitions=None)
    assert best is not None and best.latency == pytest.approx(every)
    assert count == cand.count_partitions(tl.num_microbatches)
    check_bubble_schedule(best, tl, times)


def test_optimus_search_picks_the_lowest_latency_over_plans():
    n_mb = 6
    tl = llm_timeline_from_sim(llm_sim(4, n_mb))
    planned = plan_tiny(LLMParallel(1, 4, 2), n_mb=n_mb)

    def stage_times(c):
        pp = c.encoder.pipeline_parallel
        scale = 2.0 / (pp * c.encoder.tensor_parallel)
        return EncoderStageTimes((scale,) * pp, (2 * scale,) * pp, transfer=0.05)

    result = optimus_search(planned, tl, stage_times)
    scheds = [s for _, s, _ in result.per_candidate if s is not None]
    assert result.best is not None and result.best.latency == min(s.latency for s in scheds)
    assert len(result.per_candidate) == len(planned.candidates)
    with pytest.raises(ValueError, match="N_mb"):
        optimus_search(plan_tiny(LLMParallel(1, 4, 2), n_mb=5), tl, stage_times)


def test_partition_of_the_wrong_shape_is_refused():
    tl = llm_timeline_from_sim(llm_sim(4, 8))
    cand = candidate(4, 2, 2, 2, 8)
    times = EncoderStageTimes((0.6, 0.4), (1.0, 0.9))
    with pytest.raises(ValueError, match="m = 2"):
        coarse_schedule(tl, cand, times, (8,))
    with pytest.raises(ValueError, match="sum to"):
        coarse_schedule(tl, cand, times, (4, 3))
    with pytest.raises(ValueError, match="stages"):
        coarse_schedule(tl, cand, EncoderStageTimes((1.0,), (1.0,)), (4, 4))
