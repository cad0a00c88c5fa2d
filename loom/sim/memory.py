"""Peak memory per pipeline unit of a schedule: static memory plus the most activation memory
held at once (the order of a unit's actions decides it, not their timing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loom.cost.model import CostModel, MicrobatchWork
from loom.plan.plan import Plan
from loom.schedule.ir import BACKWARDS, ActionKind, Schedule, stage_key
from loom.sim.work import EMPTY, PartWork, work_table

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD

def peak_memory(
    schedule: Schedule,
    plan: Plan,
    cost: CostModel,
    work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None = None,
    sample_work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None = None,
) -> dict[int, float]:
    """Per unit: static memory plus the most activation memory held at once (``work`` and
    ``sample_work`` as for `simulate`).

    A unit's live activations change only at its own forwards and backwards, so the peak
    follows from the order of its list alone, whatever the timing. A microbatch's activation is
    taken at its forward and freed at its last backward on the unit (a split backward frees at
    the last part, ZB-H1's at its weight pass); on a stage without backward (``schedule.needs_backward``) it is freed as
    soon as the forward ends, so it counts only while that forward runs. The recompute working
    set of a backward part is its own samples'."""
    works = work_table(work, schedule.num_microbatches)
    return peak_memory_of(schedule, plan, cost, works, PartWork(sample_work, work is not None))


def peak_memory_of(schedule: Schedule, plan: Plan, cost: CostModel, works: list[MicrobatchWork],
                 part_work: PartWork) -> dict[int, float]:
    peaks: dict[int, float] = {}
    no_backward = {k for k, needed in schedule.needs_backward.items() if not needed}
    for u in sorted(schedule.actions):
        acts = schedule.actions[u]
        backwards_left: dict[tuple[str, int, int], int] = {}
        for a in acts:
            if a.kind in BACKWARDS:
                key = (a.module, a.stage, a.microbatch)
                backwards_left[key] = backwards_left.get(key, 0) + 1
        held: dict[tuple[str, int, int], float] = {}
        live = peak = 0.0
        for a in acts:
            if a.kind is FORWARD:
                key = (a.module, a.stage, a.microbatch)
                size = cost.activation_memory(a.module, a.stage, works[a.microbatch].get(a.module, EMPTY))
                live += size
                peak = max(peak, live)
                if key in backwards_left and stage_key(a.module, a.stage) not in no_backward:
                    held[key] = held.get(key, 0.0) + size
                else:
                    live -= size
            elif a.kind in BACKWARDS:
                key = (a.module, a.stage, a.microbatch)
                # the backward working set (recomputed activations included) is live while this backward (part) runs
                w = works[a.microbatch].get(a.module, EMPTY) if a.samples is None else part_work(a.module, a.samples)
                peak = max(peak, live + cost.transient_memory(a.module, a.stage, w))
                backwards_left[key] -= 1
                if backwards_left[key] == 0:
                    live -= held.pop(key, 0.0)
        statics = {(a.module, a.stage) for a in acts}
        if not statics:  # an idle unit still holds its stage's parameters
            m, s, _ = plan.role_of_unit(u)
            statics = {(m, s)}
        peaks[u] = sum(cost.static_memory(m, s) for m, s in statics) + peak
    return peaks
