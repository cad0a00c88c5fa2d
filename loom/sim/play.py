"""The play of one iteration: a dataflow evaluation of a schedule IR under a cost model, one
handler per action kind (the semantics are `loom.sim.simulator`'s module docstring).

Every unit has a pointer into its action list; a ready stack holds the units that can advance;
a unit blocked on a receive waits on that message's key and is woken by the send that posts it,
a unit at a grad sync by the last replica to arrive. Each action is visited once.

With ``clip`` (``optim.max_grad_norm`` > 0) every unit also joins gradient clipping's norm
all-reduce over the world, as the executor does: a unit with an ``OPTIMIZER_STEP`` before it
(after its gradient sync), a unit without one (a frozen stage) after its last action; all leave
at the last arrival plus ``cost.clip_time()``, so the optimizer steps wait for every rank's
backward. Because
messages carry their arrival times and no resource is shared between units, the order in which
units advance changes no time, so the result is exact. Core sharing (`loom.sim.sharing`) enters
as fixed stretch factors per compute action and wake-up delays per blocked receive, set between
plays by `simulate`'s fixed point.
"""

from __future__ import annotations

from loom.cost.model import CostModel, MicrobatchWork
from loom.plan.plan import LLM, Plan
from loom.schedule.ir import Action, ActionKind, Schedule
from loom.schedule.timeline import TimelineEvent
from loom.schedule.validate import ScheduleError
from loom.sim.work import EMPTY, PartWork

FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_ACT, SEND_GRAD = ActionKind.SEND_ACT, ActionKind.SEND_GRAD
RECV_ACT, RECV_GRAD = ActionKind.RECV_ACT, ActionKind.RECV_GRAD
GRAD_SYNC, OPTIMIZER_STEP = ActionKind.GRAD_SYNC, ActionKind.OPTIMIZER_STEP

CLIP = "clip"  # the timeline kind of gradient clipping's norm all-reduce (not an IR action)
_NAME = {k: k.value for k in ActionKind}  # enum .value is a property call; this is a dict hit


class DeadlockError(ScheduleError):
    """The IR cannot finish: some unit waits forever. The message names every blocked unit and
    the action it waits at."""


