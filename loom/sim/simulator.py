"""Discrete-event simulation of a schedule IR under a cost model (DESIGN.md, "The schedule IR":
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
- ``OPTIMIZER_STEP`` takes ``cost.optimizer_time``.

With ``link_contention`` a unit's outgoing messages also share one link: each transfer starts
when the previous one from the same unit has finished.

Balanced layouts (`loom.schedule.layout.BatchLayout`): ``work[j][m]`` is then the workload of
slot ``j`` *of module m* (encoder slot ``j`` and LLM slot ``j`` may hold different samples), and
the per-sample table ``sample_work[s]`` (position ``s`` of the global batch) gives the workload
of a part: the sum of its samples' workloads of the module, exact for packed workloads (the
encoders' items, a packed LLM), which are additive over samples.

The play is a dataflow evaluation, not a time-stepped loop: every unit has a pointer into its
list; a ready stack holds the units that can advance; a unit blocked on a receive waits on that
message's key and is woken by the send that posts it, a unit at a grad sync by the last replica
to arrive. Each action is visited once. Because messages carry their arrival times and no
resource is shared between units, the order in which units advance does not change any time,
so the result is exact (it equals the validator's unit-cost play when forward and backward
cost 1 and everything else 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.cost.model import CostModel, MicrobatchWork, Workload
from loom.plan.plan import Plan

from loom.schedule.timeline import TimelineEvent, write_chrome_trace
from loom.schedule.ir import ActionKind, Schedule, stage_key
from loom.schedule.validate import ScheduleError

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_ACT, SEND_GRAD = ActionKind.SEND_ACT, ActionKind.SEND_GRAD
RECV_ACT, RECV_GRAD = ActionKind.RECV_ACT, ActionKind.RECV_GRAD
GRAD_SYNC, OPTIMIZER_STEP = ActionKind.GRAD_SYNC, ActionKind.OPTIMIZER_STEP

_EMPTY = Workload()  # a module a microbatch does not touch (no audio in it) costs its empty workload
_NAME = {k: k.value for k in ActionKind}  # enum .value is a property call; this is a dict hit

class DeadlockError(ScheduleError):
    """The IR cannot finish: some unit waits forever. The message names every blocked unit and
    the action it waits at."""


@dataclass
class SimResult:
    """What one simulated iteration cost. Times in seconds, memory in bytes per rank; per-unit
    figures are dicts keyed by pipeline unit.

    - ``compute[u]``: time in ``FORWARD``, ``BACKWARD`` and ``OPTIMIZER_STEP``;
    - ``sync[u]``: time in gradient synchronisation proper (``cost.grad_sync_time`` for each
      ``GRAD_SYNC``; waiting there for slower replicas is idle);
    - ``busy[u] = compute[u] + sync[u]``; ``idle[u] = iteration_time - busy[u]``: the bubbles,
      including time blocked on receives (transfers are overlapped with compute or waited for,
      so waiting for one is idle) and time after the unit's last action;
    - ``bubble_fraction``: idle GPU-time over total GPU-time, each unit weighted by its ranks
      (``Σ_u ranks[u] idle[u] / (iteration_time * world_size)``);
    - ``mfu``: ``Σ_mb cost.model_flops / (iteration_time * world_size * peak_flops_per_rank)``,
      ``None`` when the denominator is 0;
    - ``peak_memory[u]``: ``cost.static_memory`` plus the most activation memory the unit held
      at once (a microbatch's ``activation_memory`` is held from its forward to its backward,
      and only during the forward on a stage without backward);
    - ``timeline``: one `TimelineEvent` per action, ``rank`` = the unit's first rank; sends are
      instantaneous, a receive spans its wait, a grad sync spans the wait plus the collective
      (as the executor records them).
    """

    schedule_kind: str
    num_microbatches: int
    world_size: int
    iteration_time: float
    roles: dict[int, tuple[str, int, int]]  # unit -> (module, stage, replica)
    first_rank: dict[int, int]
    ranks: dict[int, int]  # unit -> ranks per unit (TP x CP)
    finish: dict[int, float]
    compute: dict[int, float]
    sync: dict[int, float]
    busy: dict[int, float]
    idle: dict[int, float]
    bubble_fraction: float
    model_flops: float
    mfu: float | None
    samples_per_s: float | None
    peak_memory: dict[int, float]
    timeline: list[TimelineEvent]

    def role_names(self) -> dict[int, str]:
        """First rank -> a readable role, ``"vision.1 dp0 (unit 3, 4 ranks)"``, for traces."""
        names = {}
        for u, (m, s, d) in self.roles.items():
            n = self.ranks[u]
            names[self.first_rank[u]] = f"{m}.{s} dp{d} (unit {u}" + (f", {n} ranks)" if n > 1 else ")")
        return names

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write the timeline as Chrome trace JSON, the executor's format (open in Perfetto)."""
        write_chrome_trace(self.timeline, path, self.role_names())
        return Path(path)

    def plot_gantt(self, path: str | Path, title: str | None = None) -> Path:
        """Write a PNG Gantt chart of the timeline (needs matplotlib)."""
        from loom.sim.gantt import plot_gantt

        if title is None:
            title = (f"simulated {self.schedule_kind}: {self.num_microbatches} microbatches, "
                     f"{self.world_size} ranks, {self.iteration_time:.4g} s, "
                     f"bubbles {self.bubble_fraction:.1%}")
        return plot_gantt(self.timeline, path, title=title, role_names=self.role_names())

    def summary(self, per_unit: bool = False) -> dict[str, Any]:
        """The headline figures as a JSON-ready dict (``per_unit`` adds one row per unit)."""
        out: dict[str, Any] = {
            "simulated": True,  # DESIGN.md principle 6: a simulator figure is labelled as simulated
            "schedule": self.schedule_kind,
            "num_microbatches": self.num_microbatches,
            "world_size": self.world_size,
            "num_units": len(self.roles),
            "iteration_time_s": self.iteration_time,
            "bubble_fraction": self.bubble_fraction,
            "mfu": self.mfu,
            "samples_per_s": self.samples_per_s,
            "model_flops": self.model_flops,
            "max_peak_memory_bytes": max(self.peak_memory.values(), default=0.0),
        }
        if per_unit:
            out["units"] = {
                str(u): {"role": f"{m}.{s} dp{d}", "first_rank": self.first_rank[u], "ranks": self.ranks[u],
                         "busy_s": self.busy[u], "idle_s": self.idle[u], "finish_s": self.finish[u],
                         "peak_memory_bytes": self.peak_memory[u]}
                for u, (m, s, d) in self.roles.items()
            }
        return out


