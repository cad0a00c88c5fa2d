"""Optimus (optimus.md): encoder work inside the LLM's pipeline bubbles, as pure algorithms.

- `loom.planner.optimus.model_planner`: the model planner (optimus.md §2.3, §3.3): encoder
  plans colocated with a given LLM plan, their memory per rank (§2.7), pruning, and the
  microbatch partitions over the encoder pipelines;
- `loom.planner.optimus.timeline`: the LLM pipeline timeline the bubble scheduler reads (busy
  intervals per stage, the dependency points ``F_i`` and ``B_i``), and its adapter from a
  `loom.sim` result;
- `loom.planner.optimus.coarse`: the coarse bubble schedule (Algorithm 2's InitSchedule,
  §3.4, with the dependency rules of §3.6) and its checker;
- `loom.planner.optimus.fine`: the fine step at layer granularity (OptimizeSchedule,
  findCritical, ScheduleKernels, §3.5);
- `loom.planner.optimus.search`: Algorithm 1, the search over plans and partitions;
- `loom.planner.optimus.events`: a schedule as timeline events (Chrome trace, Gantt chart);
- `loom.planner.optimus.paper`: the configuration of optimus.md §4.6 the issue times.

The colocated placement in `Plan`, the IR transform and the executor are not built yet
(docs/optimus.md).
"""

from loom.planner.optimus.coarse import (
    BubbleSchedule,
    EncoderBlock,
    ScheduleViolation,
    best_coarse_schedule,
    check_bubble_schedule,
    coarse_ranking,
    coarse_schedule,
)
from loom.planner.optimus.events import schedule_events
from loom.planner.optimus.fine import best_fine_schedule, fine_schedule, latency_bound
from loom.planner.optimus.model_planner import (
    ColocationMemory,
    EncoderCandidate,
    EncoderParallel,
    EncoderStageTimes,
    LLMParallel,
    PlannerResult,
    PrunedPlan,
    RankMemory,
    compositions,
    count_partitions,
    encoder_stage_times,
    paper_model_memory,
    paper_overhead_memory,
    plan_encoders,
)
from loom.planner.optimus.search import OptimusResult, optimus_search
from loom.planner.optimus.timeline import LLMTimeline, StageTimeline, llm_timeline_from_sim

__all__ = [
    "BubbleSchedule", "ColocationMemory", "EncoderBlock", "EncoderCandidate", "EncoderParallel", "EncoderStageTimes",
    "LLMParallel", "LLMTimeline", "OptimusResult", "PlannerResult", "PrunedPlan", "RankMemory", "ScheduleViolation",
    "StageTimeline", "best_coarse_schedule", "best_fine_schedule", "check_bubble_schedule", "coarse_ranking",
    "coarse_schedule", "compositions", "count_partitions", "encoder_stage_times", "fine_schedule",
    "latency_bound", "llm_timeline_from_sim", "optimus_search", "paper_model_memory", "paper_overhead_memory", "plan_encoders",
    "schedule_events",
]
