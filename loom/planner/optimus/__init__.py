"""Optimus (optimus.md): encoder work inside the LLM's pipeline bubbles, as pure algorithms.

- `loom.planner.optimus.model_planner`: the model planner (optimus.md §2.3, §3.3): encoder
  plans colocated with a given LLM plan, their memory per rank (§2.7), pruning, and the
  microbatch partitions over the encoder pipelines;
- `loom.planner.optimus.timeline`: the LLM pipeline timeline the bubble scheduler reads (busy
  intervals per stage, the dependency points ``F_i`` and ``B_i``), and its adapter from a
  `loom.sim` result;
- `loom.planner.optimus.coarse`: the coarse bubble schedule (Algorithm 2's InitSchedule,
  §3.4, with the dependency rules of §3.6), its checker, and the search over plans and
  partitions (Algorithm 1 with the coarse schedule only).

The colocated placement in `Plan`, the executor and the fine schedule (findCritical,
ScheduleKernels) are not built yet (docs/optimus.md).
"""

from loom.planner.optimus.coarse import (
    CoarseSchedule,
    EncoderBlock,
    OptimusResult,
    ScheduleViolation,
    best_coarse_schedule,
    check_coarse_schedule,
    coarse_schedule,
    optimus_search,
)
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
from loom.planner.optimus.timeline import LLMTimeline, StageTimeline, llm_timeline_from_sim

__all__ = [
    "CoarseSchedule", "ColocationMemory", "EncoderBlock", "EncoderCandidate", "EncoderParallel", "EncoderStageTimes",
    "LLMParallel", "LLMTimeline", "OptimusResult", "PlannerResult", "PrunedPlan", "RankMemory", "ScheduleViolation", "StageTimeline",
    "best_coarse_schedule", "check_coarse_schedule", "coarse_schedule", "compositions", "count_partitions",
    "encoder_stage_times", "llm_timeline_from_sim", "optimus_search", "paper_model_memory", "paper_overhead_memory",
    "plan_encoders",
]