# ---- inputs ------------------------------------------------------------------------------
class _PartWork:
    """The workload of a subset of samples of one module (a routed message, a backward part):
    the sum of the samples' workloads in ``sample_work``, memoised per ``(module, samples)``."""

    def __init__(self, sample_work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None, any_work: bool):
        self.table = sample_work
        self.any_work = any_work
        self.cache: dict[tuple[str, tuple[int, ...]], Workload] = {}

    def __call__(self, module: str, samples: tuple[int, ...]) -> Workload:
        key = (module, samples)
        w = self.cache.get(key)
        if w is not None:
            return w
        if self.table is None:
            if self.any_work:
                raise ValueError(
                    f"the schedule names sample subsets (routed edges or a split backward, e.g. {module} samples "
                    f"{list(samples)[:8]}) but no sample_work was given: pass the per-sample workloads "
                    f"(sample_work[position]) so a part costs its own samples"
                )
            w = _EMPTY
        else:
            w = _EMPTY
            for s in samples:
                try:
                    row = self.table[s]
                except (IndexError, KeyError):
                    raise KeyError(f"sample_work has no entry for sample {s} (named by a {module} part)") from None
                w = w + row.get(module, _EMPTY)
        self.cache[key] = w
        return w


def _work_table(work: Sequence[MicrobatchWork] | Mapping[int, MicrobatchWork] | None, count: int) -> list[MicrobatchWork]:
    """Every microbatch's workload by index; ``None`` gives every microbatch an empty one (for
    cost models that ignore the workload, such as `UniformCostModel`)."""
    if work is None:
        return [{} for _ in range(count)]
    if isinstance(work, Mapping):
        missing = [j for j in range(count) if j not in work]
        if missing:
            raise KeyError(f"work has no entry for microbatches {missing}; the schedule has {count}")
        return [work[j] for j in range(count)]
    if len(work) < count:
        raise ValueError(f"work lists {len(work)} microbatches; the schedule has {count}")
    return list(work[:count])


