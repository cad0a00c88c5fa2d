"""Optimus's fine schedule at kernel granularity (optimus.md §1.2 TP bubbles, §2.4, §3.5
ScheduleKernels): the kernel view of the analytic cost model (loom.cost.kernels), the
kernel-level LLM timeline, and encoder kernels placed into TP bubbles."""

from __future__ import annotations

import dataclasses

import pytest

from loom.cost.analytic import AnalyticCostModel
from loom.cost.hardware import Cluster
from loom.cost.kernels import KINDS, Kernel, stage_kernels
from loom.cost.model import Workload
from loom.plan.plan import ModuleSpec, Plan
from loom.planner.optimus import (
    EncoderStageTimes,
    LLMParallel,
    ScheduleViolation,
    check_bubble_schedule,
    coarse_schedule,
    compositions,
    fine_schedule,
    latency_bound,
    llm_timeline_from_sim,
    optimus_search,
)
from loom.planner.optimus.coarse import _EPS
from loom.planner.optimus.model_planner import encoder_stage_times
from loom.planner.optimus.paper import paper_search
from loom.planner.optimus.timeline import LLMTimeline, StageTimeline
from loom.schedule.generators import build_schedule
from loom.sim import simulate
from tests.test_optimus_coarse import CASES, candidate, llm_sim
from tests.test_optimus_planner import plan_tiny, tiny_arch

WORK = {"vision": Workload(64, 64 * 64, 1), "llm": Workload(128, 128 * 128, 1)}


def cost_model(tp: int, recompute: str = "none", freeze: bool = False) -> AnalyticCostModel:
    arch = tiny_arch()
    if freeze:
        arch = arch.with_freeze(["vision.encoder"])
    plan = Plan([ModuleSpec("vision", tensor_parallel=tp, recompute=recompute),
                 ModuleSpec("llm", num_stages=2, tensor_parallel=tp, recompute=recompute)], num_microbatches=2)
    plan.resolve(arch.layer_counts())
    return AnalyticCostModel(arch, plan, Cluster("h100", 16))


@pytest.mark.parametrize("tp,recompute,freeze", [(1, "none", False), (2, "none", False), (4, "full", False),
                                                 (2, "selective", True)])
def test_kernels_add_up_to_the_stage_time(tp, recompute, freeze):
    cost = cost_model(tp, recompute, freeze)
    for module, stages in (("vision", 1), ("llm", 2)):
        for s in range(stages):
            for kind in KINDS:
                kernels = stage_kernels(cost, module, s, kind, WORK[module])
                assert sum(k.seconds for k in kernels) == pytest.approx(
                    cost.stage_time(module, s, kind, WORK[module]), rel=1e-12, abs=1e-18)
                assert all(k.seconds > 0 for k in kernels)
                if tp == 1:
                    assert not any(k.comm for k in kernels)


def test_megatron_collectives_sit_where_tensor_parallelism_runs_them():
    cost = cost_model(2)
    blocks = [i for i, (layer, _) in enumerate(cost.stage_layers("llm", 1)) if layer.kind == "block"]
    fwd = [k for k in stage_kernels(cost, "llm", 1, "forward", WORK["llm"]) if k.layer == blocks[0]]
    # sequence parallelism: all-gather, attention half, reduce-scatter, all-gather, MLP half, reduce-scatter
    assert [k.name for k in fwd] == ["collective", "qkv", "core", "proj", "collective", "collective", "mlp_in",
                                     "mlp_out", "collective"]
    bwd = [k for k in stage_kernels(cost, "llm", 1, "backward", WORK["llm"]) if k.layer == blocks[0]]
    assert [k.name for k in bwd] == [k.name for k in fwd][::-1]  # the mirror image
    order = [k.layer for k in stage_kernels(cost, "llm", 1, "backward", WORK["llm"])]
    assert order == sorted(order, reverse=True)  # a backward runs the last layer first
    # an encoder under TP without sequence parallelism: an all-reduce after each half
    vis = [k for k in stage_kernels(cost, "vision", 0, "forward", WORK["vision"]) if k.name != "frontend"]
    first_block = [k.name for k in vis if k.layer == vis[0].layer]
    assert first_block == ["qkv", "core", "proj", "collective", "mlp_in", "mlp_out", "collective"]


