"""Optimus's bubble filling as an IR transform (optimus.md §3.2 Algorithm 2, §3.4 to §3.6): the
colocated encoders' work moved into the LLM pipeline's bubbles on each rank, decided on the
simulator's timeline and checked by playing the result.

The input is a ``placement = "colocated"`` schedule (`loom.schedule.generators`): on every
pipeline unit, its encoder replicas' forwards run first and their backwards last, around the
LLM's own order, which is Optimus's coarse schedule without its shift (§3.4 steps 1 and 3).
A *block* is one encoder microbatch's forward (its receive from the previous chunk, the
``FORWARD`` and its sends) or backward (its gradient receives, the ``BACKWARD`` and any
gradient sends) on that unit, for the whole encoder or, when the plan cuts it into chunks
(``num_stages = virtual_stages``, all on the unit), for each chunk; the unit's other actions,
the LLM's, are its *skeleton*, whose order never changes.

One round (`fill_round`) plays the schedule and, per unit, reads the *gaps* of its skeleton:
the time between one skeleton compute action's end and the next one's start (the LLM waiting
on a message, or the unit running encoder blocks there now), excluding the head (before the
first LLM compute) and the tail (after the last). Then, as Optimus's fine schedule does with
the LLM timeline fixed (§3.5, at the granularity of the blocks: layers when the chunks are):

- forwards, latest deadline first, each into the latest gap where it ends before its deadline,
  the moment its consumer (the LLM's first stage) reaches the matching receive minus the
  message's transfer (``EF_i <= F_i``, §3.6); the rest stay at the head, earliest deadline first;
- backwards, earliest gradient first, each into the earliest gap that starts after its gradient
  arrived (``EB_i >= B_i``) with room for it; the rest stay at the tail, in arrival order;
- a chunk's forward goes no later than the chunk it feeds, its backward no earlier than the
  chunk whose gradient it takes (their windows follow along the chain).

A block goes into a gap only if the gap's free time holds it whole (the skeleton's timing then
holds to first order), or, in a second pass, with up to half its own time past the gap's end
(`OVERFLOWS`: a short delay of the LLM against the whole block at the head or the tail); the
play keeps whichever is faster. The gap's insertion point is right before the receives of the
skeleton compute action that ends the gap. Moves that would break a dependency cannot happen: a forward
ends before anything that consumes it started in the played timeline, a backward starts after
its gradient arrived, so the order stays causal (the play checks it again: a deadlock discards
the round). `fill_bubbles` runs rounds while the simulated iteration time falls, per tolerance,
and returns the best schedule played, never a slower one than its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.cost.model import CostModel, MicrobatchWork
from loom.plan.plan import Plan, PlanError
from loom.schedule.ir import Action, ActionKind, Schedule
from loom.sim.play import CLIP, DeadlockError, Play
from loom.sim.work import PartWork, work_table

_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
_RECEIVES = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)
_EPS = 1e-12
# how far past a gap's end a block may run, as a share of its own time: 0 keeps the LLM's timing
# to first order; a little more lets a gap slightly too short for a whole block take it, delaying
# the LLM by less than the block would cost at the head or the tail; the play picks the better
OVERFLOWS = (0.0, 0.5)


@dataclass
class _Block:
    """One movable encoder block on a unit: its actions in order, ``forward`` or not, its
    compute time and its window: a forward's ``deadline`` (latest end), a backward's
    ``ready`` (its gradients' arrival)."""

    actions: list[Action]
    forward: bool
    duration: float
    deadline: float = float("inf")
    ready: float = 0.0
    key: tuple[int, int, int] = (0, 0, 0)  # (microbatch, encoder, chain position): the tie-break, a stable order
    chain: "_Block | None" = None  # the next chunk's block of the same microbatch and direction


@dataclass
class FillResult:
    """What `fill_bubbles` did: the ``schedule`` to run, the simulated iteration time of its
    input (``coarse_s``) and of the result (``filled_s``), the blocks it moved out of the head
    and the tail (``moved``) and the ``rounds`` it played."""

    schedule: Schedule
    coarse_s: float
    filled_s: float
    moved: int
    rounds: int
    history: list[float] = field(default_factory=list)  # iteration time after each round

    @property
    def gain(self) -> float:
        """Coarse over filled iteration time (1.0: nothing to gain)."""
        return self.coarse_s / self.filled_s if self.filled_s > 0 else 1.0


def _play(schedule: Schedule, plan: Plan, cost: CostModel, works: list[MicrobatchWork], part: PartWork) -> Play:
    return Play(schedule, plan, cost, works, part).run()


def _times(play: Play, u: int) -> list[tuple[float, float]]:
    """(start, end) of every action of unit ``u``, aligned with its list (the clip event is no action)."""
    return [(e.start_s, e.end_s) for e in play.events[u] if e.kind != CLIP]


def _message_key(u: int, a: Action) -> tuple:
    """The key both ends of a message share (`loom.sim.play`'s): direction, sender, receiver,
    both microbatches, both stages and the samples."""
    other = a.other_microbatch
    if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
        return (a.kind is ActionKind.SEND_GRAD, u, a.peer, a.microbatch, other, a.module, a.stage, a.peer_module,
                a.peer_stage, a.samples)
    return (a.kind is ActionKind.RECV_GRAD, a.peer, u, other, a.microbatch, a.peer_module, a.peer_stage, a.module,
            a.stage, a.samples)


def _local_chunk(u: int, a: Action) -> bool:
    """A message between two chunks of one encoder on unit ``u`` (a colocated encoder cut into
    chunks): its order, not a timing, links their blocks."""
    return a.peer == u and a.peer_module == a.module


def _blocks(u: int, acts: list[Action], own: str) -> tuple[list[int], list[list[int]]]:
    """Split a unit's list into its skeleton (indices of ``own`` module's actions and the
    per-iteration ones) and its encoder blocks (index runs, one per encoder chunk, microbatch
    and direction). A block's actions are contiguous in a colocated schedule, and a forward
    block receives only from the encoder's previous chunk on the unit; a run that is not so (a
    split backward's deferred part) is left in the skeleton."""
    skeleton: list[int] = []
    runs: dict[tuple[str, int, int, bool], list[int]] = {}
    for i, a in enumerate(acts):
        if a.module == own or a.microbatch < 0 or a.kind in (ActionKind.GRAD_SYNC, ActionKind.OPTIMIZER_STEP):
            skeleton.append(i)
            continue
        fwd = a.kind in (ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT)
        runs.setdefault((a.module, a.stage, a.microbatch, fwd), []).append(i)
    blocks = []
    for idx in runs.values():
        if idx[-1] - idx[0] + 1 == len(idx) and any(acts[i].kind in _COMPUTE for i in idx) \
                and all(_local_chunk(u, acts[i]) for i in idx if acts[i].kind is ActionKind.RECV_ACT):
            blocks.append(idx)
        else:
            skeleton.extend(idx)
    skeleton.sort()
    return skeleton, blocks


class _Timing:
    """What a round reads off the play: each action's (start, end) per unit, and for every
    receive its message's arrival and where its sender's message is received."""

    def __init__(self, schedule: Schedule, play: Play) -> None:
        self.times = {u: _times(play, u) for u in play.units}
        self.recv_at: dict[tuple, tuple[int, int]] = {}  # message key -> (receiving unit, action index)
        self.arrival: dict[tuple[int, int], float] = {}
        for u in play.units:
            n = 0
            for i, a in enumerate(schedule.actions[u]):
                if a.kind in _RECEIVES:
                    self.recv_at[_message_key(u, a)] = (u, i)
                    self.arrival[(u, i)] = play.arrivals[u][n]
                    n += 1


def _unit_blocks(u: int, acts: list[Action], runs: list[list[int]], timing: _Timing,
                 names: list[str]) -> list[_Block]:
    """The blocks of unit ``u`` with their durations and windows (module docstring). A chunk's
    forward must end before the next chunk's starts, a chunk's backward start after the next
    chunk's ends: their windows follow from that chunk's, along the chain."""
    t = timing.times[u]
    blocks: dict[tuple[str, int, int, bool], _Block] = {}
    for idx in runs:
        first = acts[idx[0]]
        comp = [i for i in idx if acts[i].kind in _COMPUTE]
        fwd = acts[comp[0]].kind is ActionKind.FORWARD
        b = _Block([acts[i] for i in idx], fwd, sum(t[i][1] - t[i][0] for i in comp),
                   key=(first.microbatch, names.index(first.module), first.stage if fwd else -first.stage))
        for i in idx:
            a = acts[i]
            if _local_chunk(u, a):
                continue
            if fwd and a.kind is ActionKind.SEND_ACT and _message_key(u, a) in timing.recv_at:
                # latest end: the consumer's receive start minus the message's transfer
                v, k = timing.recv_at[_message_key(u, a)]
                b.deadline = min(b.deadline, timing.times[v][k][0] - (timing.arrival[(v, k)] - t[i][0]))
            elif not fwd and a.kind is ActionKind.RECV_GRAD:  # earliest start: its gradient's arrival
                b.ready = max(b.ready, timing.arrival[(u, i)])
        blocks[(first.module, first.stage, first.microbatch, fwd)] = b
    for (m, s, j, fwd), b in sorted(blocks.items(), key=lambda kv: -kv[0][1]):  # from the last chunk down
        b.chain = nxt = blocks.get((m, s + 1, j, fwd))  # the block it must precede (forward) or follow (backward)
        if nxt is not None and fwd:
            b.deadline = min(b.deadline, nxt.deadline - nxt.duration)
        elif nxt is not None:
            b.ready = max(b.ready, nxt.ready + nxt.duration)
    return list(blocks.values())


def _fill_unit(u: int, acts: list[Action], own: str, timing: _Timing, names: list[str],
               overflow: float = 0.0) -> tuple[list[Action], int]:
    """Unit ``u``'s new list (module docstring) and how many of its blocks went into gaps."""
    skeleton, runs = _blocks(u, acts, own)
    if not runs:
        return list(acts), 0
    t = timing.times[u]
    blocks = _unit_blocks(u, acts, runs, timing, names)
    # the skeleton's compute actions and the gaps between consecutive ones
    comp = [i for i in skeleton if acts[i].kind in _COMPUTE]
    gaps = []  # (start, end, insertion position in the skeleton list)
    for a_i, b_i in zip(comp, comp[1:]):
        pos = skeleton.index(b_i)
        while pos > 0 and acts[skeleton[pos - 1]].kind in _RECEIVES:
            pos -= 1  # before the receives that feed the next compute action
        gaps.append((t[a_i][1], t[b_i][0], pos))
    used = [0.0] * len(gaps)  # forwards fill a gap from its start, backwards after them
    gap_of: dict[int, int | None] = {}  # id(block) -> its gap, None: the head or the tail
    placed: dict[int, list[tuple[float, _Block]]] = {}
    head, tail = [], []
    for b in sorted((b for b in blocks if b.forward), key=lambda b: (-b.deadline, *b.key[:2], -b.key[2])):
        # no later than the chunk it feeds (a later chunk's deadline is later: it went first)
        last = len(gaps) - 1 if b.chain is None else gap_of[id(b.chain)]
        for g in reversed(range(last + 1 if last is not None else 0)):
            start, end, pos = gaps[g]
            at = start + used[g]
            if at + b.duration <= min(end + overflow * b.duration, b.deadline) + _EPS:
                used[g] += b.duration
                placed.setdefault(pos, []).append((at, b))
                gap_of[id(b)] = g
                break
        else:
            head.append(b)
            gap_of[id(b)] = None
    for b in sorted((b for b in blocks if not b.forward), key=lambda b: (b.ready, b.key)):
        # no earlier than the chunk whose gradient it takes (its gradient arrives first: it went first)
        first = 0 if b.chain is None else gap_of[id(b.chain)]
        for g in range(first, len(gaps)) if first is not None else ():
            start, end, pos = gaps[g]
            at = max(start + used[g], b.ready)
            if at + b.duration <= end + overflow * b.duration + _EPS:
                used[g] = at + b.duration - start
                placed.setdefault(pos, []).append((at, b))
                gap_of[id(b)] = g
                break
        else:
            tail.append(b)
            gap_of[id(b)] = None
    head.sort(key=lambda b: (b.deadline, b.key))
    tail.sort(key=lambda b: (b.ready, b.key))
    new: list[Action] = [a for b in head for a in b.actions]
    end_pos = next((p for p, i in enumerate(skeleton)
                    if acts[i].kind in (ActionKind.GRAD_SYNC, ActionKind.OPTIMIZER_STEP)), len(skeleton))
    for p, i in enumerate(skeleton):
        # in a gap, forwards in chain order (they were placed last chunk first), backwards as placed
        for _, b in sorted(placed.get(p, ()), key=lambda x: (not x[1].forward, x[1].key if x[1].forward else x[0])):
            new.extend(b.actions)
        if p == end_pos:
            new.extend(a for b in tail for a in b.actions)
        new.append(acts[i])
    if end_pos == len(skeleton):
        new.extend(a for b in tail for a in b.actions)
    assert len(new) == len(acts), "bubble fill lost or duplicated an action"
    return new, sum(len(v) for v in placed.values())


def fill_round(schedule: Schedule, plan: Plan, play: Play, overflow: float = 0.0) -> tuple[Schedule, int]:
    """One round of the module docstring's filling on ``schedule``, played as ``play``: the
    new schedule and how many blocks now sit in gaps rather than at the head or the tail."""
    timing = _Timing(schedule, play)
    names = [m.name for m in plan.modules]
    out: dict[int, list[Action]] = {}
    moved = 0
    for u in play.units:
        out[u], n = _fill_unit(u, schedule.actions[u], plan.role_of_unit(u)[0], timing, names, overflow)
        moved += n
    return Schedule(schedule.kind, schedule.num_microbatches, out, dict(schedule.needs_backward)), moved


def fill_bubbles(schedule: Schedule, plan: Plan, cost: CostModel, work=None, sample_work=None,
                 rounds: int = 4, overflows: tuple[float, ...] = OVERFLOWS) -> FillResult:
    """Optimus's bubble filling (module docstring) of a colocated ``schedule`` under ``cost``,
    for microbatch workloads ``work`` (and ``sample_work`` for a balanced layout's parts, as
    `loom.sim.simulate` takes them): for each of ``overflows``, up to ``rounds`` rounds from
    the coarse schedule; the best schedule played."""
    if plan.placement != "colocated":
        raise PlanError(f"plan.bubble_fill = 'optimus' fills the bubbles of colocated encoders, but plan.placement = "
                        f"{plan.placement!r}: use placement = 'colocated' or bubble_fill = 'none'")
    works = work_table(work, schedule.num_microbatches)
    part = PartWork(sample_work, work is not None)
    first = _play(schedule, plan, cost, works, part)
    coarse_s = max(first.clock)
    best, best_s, history, moved, done = schedule, coarse_s, [], 0, 0
    for overflow in overflows:
        current, play, last = schedule, first, coarse_s
        for _ in range(rounds):
            nxt, n = fill_round(current, plan, play, overflow)
            done += 1
            try:
                play = _play(nxt, plan, cost, works, part)
            except DeadlockError:  # cannot happen by construction; never run what the play refuses
                break
            s = max(play.clock)
            history.append(s)
            if s < best_s - _EPS:
                best, best_s, moved = nxt, s, n
            if s >= last - _EPS:  # no better than the round before: this tolerance has converged
                break
            current, last = nxt, s
    return FillResult(best, coarse_s, best_s, moved, done, history)