# ---- the play ----------------------------------------------------------------------------
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
) -> SimResult:
    """Play one iteration of ``schedule`` (whose ranks are ``plan``'s pipeline units) under
    ``cost``, with ``work[j]`` the per-module workload of microbatch ``j`` (with a balanced
    layout: of slot ``j`` of each module). ``num_samples`` (the global batch size) adds
    ``samples_per_s``; ``step`` stamps the timeline events. ``sample_work[s]``, the per-module
    workload of sample ``s`` of the global batch, prices the parts of a layout's schedule (routed
    messages, split backwards); it is needed only when the schedule has such parts and ``work``
    is given.

    Raises `DeadlockError` if some unit can never finish. The IR is not otherwise checked: run
    `loom.schedule.validate_schedule` first for a precise diagnosis of a malformed one."""
    units = sorted(schedule.actions)
    if units != list(range(plan.num_units)):
        raise ValueError(
            f"the schedule has ranks {units[:8]}{'...' if len(units) > 8 else ''} but the plan has pipeline "
            f"units 0..{plan.num_units - 1}: build the schedule from this plan"
        )
    count = schedule.num_microbatches
    works = _work_table(work, count)
    part_work = _PartWork(sample_work, work is not None)
    n = len(units)
    actions = [schedule.actions[u] for u in units]
    roles = {u: plan.role_of_unit(u) for u in units}
    first_rank = {u: plan.rank_of(*roles[u]) for u in units}
    ranks = {u: plan.spec(roles[u][0]).ranks_per_unit for u in units}

    # A grad sync's group: every unit holding a GRAD_SYNC of the same stage (its DP replicas).
    sync_group: dict[tuple[str, int], list[int]] = {}
    for u in units:
        for a in actions[u]:
            if a.kind is GRAD_SYNC:
                sync_group.setdefault((a.module, a.stage), []).append(u)
    sync_size = {st: len(group) for st, group in sync_group.items()}

    clock = [0.0] * n
    pointer = [0] * n
    compute = [0.0] * n
    sync = [0.0] * n
    link_free = [0.0] * n  # with link_contention: when the unit's outgoing link is next free
    events: list[list[TimelineEvent]] = [[] for _ in range(n)]
    messages: dict[tuple, list[float]] = {}  # message key -> arrival times of posted, unreceived copies
    waiting: dict[tuple, int] = {}  # message key -> the unit blocked on it
    arrived: dict[tuple[str, int], dict[int, float]] = {}  # stage -> {unit: arrival} at its grad sync
    # Units that may advance, as a stack. The order is free: it changes no time (module docstring).
    ready = list(reversed(units))

    stage_time, transfer_time = cost.stage_time, cost.transfer_time

    while ready:
        u = ready.pop()
        acts, log = actions[u], events[u]
        i, t, end_i = pointer[u], clock[u], len(actions[u])
        while i < end_i:
            a = acts[i]
            k = a.kind
            if k is FORWARD or k is BACKWARD:
                if a.samples is None:
                    w = works[a.microbatch].get(a.module, _EMPTY)
                else:  # one part of a split backward: its own samples' work
                    w = part_work(a.module, a.samples)
                d = stage_time(a.module, a.stage, _NAME[k], w)
                log.append(TimelineEvent(first_rank[u], _NAME[k], a.short(), a.module, a.stage, a.microbatch, t, t + d, step))
                compute[u] += d
                t += d
            elif k is SEND_ACT or k is SEND_GRAD:
                # The tensor crossing the edge is the output of the edge's forward-direction source.
                # Its microbatch is the sender's for an activation, the receiver's for a gradient.
                other = a.microbatch if a.peer_microbatch is None else a.peer_microbatch
                if k is SEND_ACT:
                    om, os_, omb = a.module, a.stage, a.microbatch
                else:
                    om, os_, omb = a.peer_module, a.peer_stage, other
                if a.samples is None:
                    w = works[omb].get(om, _EMPTY)
                else:  # a routed edge carries only its part's rows
                    w = part_work(om, a.samples)
                d = transfer_time(u, a.peer, om, os_, w)
                start = t
                if link_contention:
                    start = max(t, link_free[u])
                    link_free[u] = start + d
                # (direction, sender, receiver, sender's microbatch, receiver's microbatch, stages, samples)
                key = (k is SEND_GRAD, u, a.peer, a.microbatch, other, a.module, a.stage, a.peer_module, a.peer_stage,
                       a.samples)
                posted = messages.get(key)
                if posted is None:
                    messages[key] = [start + d]
                else:
                    posted.append(start + d)
                woken = waiting.pop(key, None)
                if woken is not None:
                    ready.append(woken)
                log.append(TimelineEvent(first_rank[u], _NAME[k], a.short(), a.module, a.stage, a.microbatch, t, t, step))
            elif k is RECV_ACT or k is RECV_GRAD:
                other = a.microbatch if a.peer_microbatch is None else a.peer_microbatch
                key = (k is RECV_GRAD, a.peer, u, other, a.microbatch, a.peer_module, a.peer_stage, a.module, a.stage,
                       a.samples)
                posted = messages.get(key)
                if not posted:
                    waiting[key] = u
                    break
                arrival = posted.pop(0)
                if not posted:
                    del messages[key]
                end = arrival if arrival > t else t
                log.append(TimelineEvent(first_rank[u], _NAME[k], a.short(), a.module, a.stage, a.microbatch, t, end, step))
                t = end
            elif k is GRAD_SYNC:
                st = (a.module, a.stage)
                here = arrived.setdefault(st, {})
                here[u] = t
                if len(here) < sync_size[st]:
                    break  # blocked until the last replica arrives and releases the group
                d = cost.grad_sync_time(a.module, a.stage)
                end = max(here.values()) + d
                del arrived[st]
                for q, tq in here.items():
                    aq = acts[i] if q == u else actions[q][pointer[q]]
                    events[q].append(TimelineEvent(first_rank[q], _NAME[aq.kind], aq.short(), aq.module, aq.stage,
                                                   aq.microbatch, tq, end, step))
                    sync[q] += d
                    if q != u:
                        clock[q] = end
                        pointer[q] += 1
                        ready.append(q)
                t = end
            elif k is OPTIMIZER_STEP:
                d = cost.optimizer_time(a.module, a.stage)
                log.append(TimelineEvent(first_rank[u], _NAME[k], a.short(), a.module, a.stage, a.microbatch, t, t + d, step))
                compute[u] += d
                t += d
            else:  # pragma: no cover - ActionKind is closed
                raise ValueError(f"unit {u}: cannot simulate {a.short()}")
            i += 1
        pointer[u], clock[u] = i, t

    blocked = [u for u in units if pointer[u] < len(actions[u])]
    if blocked:
        raise DeadlockError(_deadlock_message(blocked, actions, pointer, roles, arrived, sync_group))

    iteration = max(clock, default=0.0)
    busy = {u: compute[u] + sync[u] for u in units}
    idle = {u: iteration - busy[u] for u in units}
    world = plan.world_size
    gpu_time = iteration * world
    bubble = sum(ranks[u] * idle[u] for u in units) / gpu_time if gpu_time > 0 else 0.0
    flops = sum(cost.model_flops(w) for w in works)
    denominator = gpu_time * cost.peak_flops_per_rank()
    return SimResult(
        schedule_kind=schedule.kind,
        num_microbatches=count,
        world_size=world,
        iteration_time=iteration,
        roles=roles,
        first_rank=first_rank,
        ranks=ranks,
        finish={u: clock[u] for u in units},
        compute={u: compute[u] for u in units},
        sync={u: sync[u] for u in units},
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        model_flops=flops,
        mfu=flops / denominator if denominator > 0 else None,
        samples_per_s=num_samples / iteration if num_samples is not None and iteration > 0 else None,
        peak_memory=_peak_memory(schedule, plan, cost, works, part_work),
        timeline=[e for log in events for e in log],
    )