class Play:
    """One iteration of ``schedule`` on ``plan``'s pipeline units under ``cost``: ``works[j]``
    is microbatch ``j``'s per-module workload, ``part_work`` prices sample subsets. Every unit
    starts at ``start`` (after the batch dispatch). `run` fills ``clock`` (each unit's finish),
    ``compute``, ``sync`` and ``events`` (per unit, in order)."""

    def __init__(self, schedule: Schedule, plan: Plan, cost: CostModel, works: list[MicrobatchWork],
                 part_work: PartWork, *, link_contention: bool = False, step: int = 0, start: float = 0.0,
                 stretch: list[list[float]] | None = None, wake: list[list[float]] | None = None,
                 clip: bool = False, cold: list[bool] | None = None):
        self.units = sorted(schedule.actions)
        n = len(self.units)
        self.actions = [schedule.actions[u] for u in self.units]
        self.roles = {u: plan.role_of_unit(u) for u in self.units}
        self.first_rank = [plan.rank_of(*self.roles[u]) for u in self.units]
        self.cost, self.works, self.part_work = cost, works, part_work
        self.link_contention, self.step = link_contention, step
        self.stage_time, self.transfer_time = cost.stage_time, cost.transfer_time
        self.generators = set(plan.generator_names)

        # A grad sync's group: every unit holding a GRAD_SYNC of the same stage (its DP replicas).
        self.sync_group: dict[tuple[str, int], list[int]] = {}
        for u in self.units:
            for a in self.actions[u]:
                if a.kind is GRAD_SYNC:
                    self.sync_group.setdefault((a.module, a.stage), []).append(u)
        self.sync_size = {st: len(group) for st, group in self.sync_group.items()}

        self.clock = [start] * n
        self.pointer = [0] * n
        self.compute = [0.0] * n
        self.sync = [0.0] * n
        self.link_free = [start] * n  # with link_contention: when the unit's outgoing link is next free
        self.events: list[list[TimelineEvent]] = [[] for _ in range(n)]
        # With core sharing (`loom.sim.sharing`): per unit, each compute action's stretch factor
        # (missing ones are 1), and what the fixed point reads back: solo times and spans.
        self.stretch = stretch
        self.cold = cold  # per unit: its compute actions pay `CostModel.cold_start_time` (`shared_cores`)
        self.solo: list[list[float]] = [[] for _ in range(n)]
        self.spans: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.cpu: list[float] | None = None  # per unit, CPU seconds under core sharing (`simulate` sets it)
        # per unit, under core sharing: the communicator threads' CPU of its messages as (start,
        # end, seconds), load on its host's cores beside the compute (`CostModel.transfer_cpu`)
        self.background: list[list[tuple[float, float, float]]] = [[] for _ in range(n)]
        self.messages: dict[tuple, list[float]] = {}  # message key -> arrival times of posted, unreceived copies
        self.arrivals: list[list[float]] = [[] for _ in range(n)]  # per unit, each receive's message arrival, in order
        # per unit, per receive in order: its message's arrival where the receive waited for it,
        # else None; and the wake-up delay each such receive meets (core sharing's fixed point)
        self.blocked: list[list[float | None]] = [[] for _ in range(n)]
        self.wake = wake
        self.waiting: dict[tuple, int] = {}  # message key -> the unit blocked on it
        self.arrived: dict[tuple[str, int], dict[int, float]] = {}  # stage -> {unit: arrival} at its grad sync
        # gradient clipping's world all-reduce: who must join, who has (unit -> arrival), who is through
        self.clip = clip
        self.clip_at_end = [not any(a.kind is OPTIMIZER_STEP for a in acts) for acts in self.actions]
        self.clip_arrived: dict[int, float] = {}
        self.clipped = [not clip] * n
        # Units that may advance, as a stack. The order is free: it changes no time.
        self.ready = list(reversed(self.units))
        self.handlers = {FORWARD: self._compute, BACKWARD: self._compute, ActionKind.BACKWARD_INPUT: self._compute,
                         ActionKind.BACKWARD_WEIGHT: self._compute, SEND_ACT: self._send, SEND_GRAD: self._send,
                         RECV_ACT: self._receive, RECV_GRAD: self._receive, GRAD_SYNC: self._grad_sync,
                         OPTIMIZER_STEP: self._optimizer}

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> "Play":
        """Advance units until none can; raises `DeadlockError` if some never finish."""
        ready = self.ready
        while ready:
            self._advance(ready.pop())
        blocked = [u for u in self.units if self.pointer[u] < len(self.actions[u])]
        if blocked:
            raise DeadlockError(self._deadlock_message(blocked))
        return self

    def _advance(self, u: int) -> None:
        """Run unit ``u``'s actions from its pointer until it blocks (a handler returns None)
        or its list ends."""
        acts, handlers = self.actions[u], self.handlers
        i, t, end = self.pointer[u], self.clock[u], len(acts)
        while i < end:
            a = acts[i]
            after = handlers[a.kind](u, a, t)
            if after is None:
                break
            t = after
            i += 1
        self.pointer[u], self.clock[u] = i, t
        if i == end and not self.clipped[u] and self.clip_at_end[u] and u not in self.clip_arrived:
            done = self._join_clip(u, t)  # no optimizer step here: join the norm after the last action
            if done is not None:
                self.clock[u] = done

    def _event(self, u: int, a: Action, start: float, end: float) -> TimelineEvent:
        return TimelineEvent(self.first_rank[u], _NAME[a.kind], a.short(), a.module, a.stage, a.microbatch, start, end,
                             self.step)

    # ---- one handler per action kind: (unit, action, its start) -> its end, None if blocked ----
    def _compute(self, u: int, a: Action, t: float) -> float:
        """``FORWARD`` / ``BACKWARD``: the microbatch's workload of the module, or one part of a
        split backward: its own samples' work. ZB-H1's ``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT``
        cost the cost model's phase of that name (the action kind's value)."""
        w = self.works[a.microbatch].get(a.module, EMPTY) if a.samples is None else self.part_work(a.module, a.samples)
        name = _NAME[a.kind]
        d = self.stage_time(a.module, a.stage, name, w)
        if self.cold is not None and self.cold[u] and d > 0:
            d += self.cost.cold_start_time(a.module, a.stage, name)
        if self.stretch is not None:
            d = self._stretched(u, d, t)
        self.events[u].append(TimelineEvent(self.first_rank[u], name, a.short(), a.module, a.stage, a.microbatch, t,
                                            t + d, self.step))
        self.compute[u] += d
        return t + d

    def _send(self, u: int, a: Action, t: float) -> float:
        """A send takes no time on its sender; its message arrives after the transfer."""
        # The tensor crossing the edge is the output of the edge's forward-direction source.
        # Its microbatch is the sender's for an activation, the receiver's for a gradient.
        other = a.microbatch if a.peer_microbatch is None else a.peer_microbatch
        if a.kind is SEND_ACT:
            om, os_, omb = a.module, a.stage, a.microbatch
        else:
            om, os_, omb = a.peer_module, a.peer_stage, other
        generator = a.peer_module if a.kind is SEND_ACT else a.module  # the edge's forward destination
        conditioning = om == LLM and generator in self.generators
        if self._no_rows(om, omb, generator, a.samples):  # the executor sends nothing
            self.events[u].append(self._event(u, a, t, t))
            return t
        if conditioning:  # the LLM's states at the generator's positions
            w = self.works[omb].get(generator, EMPTY) if a.samples is None else self.part_work(generator, a.samples)
            d = self.cost.condition_transfer_time(u, a.peer, generator, w)
        else:
            # a routed edge carries only its part's rows
            w = self.works[omb].get(om, EMPTY) if a.samples is None else self.part_work(om, a.samples)
            d = self.transfer_time(u, a.peer, om, os_, w)
        start = t
        if self.link_contention:
            start = max(t, self.link_free[u])
            self.link_free[u] = start + d
        if self.stretch is not None and not conditioning:
            self._thread_cpu(u, a.peer, self.cost.transfer_cpu(u, a.peer, om, os_, w), start, d)
        # (direction, sender, receiver, sender's microbatch, receiver's microbatch, stages, samples)
        key = (a.kind is SEND_GRAD, u, a.peer, a.microbatch, other, a.module, a.stage, a.peer_module, a.peer_stage,
               a.samples)
        posted = self.messages.get(key)
        if posted is None:
            self.messages[key] = [start + d]
        else:
            posted.append(start + d)
        woken = self.waiting.pop(key, None)
        if woken is not None:
            self.ready.append(woken)
        self.events[u].append(self._event(u, a, t, t))
        return t

    def _no_rows(self, module: str, microbatch: int, generator: str, samples: tuple[int, ...] | None) -> bool:
        """Whether the tensor of an edge whose forward source is ``module`` (destination
        ``generator``) has no rows in ``microbatch`` (no item of the module in it, or none of a
        routed part's ``samples``): the executor's communicator then neither sends nor waits
        (`P2PCommunicator.recv_shaped` of an empty shape), so the receive does not depend on the
        send. A generator's conditioning states are never empty."""
        if module == LLM and generator in self.generators:
            return False
        if samples is None:
            w = self.works[microbatch].get(module)
        else:
            w = self.part_work(module, samples) if self.part_work.table is not None else None
        return w is not None and w.tokens == 0  # no workload given (a cost model that ignores it): sizes unknown

    def _thread_cpu(self, u: int, peer: int, cpu: tuple[float, float], start: float, d: float) -> None:
        """Under core sharing: the communicator threads' CPU for a message (sender's, receiver's),
        spread over the transfer (at least its own length) on each end's host."""
        for unit, seconds in ((u, cpu[0]), (peer, cpu[1])):
            if seconds > 0:
                self.background[unit].append((start, start + max(d, seconds), seconds))

    def _receive(self, u: int, a: Action, t: float) -> float | None:
        """A receive blocks until its message has arrived (matched like the validator's
        ``_message_key``)."""
        other = a.microbatch if a.peer_microbatch is None else a.peer_microbatch
        # the tensor's forward source and destination, as in `_send`
        if a.kind is RECV_ACT:
            om, omb, dest = a.peer_module, other, a.module
        else:
            om, omb, dest = a.module, a.microbatch, a.peer_module
        if self._no_rows(om, omb, dest, a.samples):
            arrival = t  # no rows: the executor receives nothing and goes on (as `_send` posts nothing)
        else:
            key = (a.kind is RECV_GRAD, a.peer, u, other, a.microbatch, a.peer_module, a.peer_stage, a.module,
                   a.stage, a.samples)
            posted = self.messages.get(key)
            if not posted:
                self.waiting[key] = u
                return None
            arrival = posted.pop(0)
            if not posted:
                del self.messages[key]
        k = len(self.arrivals[u])
        self.arrivals[u].append(arrival)
        self.blocked[u].append(arrival if arrival > t else None)
        end = arrival if arrival > t else t
        if arrival > t and self.wake is not None and k < len(self.wake[u]):
            end += self.wake[u][k]
        self.events[u].append(TimelineEvent(self.first_rank[u], _NAME[a.kind], a.short(), a.module, a.stage,
                                            a.microbatch, t, end, self.step))
        return end

    def _grad_sync(self, u: int, a: Action, t: float) -> float | None:
        """A collective over the stage's replicas: all leave at ``max(arrivals) + grad_sync_time``;
        the last to arrive releases the others."""
        st = (a.module, a.stage)
        here = self.arrived.setdefault(st, {})
        here[u] = t
        if len(here) < self.sync_size[st]:
            return None
        d = self.cost.grad_sync_time(a.module, a.stage)
        end = max(here.values()) + d
        del self.arrived[st]
        for q, tq in here.items():
            aq = a if q == u else self.actions[q][self.pointer[q]]
            self.events[q].append(self._event(q, aq, tq, end))
            self.sync[q] += d
            if q != u:
                self.clock[q] = end
                self.pointer[q] += 1
                self.ready.append(q)
        return end

    def _join_clip(self, u: int, t: float) -> float | None:
        """Unit ``u`` reaches the clipping norm's all-reduce at ``t``: None while others are
        still to come; the last to arrive releases everyone at ``max(arrivals) + clip_time``."""
        self.clip_arrived[u] = t
        if len(self.clip_arrived) < len(self.units):
            return None
        d = self.cost.clip_time()
        end = max(self.clip_arrived.values()) + d
        for q, tq in self.clip_arrived.items():
            role = self.roles[q]
            self.events[q].append(TimelineEvent(self.first_rank[q], CLIP, "CLIP", role[0], role[1], -1, tq, end,
                                                self.step))
            self.sync[q] += d
            self.clipped[q] = True
            if q != u:
                self.clock[q] = end
                if not self.clip_at_end[q]:
                    self.ready.append(q)  # back to its optimizer step
        self.clip_arrived = {}
        return end

    def _optimizer(self, u: int, a: Action, t: float) -> float | None:
        if not self.clipped[u]:  # clip before the step: the scale needs every rank's gradients
            if u in self.clip_arrived:
                return None
            after = self._join_clip(u, t)
            if after is None:
                return None
            t = after
        d = self.cost.optimizer_time(a.module, a.stage)
        if self.stretch is not None:
            d = self._stretched(u, d, t)
        self.events[u].append(self._event(u, a, t, t + d))
        self.compute[u] += d
        return t + d

    def _stretched(self, u: int, d: float, t: float) -> float:
        """A compute action of solo time ``d`` starting at ``t``, stretched by the core sharing
        it meets (its factor from the last round of the fixed point)."""
        k = len(self.solo[u])
        factors = self.stretch[u]
        out = d * (factors[k] if k < len(factors) else 1.0)
        self.solo[u].append(d)
        self.spans[u].append((t, t + out))
        return out

    # ---- diagnosis ---------------------------------------------------------------------------
    def _deadlock_message(self, blocked: list[int], limit: int = 12) -> str:
        lines = []
        for u in blocked[:limit]:
            a = self.actions[u][self.pointer[u]]
            m, s, d = self.roles[u]
            what = f"unit {u} ({m}.{s} dp{d}) waits at {a.short()} (action {self.pointer[u]} of {len(self.actions[u])})"
            if a.kind is GRAD_SYNC:
                st = (a.module, a.stage)
                here = self.arrived.get(st, {})
                missing = [q for q in self.sync_group[st] if q not in here]
                what += f" with {len(here)} of {len(self.sync_group[st])} replicas arrived (missing units {missing})"
            elif a.kind is OPTIMIZER_STEP and u in self.clip_arrived:
                what += " at gradient clipping's norm all-reduce, which some unit never reaches"
            elif a.peer is not None:
                what += f" for a message from unit {a.peer} that is never sent"
            lines.append(what)
        if len(blocked) > limit:
            lines.append(f"... and {len(blocked) - limit} more units")
        return f"deadlock: {len(blocked)} units can never finish: " + "; ".join(lines)