def test_kernel_timeline_keeps_the_actions_and_opens_the_tp_bubbles():
    arch = tiny_arch()
    plan = Plan([ModuleSpec("llm", num_stages=2, tensor_parallel=2)], num_microbatches=4)
    plan.resolve({"llm": arch.layer_counts()["llm"]})
    from loom.cost.arch import ModelArch
    llm_only = ModelArch({"llm": arch.module("llm")})
    cost = AnalyticCostModel(llm_only, plan, Cluster("h100", plan.world_size))
    sim = simulate(build_schedule(plan), plan, cost, [{"llm": WORK["llm"]}] * 4)
    whole = llm_timeline_from_sim(sim)
    cut = llm_timeline_from_sim(sim, kernels=lambda e: stage_kernels(cost, "llm", e.stage, e.kind, WORK["llm"]))
    assert cut.forward_points == whole.forward_points and cut.backward_points == whole.backward_points
    for a, b in zip(whole.stages, cut.stages):
        link = sum(hi - lo for lo, hi in b.link)
        assert link > 0 and not a.link
        assert b.busy_time + link == pytest.approx(a.busy_time)  # the actions' time, cut in two
        assert (b.compute_start, b.compute_end) == (a.compute_start, a.compute_end)
        for lo, hi in b.link:  # the compute stream idles during every TP collective
            assert not any(x < hi - 1e-12 and lo + 1e-12 < y for x, y in b.busy)


def dense_timeline(n_mb: int = 4, period: float = 1.0, gap: float = 0.3) -> LLMTimeline:
    """One LLM stage computing without pipeline bubbles from 0 to ``2 * n_mb * period``, a TP
    collective of ``gap`` seconds closing every ``period``."""
    end = 2 * n_mb * period
    busy = tuple((i * period, (i + 1) * period - gap) for i in range(2 * n_mb))
    link = tuple(((i + 1) * period - gap, (i + 1) * period) for i in range(2 * n_mb))
    forward = tuple(i * period for i in range(n_mb))
    backward = tuple((n_mb + i + 1) * period for i in range(n_mb))
    return LLMTimeline((StageTimeline(busy, 0.0, end, link),), forward, backward, end)


def kernel_times(forward=(0.25, 0.25, 0.2, 0.3), backward=(0.3, 0.2, 0.3, 0.2), comm_at: int = 2) -> EncoderStageTimes:
    def kernels(ds):
        return tuple(Kernel(f"k{i}", d, i == comm_at, 0) for i, d in enumerate(ds))
    return EncoderStageTimes((sum(forward),), (sum(backward),), kernel_forward=(kernels(forward),),
                             kernel_backward=(kernels(backward),))


def test_encoder_kernels_fill_tp_bubbles_that_no_layer_fits():
    tl = dense_timeline()
    cand = candidate(1, 1, 1, 1, 4)
    layer_level = EncoderStageTimes((1.0,), (1.0,))
    kernel_level = kernel_times()
    coarse = coarse_schedule(tl, cand, layer_level, (4,))
    by_layer = fine_schedule(tl, cand, layer_level, (4,))
    by_kernel = fine_schedule(tl, cand, kernel_level, (4,))
    check_bubble_schedule(by_kernel, tl, kernel_level)
    assert by_layer.latency == pytest.approx(coarse.latency) and not by_layer.moved  # no 1 s hole
    assert by_kernel.latency < coarse.latency - 0.5 and by_kernel.moved
    stage = tl.stages[0]
    moved = [b for b in by_kernel.blocks if b.kernel >= 0]
    assert moved and {b.comm for b in moved} == {False, True}
    for b in moved:
        lo, hi = b.start - by_kernel.shift, b.end - by_kernel.shift
        if b.comm:  # under LLM compute, never in a TP bubble
            assert any(x - _EPS <= lo and hi <= y + _EPS for x, y in stage.busy)
        else:  # inside a TP bubble
            assert any(x - _EPS <= lo and hi <= y + _EPS for x, y in stage.link)
    assert latency_bound(tl, cand, kernel_level) <= by_kernel.latency + _EPS


