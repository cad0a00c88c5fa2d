"""Discrete-event simulation of a schedule IR under a cost model (docs/architecture.md, "The schedule IR":
"the simulator assigns each action a duration from the cost model ... and plays the
dependencies forward").

`simulate` plays every pipeline unit's action list in order, with the executor's semantics
(`loom.runtime.executor`, `loom.schedule.ir`):

- ``FORWARD`` / ``BACKWARD`` take ``cost.stage_time(module, stage, kind, work)`` for the
  microbatch's own workload of that module; one part of a split backward (``samples`` set,
  entrain.md §3.6) costs the backward of its samples' workload only;
- a send does not block its sender (it takes no time there); its message arrives at
  ``send time + cost.transfer_time(src_unit, dst_unit, module, stage, work)``, where
  ``(module, stage)`` is the stage whose *output* crosses the edge: the sender's for an
  activation, the receiver's for a gradient (the gradient has the activation's shape), and
  ``work`` that stage's microbatch workload, or on a routed edge (``samples`` set) the
  workload of the samples it carries;
- a receive blocks until its message has arrived (matched like the validator's
  ``_message_key``: direction, both units, the sender's and the receiver's microbatch, both
  stages and ``samples``);
- ``GRAD_SYNC`` is a collective over the units holding a ``GRAD_SYNC`` of the same stage (its
  data-parallel replicas): all of them leave it at ``max(arrivals) + cost.grad_sync_time``;
- ``OPTIMIZER_STEP`` takes ``cost.optimizer_time``;
- with ``clip`` (``optim.max_grad_norm`` > 0), gradient clipping's norm: one scalar all-reduce
  over every unit, joined before the ``OPTIMIZER_STEP`` (or after the last action of a unit
  without one), which all leave at ``max(arrivals) + cost.clip_time()`` (`loom.sim.play`).

With ``link_contention`` a unit's outgoing messages also share one link: each transfer starts
when the previous one from the same unit has finished.

With a ``dispatch`` (`loom.sim.dispatch.DispatchCost`: what the dispatcher of ``loom train``
pays before the schedule starts, the metadata all-gather, the layout decision and one payload
all-to-all per phase) every unit starts at ``dispatch.total``; its parts are ``dispatch`` events
at the head of every unit's timeline and the iteration time includes them.

Balanced layouts (`loom.schedule.layout.BatchLayout`): ``work[j][m]`` is then the workload of
slot ``j`` *of module m* (encoder slot ``j`` and LLM slot ``j`` may hold different samples), and
the per-sample table ``sample_work[s]`` (position ``s`` of the global batch) gives the workload
of a part: the sum of its samples' workloads of the module, exact for packed workloads (the
encoders' items, a packed LLM), which are additive over samples.

The pieces: `loom.sim.work` (workload tables), `loom.sim.play` (the event loop, one handler per
action kind), `loom.sim.memory` (peak memory), `loom.sim.result` (`SimResult`),
`loom.sim.dispatch` (the dispatch's price).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from loom.cost.model import CostModel, MicrobatchWork
from loom.plan.plan import Plan
from loom.schedule.ir import Schedule
from loom.schedule.timeline import TimelineEvent
from loom.sim.dispatch import DISPATCH, DispatchCost
from loom.sim.memory import peak_memory, peak_memory_of
from loom.sim.play import DeadlockError, Play
from loom.sim.result import SimResult
from loom.sim.sharing import (
    MAX_ROUNDS,
    TOLERANCE,
    CoreSharing,
    cpu_seconds,
    place_units,
    restretch,
    shared_cores,
    wake_delays,
)
from loom.sim.work import PartWork, work_table

__all__ = ["DeadlockError", "SimResult", "peak_memory", "simulate"]


def simulate(
    schedule: Schedule,
    plan: Plan,
    cost: CostModel,
    work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None = None,
    *,
    num_samples: int | None = None,
    link_contention: bool = False,
    step: int = 0,
    sample_work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None = None,
    dispatch: DispatchCost | None = None,
    sharing: CoreSharing | None = None,
    clip: bool = False,
) -> SimResult:
    """Play one iteration of ``schedule`` (whose ranks are ``plan``'s pipeline units) under
    ``cost``, with ``work[j]`` the per-module workload of microbatch ``j`` (with a balanced
    layout: of slot ``j`` of each module). ``num_samples`` (the global batch size) adds
    ``samples_per_s``; ``step`` stamps the timeline events. ``sample_work[s]``, the per-module
    workload of sample ``s`` of the global batch, prices the parts of a layout's schedule (routed
    messages, split backwards); it is needed only when the schedule has such parts and ``work``
    is given. ``dispatch`` (`loom.sim.dispatch.price_dispatch`) runs before the schedule.
    ``sharing`` (`loom.sim.sharing.CoreSharing`): ranks that share a CPU host's cores, whose
    compute stretches by the contention it meets (the cost model then prices solo compute).
    ``clip``: the run clips gradients by their global norm (``optim.max_grad_norm`` > 0).

    Raises `DeadlockError` if some unit can never finish. The IR is not otherwise checked: run
    `loom.schedule.validate_schedule` first for a precise diagnosis of a malformed one."""
    units = sorted(schedule.actions)
    if units != list(range(plan.num_units)):
        raise ValueError(
            f"the schedule has ranks {units[:8]}{'...' if len(units) > 8 else ''} but the plan has pipeline "
            f"units 0..{plan.num_units - 1}: build the schedule from this plan"
        )
    works = work_table(work, schedule.num_microbatches)
    part_work = PartWork(sample_work, work is not None)
    if dispatch is not None and sharing is not None:
        # the decision and the host work run on every rank at once: the decision, the same on
        # every rank, meets the host's full contention; the ranks' host work shares the cores
        # until each rank's is done
        stretch = sharing.concurrent_stretch(plan.world_size)
        host = (sharing.concurrent_finish(dispatch.host_per_rank) if dispatch.host_per_rank
                else dispatch.host * stretch)
        dispatch = replace(dispatch, decide=dispatch.decide * stretch, host=host)
    head = dispatch.total if dispatch is not None else 0.0
    play = _play(schedule, plan, cost, works, part_work, link_contention, step, head, sharing, clip)
    if dispatch is not None:
        for u in units:
            play.events[u][:0] = _dispatch_events(dispatch, play.first_rank[u], play.roles[u], step)
    return _result(schedule, plan, cost, works, part_work, play, head, dispatch, num_samples)


def _play(schedule: Schedule, plan: Plan, cost: CostModel, works: list[MicrobatchWork], part_work: PartWork,
          link_contention: bool, step: int, head: float, sharing: CoreSharing | None, clip: bool = False) -> Play:
    """The iteration's play; with core sharing, the fixed point of `loom.sim.sharing`."""
    if sharing is None:
        return Play(schedule, plan, cost, works, part_work, link_contention=link_contention, step=step,
                    start=head, clip=clip).run()
    stretch: list[list[float]] = [[] for _ in range(plan.num_units)]
    wake: list[list[float]] = [[] for _ in range(plan.num_units)]
    placed: list[int] | None = None
    cold: list[bool] | None = None
    for i in range(MAX_ROUNDS):
        play = Play(schedule, plan, cost, works, part_work, link_contention=link_contention, step=step, start=head,
                    stretch=stretch, wake=wake, clip=clip, cold=cold).run()
        unit_ranks = [plan.spec(play.roles[u][0]).ranks_per_unit for u in play.units]
        if i == 0:  # placed once, by the solo play's compute: the fixed point keeps it
            placed = place_units(sharing, play.first_rank, unit_ranks, [sum(s) for s in play.solo])
            cold = shared_cores(sharing, play.first_rank, unit_ranks, placed)
        stretch, worst = restretch(sharing, play.first_rank, unit_ranks, play.solo, play.spans, stretch,
                                   play.background, placed)
        woken = wake_delays(sharing, play.first_rank, unit_ranks, play.spans, play.blocked, placed)
        if worst <= TOLERANCE and woken == wake and not (i == 0 and any(cold)):
            break
        wake = woken
    play.cpu = cpu_seconds(sharing, play.first_rank, unit_ranks, play.spans, play.background, placed)
    return play


