"""Optimus's fine step at layer granularity (loom.planner.optimus.fine; optimus.md §3.5, §6.1
"latency is monotone non-increasing", "Eff_fine >= Eff_coarse" in latency terms) and the search
with it (loom.planner.optimus.search)."""

from __future__ import annotations

import dataclasses

import pytest

from loom.planner.optimus import (
    EncoderStageTimes,
    LLMParallel,
    ScheduleViolation,
    best_coarse_schedule,
    best_fine_schedule,
    check_bubble_schedule,
    coarse_schedule,
    compositions,
    fine_schedule,
    llm_timeline_from_sim,
    optimus_search,
)
from loom.planner.optimus.coarse import _EPS
from loom.planner.optimus.model_planner import OptimusPlanError
from tests.test_optimus_coarse import CASES, candidate, llm_sim, random_instance
from tests.test_optimus_planner import plan_tiny


def layered(times: EncoderStageTimes, n: int = 3) -> EncoderStageTimes:
    """The same stage times split into ``n`` layers of unequal length."""
    weights = [i + 1 for i in range(n)]

    def split(x):
        return tuple(x * w / sum(weights) for w in weights)

    return dataclasses.replace(times, layer_forward=tuple(split(x) for x in times.forward),
                               layer_backward=tuple(split(x) for x in times.backward))


@pytest.mark.parametrize("case", CASES)
def test_fine_schedules_keep_every_rule_and_never_lose_to_the_coarse_one(case):
    pp_llm, tp_llm, pp_enc, tp_enc, n_mb, f, b = case
    tl = llm_timeline_from_sim(llm_sim(pp_llm, n_mb))
    cand = candidate(pp_llm, tp_llm, pp_enc, tp_enc, n_mb)
    times = layered(EncoderStageTimes(f, b, transfer=0.05,
                                      to_llm=tuple(0.02 * (a + 1) for a in range(cand.groups))))
    improved = 0
    for parts in compositions(n_mb, cand.m):
        coarse = coarse_schedule(tl, cand, times, parts)
        fine = fine_schedule(tl, cand, times, parts)
        check_bubble_schedule(fine, tl, times)
        assert fine.coarse_latency == pytest.approx(coarse.latency)
        assert fine.latency <= coarse.latency + _EPS
        if fine.moved:  # a move is kept only if it lowers the latency
            assert fine.latency < coarse.latency
            improved += 1
        assert fine.encoder_time == pytest.approx(coarse.encoder_time)
        for blk in fine.blocks:
            st = tl.stages[blk.llm_stage]
            if blk.layer >= 0:  # moved: inside the bubbles between the device's LLM compute
                assert (blk.direction, blk.pipeline, blk.microbatch) in fine.moved
                assert st.compute_start + fine.shift - _EPS <= blk.start
                assert blk.end <= st.compute_end + fine.shift + _EPS
    if case[:4] == (4, 2, 2, 2):
        assert improved >= 3  # Fig. 5: moving forwards out of the warm-up shortens the shift


@pytest.mark.parametrize("seed", range(12))
def test_fine_on_random_instances(seed):
    tl, cand, times = random_instance(seed)
    times = layered(times, 2)
    for parts in compositions(tl.num_microbatches, cand.m):
        fine = fine_schedule(tl, cand, times, parts)
        check_bubble_schedule(fine, tl, times)
        assert fine.latency <= fine.coarse_latency + _EPS


def test_the_fine_search_is_at_least_as_good_as_the_coarse_one():
    tl = llm_timeline_from_sim(llm_sim(4, 8))
    cand = candidate(4, 2, 2, 2, 8)
    times = layered(EncoderStageTimes((0.6, 0.4), (1.0, 0.9), transfer=0.05))
    coarse, n = best_coarse_schedule(tl, cand, times)
    fine, m = best_fine_schedule(tl, cand, times, top=3)
    assert n == m == 7
    assert fine.latency < coarse.latency
    with pytest.raises(OptimusPlanError, match="top"):
        best_fine_schedule(tl, cand, times, top=0)


def test_search_with_refinement():
    n_mb = 6
    tl = llm_timeline_from_sim(llm_sim(4, n_mb))
    planned = plan_tiny(LLMParallel(1, 4, 2), n_mb=n_mb)

    def stage_times(c):
        pp = c.encoder.pipeline_parallel
        scale = 3.0 / (pp * c.encoder.tensor_parallel)
        return layered(EncoderStageTimes((scale,) * pp, (2 * scale,) * pp, transfer=0.05))

    coarse = optimus_search(planned, tl, stage_times)
    fine = optimus_search(planned, tl, stage_times, refine=4)
    assert fine.best.latency <= coarse.best.latency
    for (_, c, _), (_, f, _) in zip(coarse.per_candidate, fine.per_candidate):
        assert f.latency <= c.latency + _EPS
    with pytest.raises(OptimusPlanError, match="refine"):
        optimus_search(planned, tl, stage_times, refine=-1)


def test_checker_rejects_layers_out_of_order():
    tl = llm_timeline_from_sim(llm_sim(4, 8))
    cand = candidate(4, 2, 2, 2, 8)
    times = layered(EncoderStageTimes((0.6, 0.4), (1.0, 0.9), transfer=0.05))
    fine = fine_schedule(tl, cand, times, (4, 4))
    moved = [b for b in fine.blocks if b.layer >= 0 and b.direction == "forward"]
    assert moved
    first = min(moved, key=lambda b: b.start)
    broken = tuple(dataclasses.replace(b, layer=1) if b is first else b for b in fine.blocks)
    with pytest.raises(ScheduleViolation, match="runs layers"):
        check_bubble_schedule(dataclasses.replace(fine, blocks=broken), tl, times)


def test_layer_times_must_add_up_to_the_stage():
    with pytest.raises(OptimusPlanError, match="layer_forward"):
        EncoderStageTimes((1.0,), (2.0,), layer_forward=((0.5, 0.4),))
    with pytest.raises(OptimusPlanError, match="layer_backward"):
        EncoderStageTimes((1.0, 1.0), (2.0, 2.0), layer_backward=((2.0,),))


def test_schedule_as_timeline_events(tmp_path):
    """The filled step in the executor's timeline format: encoder events sit on the rows of
    their ranks and never overlap the LLM's compute there; the Gantt chart draws it."""
    from loom.planner.optimus import schedule_events
    from loom.sim.gantt import plot_gantt

    res = llm_sim(4, 8)
    tl = llm_timeline_from_sim(res)
    cand = candidate(4, 2, 2, 1, 8)  # TP_enc 1 under TP_llm 2: two encoder pipelines side by side per stage
    times = layered(EncoderStageTimes((0.6, 0.4), (1.0, 0.9), transfer=0.05))
    sched = fine_schedule(tl, cand, times, next(iter(cand.partitions(8))))
    events = schedule_events(sched, res, module="vision")
    llm_events = [e for e in res.timeline if e.module == "llm"]
    enc = [e for e in events if e.module == "vision"]
    assert len(enc) == len(sched.blocks) and len(events) == len(enc) + cand.group_size * len(llm_events)
    rows = {e.rank for e in events}
    assert len(rows) == 4 * cand.group_size
    for r in rows:
        busy = [(e.start_s, e.end_s) for e in events if e.rank == r and e.module == "llm"
                and e.kind in ("forward", "backward", "optimizer_step")]
        for e in (x for x in enc if x.rank == r):
            assert all(e.end_s <= lo + _EPS or e.start_s >= hi - _EPS for lo, hi in busy)
    assert plot_gantt(events, tmp_path / "optimus.png").stat().st_size > 0