def _deadlock_message(blocked, actions, pointer, roles, arrived, sync_group, limit: int = 12) -> str:
    lines = []
    for u in blocked[:limit]:
        a = actions[u][pointer[u]]
        m, s, d = roles[u]
        what = f"unit {u} ({m}.{s} dp{d}) waits at {a.short()} (action {pointer[u]} of {len(actions[u])})"
        if a.kind is GRAD_SYNC:
            st = (a.module, a.stage)
            here = arrived.get(st, {})
            missing = [q for q in sync_group[st] if q not in here]
            what += f" with {len(here)} of {len(sync_group[st])} replicas arrived (missing units {missing})"
        elif a.peer is not None:
            what += f" for a message from unit {a.peer} that is never sent"
        lines.append(what)
    if len(blocked) > limit:
        lines.append(f"... and {len(blocked) - limit} more units")
    return f"deadlock: {len(blocked)} units can never finish: " + "; ".join(lines)


# ---- memory ------------------------------------------------------------------------------
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
    the last part); on a stage without backward (``schedule.needs_backward``) it is freed as
    soon as the forward ends, so it counts only while that forward runs. The recompute working
    set of a backward part is its own samples'."""
    works = _work_table(work, schedule.num_microbatches)
    return _peak_memory(schedule, plan, cost, works, _PartWork(sample_work, work is not None))


