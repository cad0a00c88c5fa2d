"""A bubble schedule as a timeline in the executor's format (`loom.schedule.timeline`), so the
simulator's Chrome trace and Gantt chart tools (`loom.sim.gantt`) show an Optimus-filled step:
the LLM's simulated events shifted by the schedule's ``shift``, and the encoder's blocks on the
same rows.

One row per device: the first rank, in the candidate's LLM layout (`LLMParallel.rank`), of each
``TP_enc`` slice of each LLM stage (the simulator plays a stage's TP group as one unit, so an
LLM stage with ``g = TP_llm / TP_enc`` encoder pipelines side by side gets ``g`` rows, each
with the LLM's events).
"""

from __future__ import annotations

import dataclasses

from loom.cost.arch import LLM
from loom.planner.optimus.coarse import FORWARD, BubbleSchedule
from loom.planner.optimus.model_planner import OptimusPlanError
from loom.schedule.timeline import TimelineEvent
from loom.sim.result import SimResult


def schedule_events(schedule: BubbleSchedule, result: SimResult, replica: int = 0,
                    module: str = "encoder") -> list[TimelineEvent]:
    """The LLM pipeline ``replica`` of ``result`` (the simulation its `LLMTimeline` came from)
    with ``schedule``'s encoder blocks (named ``module``), in `TimelineEvent`s."""
    cand = schedule.candidate
    units = {u: role for u, role in result.roles.items() if role[0] == LLM and role[2] == replica}
    first = {role[1]: result.first_rank[u] for u, role in units.items()}
    if sorted(first) != list(range(cand.llm.pipeline_parallel)):
        raise OptimusPlanError(f"schedule_events: the simulation's LLM replica {replica} has stages {sorted(first)}, "
                               f"not the schedule's {cand.llm.pipeline_parallel}: pass the result the timeline came "
                               "from")
    width = cand.encoder.tensor_parallel

    def row(stage: int, b: int) -> int:
        return cand.llm.rank(stage, replica, b * width)

    events: list[TimelineEvent] = []
    rank_stage = {r: s for s, r in first.items()}
    for e in result.timeline:
        s = rank_stage.get(e.rank)
        if s is None or e.module != LLM:
            continue
        for b in range(cand.group_size):
            events.append(dataclasses.replace(e, rank=row(s, b), start_s=e.start_s + schedule.shift,
                                              end_s=e.end_s + schedule.shift))
    for blk in schedule.blocks:
        b = blk.pipeline % cand.group_size
        layer = f" L{blk.layer}" if blk.layer >= 0 else ""
        label = (f"{'F' if blk.direction == FORWARD else 'B'} {module}.{blk.stage}{layer} p{blk.pipeline} "
                 f"mb{blk.llm_microbatch}")
        events.append(TimelineEvent(row(blk.llm_stage, b), blk.direction, label, module, blk.stage,
                                    blk.llm_microbatch, blk.start, blk.end))
    return events
