"""Algorithm 1 of optimus.md (§3.1): over every encoder plan the model planner keeps, the
bubble schedule of lowest latency (Algorithm 2 per plan: the coarse schedule of every
partition, `loom.planner.optimus.coarse`, and optionally the fine step on the best of them,
`loom.planner.optimus.fine`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loom.planner.optimus.coarse import BubbleSchedule, best_coarse_schedule
from loom.planner.optimus.fine import best_fine_schedule
from loom.planner.optimus.model_planner import EncoderCandidate, EncoderStageTimes, OptimusPlanError, PlannerResult
from loom.planner.optimus.timeline import LLMTimeline


@dataclass(frozen=True)
class OptimusResult:
    """The best schedule, and per candidate its best (None when it has no partition) with the
    number of partitions considered."""

    best: BubbleSchedule | None
    per_candidate: tuple[tuple[EncoderCandidate, BubbleSchedule | None, int], ...] = field(default=())


def optimus_search(planned: PlannerResult, timeline: LLMTimeline,
                   stage_times: Callable[[EncoderCandidate], EncoderStageTimes],
                   max_partitions: int | None = 4096, refine: int = 0) -> OptimusResult:
    """Every candidate of ``planned``, every partition it enumerates, the lowest latency (ties:
    the first candidate). ``stage_times(candidate)`` prices a candidate's encoder stages (e.g.
    `loom.planner.optimus.model_planner.encoder_stage_times`). ``refine`` > 0 applies the fine
    step to each candidate's ``refine`` best coarse partitions (`best_fine_schedule`); 0 keeps
    the coarse schedule."""
    if timeline.num_microbatches != planned.num_microbatches:
        raise OptimusPlanError(f"the LLM timeline has {timeline.num_microbatches} microbatches but the planner was "
                               f"given N_mb = {planned.num_microbatches}: use the same microbatch count")
    if refine < 0:
        raise OptimusPlanError(f"refine = {refine}: give 0 (coarse only) or how many partitions to refine")
    rows = []
    best: BubbleSchedule | None = None
    for cand in planned.candidates:
        times = stage_times(cand)
        if refine:
            beat = float("inf") if best is None else best.latency
            sched, count = best_fine_schedule(timeline, cand, times, refine, max_partitions, beat)
        else:
            sched, count = best_coarse_schedule(timeline, cand, times, max_partitions=max_partitions)
        rows.append((cand, sched, count))
        if sched is not None and (best is None or sched.latency < best.latency):
            best = sched
    return OptimusResult(best, tuple(rows))