def _peak_memory(schedule: Schedule, plan: Plan, cost: CostModel, works: list[MicrobatchWork],
                 part_work: _PartWork) -> dict[int, float]:
    peaks: dict[int, float] = {}
    no_backward = {k for k, needed in schedule.needs_backward.items() if not needed}
    for u in sorted(schedule.actions):
        acts = schedule.actions[u]
        backwards_left: dict[tuple[str, int, int], int] = {}
        for a in acts:
            if a.kind is BACKWARD:
                key = (a.module, a.stage, a.microbatch)
                backwards_left[key] = backwards_left.get(key, 0) + 1
        held: dict[tuple[str, int, int], float] = {}
        live = peak = 0.0
        for a in acts:
            if a.kind is FORWARD:
                key = (a.module, a.stage, a.microbatch)
                size = cost.activation_memory(a.module, a.stage, works[a.microbatch].get(a.module, _EMPTY))
                live += size
                peak = max(peak, live)
                if key in backwards_left and stage_key(a.module, a.stage) not in no_backward:
                    held[key] = held.get(key, 0.0) + size
                else:
                    live -= size
            elif a.kind is BACKWARD:
                key = (a.module, a.stage, a.microbatch)
                # the recompute working set is live while this backward (part) runs
                w = works[a.microbatch].get(a.module, _EMPTY) if a.samples is None else part_work(a.module, a.samples)
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