def test_checker_rejects_an_encoder_collective_on_a_busy_link():
    tl = dense_timeline()
    cand = candidate(1, 1, 1, 1, 4)
    times = kernel_times()
    sched = fine_schedule(tl, cand, times, (4,))
    comm = next(b for b in sched.blocks if b.comm)
    # the same schedule against a timeline whose link is busy where the encoder's collective runs
    st = tl.stages[0]
    lo, hi = comm.start - sched.shift, comm.end - sched.shift
    link = tuple(sorted(st.link + ((lo, hi),)))
    busy_link = dataclasses.replace(tl, stages=(dataclasses.replace(st, link=link),))
    with pytest.raises(ScheduleViolation, match="TP collective"):
        check_bubble_schedule(sched, busy_link, times)


@pytest.mark.parametrize("case", CASES)
def test_kernel_schedules_keep_every_rule_on_simulated_timelines(case):
    pp_llm, tp_llm, pp_enc, tp_enc, n_mb, f, b = case
    tl = llm_timeline_from_sim(llm_sim(pp_llm, n_mb))
    cand = candidate(pp_llm, tp_llm, pp_enc, tp_enc, n_mb)
    whole = EncoderStageTimes(f, b, transfer=0.05)
    # each stage's time as four kernels, the third a collective
    cut = dataclasses.replace(whole, kernel_forward=tuple(tuple(Kernel("k", x / 4, i == 2) for i in range(4))
                                                          for x in f),
                              kernel_backward=tuple(tuple(Kernel("k", x / 4, i == 2) for i in range(4)) for x in b))
    partitions = list(compositions(n_mb, cand.m))
    assert partitions
    for parts in partitions:
        fine = fine_schedule(tl, cand, cut, parts)
        check_bubble_schedule(fine, tl, cut)
        assert latency_bound(tl, cand, cut) <= fine.latency + _EPS <= fine.coarse_latency + 2 * _EPS


def test_search_stops_at_the_bound_and_matches_the_exhaustive_refinement():
    tl = dense_timeline()
    planned = plan_tiny(LLMParallel(data_parallel=1, pipeline_parallel=1, tensor_parallel=2), n_mb=4)
    times = kernel_times()
    pruned = optimus_search(planned, tl, lambda c: times, refine=8)
    full = [fine_schedule(tl, c, times, p).latency for c in planned.candidates for p in c.partitions(4)]
    assert pruned.best.latency == pytest.approx(min(full))


def test_paper_search_at_kernel_granularity_on_a_small_instance():
    plan = LLMParallel(data_parallel=2, pipeline_parallel=8, tensor_parallel=8)  # GPT-175B fits at PP 8
    run = paper_search(num_microbatches=8, refine=2, llm_plan=plan, granularity="kernel")
    assert all(st.link for st in run.timeline.stages)
    best = run.result.best
    times = encoder_stage_times(*_paper_inputs(best.candidate, plan))
    assert times.kernel_level
    check_bubble_schedule(best, run.timeline, times)
    assert best.latency >= latency_bound(run.timeline, best.candidate, times) - _EPS
    with pytest.raises(ValueError, match="granularity"):
        paper_search(granularity="kernels")


def _paper_inputs(cand, plan):
    from loom.planner.optimus.paper import paper_arch, paper_workload
    gpus = plan.data_parallel * plan.pipeline_parallel * plan.tensor_parallel
    return paper_arch(), cand, Cluster("h100", gpus), paper_workload(), 2, "full", True
