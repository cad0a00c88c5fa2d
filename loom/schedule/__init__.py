"""Schedules as data (docs/architecture.md, "The schedule IR"): the IR, its generators and its validator.

- `loom.schedule.ir`: `Action`, `ActionKind`, `Schedule`, `stage_key`;
- `loom.schedule.generators`: `build_schedule` (GPipe, multimodal 1F1B) and `backward_flow`
  (frozen-aware backward, cornstarch.md §3.2.1), plus the stage graph of a plan;
- `loom.schedule.validate`: `validate_schedule`, `unit_cost_makespan`, `render`.
"""

from loom.schedule.generators import (
    KINDS,
    backward_flow,
    build_schedule,
    pipeline_edges,
    pipeline_stages,
    warmup_count,
)
from loom.schedule.ir import COMMUNICATION, MATCHING, Action, ActionKind, Schedule, stage_key
from loom.schedule.validate import ScheduleError, render, unit_cost_makespan, validate_schedule

__all__ = [
    "Action",
    "ActionKind",
    "COMMUNICATION",
    "KINDS",
    "MATCHING",
    "Schedule",
    "ScheduleError",
    "backward_flow",
    "build_schedule",
    "pipeline_edges",
    "pipeline_stages",
    "render",
    "stage_key",
    "unit_cost_makespan",
    "validate_schedule",
    "warmup_count",
]