def _dispatch_events(dispatch: DispatchCost, rank: int, role: tuple[str, int, int], step: int) -> list[TimelineEvent]:
    events, t = [], 0.0
    for label, d in dispatch.parts():
        events.append(TimelineEvent(rank, DISPATCH, label, role[0], role[1], -1, t, t + d, step))
        t += d
    return events


def _result(schedule: Schedule, plan: Plan, cost: CostModel, works: list[MicrobatchWork], part_work: PartWork,
            play: Play, head: float, dispatch: DispatchCost | None, num_samples: int | None) -> SimResult:
    units = play.units
    iteration = max(play.clock, default=0.0)
    ranks = {u: plan.spec(play.roles[u][0]).ranks_per_unit for u in units}
    busy = {u: play.compute[u] + play.sync[u] + head for u in units}
    idle = {u: iteration - busy[u] for u in units}
    world = plan.world_size
    gpu_time = iteration * world
    bubble = sum(ranks[u] * idle[u] for u in units) / gpu_time if gpu_time > 0 else 0.0
    flops = sum(cost.model_flops(w) for w in works)
    denominator = gpu_time * cost.peak_flops_per_rank()
    return SimResult(
        schedule_kind=schedule.kind,
        num_microbatches=schedule.num_microbatches,
        world_size=world,
        iteration_time=iteration,
        roles=play.roles,
        first_rank={u: play.first_rank[u] for u in units},
        ranks=ranks,
        finish={u: play.clock[u] for u in units},
        compute={u: play.compute[u] for u in units},
        cpu={u: (play.cpu or play.compute)[u] for u in units},
        sync={u: play.sync[u] for u in units},
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        model_flops=flops,
        mfu=flops / denominator if denominator > 0 else None,
        samples_per_s=num_samples / iteration if num_samples is not None and iteration > 0 else None,
        peak_memory=peak_memory_of(schedule, plan, cost, works, part_work),
        timeline=[e for log in play.events for e in log],
        dispatch=head,
        dispatch_parts=dispatch,
    )
