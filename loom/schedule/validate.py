"""The schedule validator (docs/architecture.md, "The schedule IR": "every forward has its backward, every
send its matching receive, no deadlock when run with unit costs").

`validate_schedule` checks an IR and raises `ScheduleError` naming the rank, the action and the
problem. `unit_cost_makespan` plays an IR with unit costs and returns its length; `render`
prints it as one line per rank.

Play semantics (those of `loom.schedule.ir`): a send completes at once and makes its message
available; a receive blocks until the matching send has been played; ``FORWARD``,
``BACKWARD`` and ZB-H1's ``BACKWARD_INPUT`` and ``BACKWARD_WEIGHT`` take one time unit each, communication and the optimizer step none; ``GRAD_SYNC`` is a
collective, so it completes only when every rank holding a ``GRAD_SYNC`` of the same stage
(its data-parallel group) has reached it.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from loom.plan.plan import Plan
from loom.schedule.generators import pipeline_edges, pipeline_stages
from loom.schedule.ir import BACKWARDS, COMMUNICATION, MATCHING, Action, ActionKind, Schedule, stage_key

SENDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
COMPUTE = (ActionKind.FORWARD, *BACKWARDS)
BI, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
PER_ITERATION = (ActionKind.GRAD_SYNC, ActionKind.OPTIMIZER_STEP)


class ScheduleError(ValueError):
    """A malformed schedule IR; the message names the rank, the action and the problem."""


def _fail(rank: int, action: Action | None, problem: str) -> ScheduleError:
    where = f"rank {rank}" + (f": {action.short()}" if action is not None else "")
    return ScheduleError(f"{where}: {problem}")


# ---- messages ----------------------------------------------------------------------------
def _message_key(rank: int, a: Action) -> tuple:
    """The identity of the message a communication action sends or receives, the same on
    both ends: (send kind, sender, receiver, sender's microbatch, receiver's microbatch, sender
    stage, receiver stage, samples)."""
    here, there = (a.module, a.stage), (a.peer_module, a.peer_stage)
    if a.kind in SENDS:
        return (a.kind, rank, a.peer, a.microbatch, a.other_microbatch, here, there, a.samples)
    return (MATCHING[a.kind], a.peer, rank, a.other_microbatch, a.microbatch, there, here, a.samples)


def _counterpart(rank: int, a: Action) -> Action:
    """The action the peer must hold to match ``a``."""
    return Action(MATCHING[a.kind], a.peer_module, a.peer_stage, a.other_microbatch, rank, a.module, a.stage,
                  samples=a.samples, peer_microbatch=a.peer_microbatch if a.peer_microbatch is None else a.microbatch)


# ---- validation --------------------------------------------------------------------------
def validate_schedule(schedule: Schedule, plan: Plan | None = None) -> None:
    """Prove ``schedule`` well formed or raise `ScheduleError`.

    Checks, in order:

    1. with a ``plan``: the world size, each rank runs only its own ``(module, stage)`` and the
       microbatches of its replica, every communication peer holds the stage it is named with
       and that stage is a graph neighbour on the correct side, and every microbatch is
       forwarded at every stage;
    2. every action is well formed: communication names a peer (another rank of the schedule),
       ``peer_module`` and ``peer_stage``; microbatches lie in ``0..M-1`` (``-1`` for grad sync
       and optimizer step);
    3. every send matches exactly one receive on its peer and vice versa (same kind pair,
       microbatch and stages, each naming the other as peer);
    4. every ``FORWARD`` of ``(m, s, j)`` appears once in the schedule; where the stage needs a
       backward (``schedule.needs_backward``, a missing key meaning yes) exactly one
       ``BACKWARD`` (or the parts of a split one), or one ``BACKWARD_INPUT`` and then one
       ``BACKWARD_WEIGHT`` (ZB-H1), follows it on the same rank, elsewhere none; each receive
       precedes and each send follows the compute it feeds or comes from, on the rank that runs
       it (a gradient: the input pass, which sends it); grad sync and optimizer step come once,
       after the rank's backwards and weight passes, step after sync; a stage that splits its
       backward ends its backward work with a weight pass (where ZeRO 2/3 reduce-scatter); and
       a stage's replicas either all sync or none does;
    5. a handoff between two stages of one rank (an encoder on the LLM's ranks: ``first_stage``,
       ``colocated``) is sent before it is received there: the encoder's forward of microbatch
       ``i`` before the LLM's (optimus.md §3.6, ``EF_i <= F_i``), its backward after the LLM's
       (``EB_i >= B_i``), each violation named with its microbatch;
    6. playing all ranks with unit costs finishes (no deadlock).
    """
    if plan is not None:
        _check_against_plan(schedule, plan)
    _check_actions(schedule)
    _check_matching(schedule)
    _check_compute(schedule)
    _check_handoffs(schedule)
    _play(schedule)


def _check_handoffs(schedule: Schedule) -> None:
    """Local handoffs (the rank its own peer) in order: a rank blocks in a receive whose send
    comes later in its own list, a deadlock named here by the dependency it breaks."""
    for rank, acts in schedule.actions.items():
        sent: dict[tuple, int] = {}
        for i, a in enumerate(acts):
            if a.kind in COMMUNICATION and a.peer == rank and a.kind in SENDS:
                sent[_message_key(rank, a)] = i
        for i, a in enumerate(acts):
            if a.kind not in COMMUNICATION or a.peer != rank or a.kind in SENDS:
                continue
            if sent.get(_message_key(rank, a), len(acts)) > i:
                if a.kind is ActionKind.RECV_ACT:
                    problem = (f"microbatch {a.other_microbatch}: the LLM's forward needs {a.peer_module}'s output before "
                               f"{a.peer_module} forwards it on this rank (optimus.md §3.6: EF_i <= F_i)")
                else:
                    problem = (f"microbatch {a.microbatch}: {a.module}'s backward needs the gradient the LLM's backward "
                               f"sends, which comes later on this rank (optimus.md §3.6: EB_i >= B_i)")
                raise _fail(rank, a, problem)


def _check_actions(schedule: Schedule) -> None:
    m_count = schedule.num_microbatches
    for rank, acts in schedule.actions.items():
        for a in acts:
            if not isinstance(a.kind, ActionKind):
                raise _fail(rank, None, f"action {a!r} has an unknown kind")
            if a.kind in COMMUNICATION:
                if a.peer is None or a.peer_module is None or a.peer_stage is None:
                    raise _fail(rank, a, "communication without peer, peer_module and peer_stage")
                if a.peer == rank and (a.peer_module, a.peer_stage) == (a.module, a.stage):
                    raise _fail(rank, a, "communication with itself")  # between two stages it hosts: a local handoff
                if a.peer not in schedule.actions:
                    raise _fail(rank, a, f"peer rank {a.peer} is not in the schedule (ranks {sorted(schedule.actions)})")
            if a.kind in PER_ITERATION:
                if a.microbatch != -1:
                    raise _fail(rank, a, "grad sync and optimizer step are per iteration: microbatch must be -1")
            elif not 0 <= a.microbatch < m_count:
                raise _fail(rank, a, f"microbatch {a.microbatch} outside 0..{m_count - 1}")


def _check_matching(schedule: Schedule) -> None:
    sends: dict[tuple, list[tuple[int, Action]]] = defaultdict(list)
    recvs: dict[tuple, list[tuple[int, Action]]] = defaultdict(list)
    for rank, acts in schedule.actions.items():
        for a in acts:
            if a.kind in COMMUNICATION:
                (sends if a.kind in SENDS else recvs)[_message_key(rank, a)].append((rank, a))
    for table, other in ((sends, recvs), (recvs, sends)):
        for key, found in table.items():
            rank, a = found[0]
            if len(found) > 1:
                raise _fail(rank, a, f"duplicated: the same message appears {len(found)} times")
            if key not in other:
                raise _fail(rank, a, f"unmatched: rank {a.peer} has no matching {_counterpart(rank, a).short()}")


def _check_compute(schedule: Schedule) -> None:
    # (module, stage, microbatch) -> [(rank, index)] for forwards and backwards
    forwards: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    backwards: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # every backward kind
    for rank, acts in schedule.actions.items():
        for i, a in enumerate(acts):
            if a.kind is ActionKind.FORWARD:
                forwards[(a.module, a.stage, a.microbatch)].append((rank, i))
            elif a.kind in BACKWARDS:
                backwards[(a.module, a.stage, a.microbatch)].append((rank, i))

    def at(rank_index: tuple[int, int]) -> Action:
        return schedule.actions[rank_index[0]][rank_index[1]]

    for key, found in forwards.items():
        if len(found) > 1:
            ranks = sorted(r for r, _ in found)
            raise _fail(found[1][0], at(found[1]), f"forward duplicated: it appears {len(found)} times (ranks {ranks})")
        rank, i = found[0]
        needs = schedule.needs_backward.get(stage_key(key[0], key[1]), True)
        got = backwards.get(key, [])
        if needs and not got:
            raise _fail(rank, at(found[0]), "missing backward: the stage needs a backward for every forward")
        if not needs and got:
            raise _fail(got[0][0], at(got[0]), "backward for a stage without backward (needs_backward is false)")
        kinds = [at(g).kind for g in got]
        if BI in kinds or W in kinds:
            # ZB-H1 (zero-bubble §3.1): one input pass, then one weight pass of the same microbatch
            if sorted(kinds) != sorted([BI, W]) or any(at(g).samples is not None for g in got):
                raise _fail(got[0][0], at(got[0]), f"a split backward is one backward_input then one backward_weight "
                                                   f"of the whole microbatch; found {[at(g).short() for g in got]}")
            if kinds.index(BI) > kinds.index(W):
                raise _fail(got[0][0], at(got[kinds.index(W)]), "weight pass before its input pass")
        elif len(got) > 1 and any(at(g).samples is None for g in got):
            # several backwards of one microbatch are the parts of a split backward, each
            # naming its samples (entrain.md §3.6); an unnamed one would repeat the whole
            raise _fail(got[1][0], at(got[1]), f"backward duplicated: it appears {len(got)} times")
        parts = [s for g in got for s in (at(g).samples or ())]
        if len(parts) != len(set(parts)):
            raise _fail(got[0][0], at(got[0]), f"split backward parts overlap: {[at(g).samples for g in got]}")
        for b_rank, b_i in got:
            if b_rank != rank:
                raise _fail(b_rank, at((b_rank, b_i)), f"backward on another rank than its forward (rank {rank})")
            if b_i < i:
                raise _fail(b_rank, at((b_rank, b_i)), f"backward precedes its forward (position {b_i} < {i})")
    for key, got in backwards.items():
        if key not in forwards:
            raise _fail(got[0][0], at(got[0]), "backward without a forward")

    # Local data dependencies: a receive feeds the compute on its rank, a send ships its result.
    # With a split backward the position is the last part's: a gradient may arrive between parts,
    # and the input gradient leaves after the last one.
    for rank, acts in schedule.actions.items():
        # a ZB-H1 input pass stands for the backward: it consumes the gradient and produces the
        # one sent on (the weight pass communicates nothing)
        position = {(ActionKind.BACKWARD if a.kind is BI else a.kind, a.module, a.stage, a.microbatch): i
                    for i, a in enumerate(acts) if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD, BI)}
        backwards_seen: dict[tuple[str, int], int] = {}
        last_kind: dict[tuple[str, int], ActionKind] = {}
        for i, a in enumerate(acts):
            if a.kind in COMMUNICATION:
                compute = ActionKind.FORWARD if a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_ACT) else ActionKind.BACKWARD
                j = position.get((compute, a.module, a.stage, a.microbatch))
                name = "forward" if compute is ActionKind.FORWARD else "backward"
                if j is None:
                    raise _fail(rank, a, f"this rank does not run the {name} of {a.module}.{a.stage} mb{a.microbatch}")
                receive = a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)
                if receive and i > j:
                    raise _fail(rank, a, f"receive after the {name} that needs it (position {i} > {j})")
                if not receive and i < j:
                    raise _fail(rank, a, f"send before the {name} that produces it (position {i} < {j})")
            elif a.kind in BACKWARDS:
                backwards_seen[(a.module, a.stage)] = i
                last_kind[(a.module, a.stage)] = a.kind
        for st, kind in last_kind.items():
            if kind is BI:  # a W follows each BI, so this is only reached by a malformed list
                i = backwards_seen[st]
                raise _fail(rank, acts[i], "the stage's last backward work is an input pass: it must be a weight "
                                           "pass (ZeRO 2/3 reduce-scatter the gradients after it)")

        synced: dict[tuple[str, int], int] = {}
        stepped: set[tuple[str, int]] = set()
        for i, a in enumerate(acts):
            st = (a.module, a.stage)
            if a.kind not in PER_ITERATION:
                continue
            last_backward = backwards_seen.get(st, -1)
            if i < last_backward:
                raise _fail(rank, a, f"before the rank's last backward of {a.module}.{a.stage} (position {last_backward})")
            if a.kind is ActionKind.GRAD_SYNC:
                if st in synced:
                    raise _fail(rank, a, "grad sync duplicated")
                if st in stepped:
                    raise _fail(rank, a, "grad sync after the optimizer step")
                synced[st] = i
            else:
                if st in stepped:
                    raise _fail(rank, a, "optimizer step duplicated")
                stepped.add(st)

    # A gradient all-reduce needs every replica of the stage: all of them sync or none.
    runs: dict[tuple[str, int], set[int]] = defaultdict(set)
    syncs: dict[tuple[str, int], set[int]] = defaultdict(set)
    for (m, s, _), found in forwards.items():
        runs[(m, s)].update(r for r, _ in found)
    for rank, acts in schedule.actions.items():
        for a in acts:
            if a.kind is ActionKind.GRAD_SYNC:
                syncs[(a.module, a.stage)].add(rank)
    for st, ranks in syncs.items():
        missing = runs.get(st, set()) - ranks
        if missing:
            r = min(ranks)
            a = next(x for x in schedule.actions[r] if x.kind is ActionKind.GRAD_SYNC and (x.module, x.stage) == st)
            raise _fail(r, a, f"ranks {sorted(missing)} also run {st[0]}.{st[1]} but have no grad sync")


def _check_against_plan(schedule: Schedule, plan: Plan) -> None:
    if sorted(schedule.actions) != list(range(plan.num_units)):
        raise ScheduleError(
            f"the schedule has ranks {sorted(schedule.actions)} but the plan needs pipeline units 0..{plan.num_units - 1}"
        )
    if schedule.num_microbatches != plan.num_microbatches:
        raise ScheduleError(
            f"the schedule has {schedule.num_microbatches} microbatches, the plan {plan.num_microbatches}"
        )
    edges = set(pipeline_edges(plan))
    forwarded: dict[tuple[str, int], set[int]] = defaultdict(set)
    for rank, acts in schedule.actions.items():
        hosted = {(m_, s_): r_ for m_, s_, r_ in plan.stages_of_unit(rank)}  # each with its replica
        for a in acts:
            m, s = a.module, a.stage
            if (a.module, a.stage) not in hosted:
                names = ", ".join(f"{x}.{y} (replica {r_})" for (x, y), r_ in sorted(hosted.items()))
                raise _fail(rank, a, f"the plan places {names} on this rank, not {a.module}.{a.stage}")
            replica = hosted[(m, s)]
            if a.microbatch >= 0 and plan.replica_of_microbatch(m, a.microbatch) != replica:
                raise _fail(rank, a, f"microbatch {a.microbatch} belongs to replica "
                                     f"{plan.replica_of_microbatch(m, a.microbatch)} of {m}, this rank is replica {replica}")
            if a.kind is ActionKind.FORWARD:
                forwarded[(m, s)].add(a.microbatch)
            if a.kind in COMMUNICATION and a.peer is not None:
                if not 0 <= a.peer < plan.num_units:
                    raise _fail(rank, a, f"peer {a.peer} outside the plan's {plan.num_units} pipeline units")
                peer_hosts = {(x, y) for x, y, _ in plan.stages_of_unit(a.peer)}
                if (a.peer_module, a.peer_stage) not in peer_hosts:
                    names = ", ".join(f"{x}.{y}" for x, y in sorted(peer_hosts))
                    raise _fail(rank, a, f"peer rank {a.peer} runs {names}, not {a.peer_module}.{a.peer_stage}")
                pm, ps = a.peer_module, a.peer_stage
                # Activations go downstream, gradients upstream, always along a graph edge.
                downstream = a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD)
                edge = ((m, s), (pm, ps)) if downstream else ((pm, ps), (m, s))
                if edge not in edges:
                    raise _fail(rank, a, f"{edge[0][0]}.{edge[0][1]} -> {edge[1][0]}.{edge[1][1]} is not an edge of the plan's pipeline graph")
    for m, s in pipeline_stages(plan):
        missing = sorted(set(range(plan.num_microbatches)) - forwarded[(m, s)])
        if missing:
            raise ScheduleError(f"stage {m}.{s}: microbatches {missing} are never forwarded")


# ---- unit-cost play ----------------------------------------------------------------------
def _play(schedule: Schedule) -> dict[int, int]:
    """Play every rank with unit costs; return each rank's finish time or raise
    `ScheduleError` on deadlock (see the module docstring for the semantics)."""
    acts = schedule.actions
    pointer = {r: 0 for r in acts}
    clock = {r: 0 for r in acts}
    posted: Counter = Counter()  # message key -> number of sends played
    available_at: dict[tuple, int] = {}  # message key -> time of its (latest) send
    sync_group: dict[tuple[str, int], set[int]] = defaultdict(set)
    for r, lst in acts.items():
        for a in lst:
            if a.kind is ActionKind.GRAD_SYNC:
                sync_group[(a.module, a.stage)].add(r)
    arrived: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)

    def done() -> bool:
        return all(pointer[r] == len(acts[r]) for r in acts)

    while not done():
        progress = False
        for r, lst in acts.items():
            while pointer[r] < len(lst):
                a = lst[pointer[r]]
                if a.kind in COMPUTE:
                    clock[r] += 1
                elif a.kind in SENDS:
                    key = _message_key(r, a)
                    posted[key] += 1
                    available_at[key] = clock[r]
                elif a.kind in COMMUNICATION:  # a receive
                    key = _message_key(r, a)
                    if posted[key] == 0:
                        break
                    posted[key] -= 1
                    clock[r] = max(clock[r], available_at[key])
                elif a.kind is ActionKind.GRAD_SYNC:
                    st = (a.module, a.stage)
                    arrived[st][r] = clock[r]
                    if set(arrived[st]) != sync_group[st]:
                        break  # wait for the rest of the data-parallel group
                    finish = max(arrived[st].values())
                    for q in arrived[st]:  # release the whole group
                        clock[q] = finish
                        if q != r:
                            pointer[q] += 1
                    arrived[st] = {}
                pointer[r] += 1
                progress = True
        if not progress:
            stuck = [
                f"rank {r} waits at {acts[r][pointer[r]].short()} (action {pointer[r]} of {len(acts[r])})"
                for r in acts if pointer[r] < len(acts[r])
            ]
            raise ScheduleError("deadlock under unit costs: " + "; ".join(stuck))
    return clock


def unit_cost_makespan(schedule: Schedule) -> int:
    """Time steps of the unit-cost play: every forward and backward action (a ZB-H1 input or
    weight pass too) costs 1, everything else 0.
    For an S-stage chain with M microbatches, GPipe and 1F1B both take ``2 * (M + S - 1)``.
    Raises `ScheduleError` if the play deadlocks."""
    finish = _play(schedule)
    return max(finish.values(), default=0)


def render(schedule: Schedule, communication: bool = True) -> str:
    """A compact text table: a header, then one line per rank listing ``Action.short()`` of its
    actions in order (``communication=False`` keeps only the compute and per-iteration ones,
    which shows the pipeline shape at a glance)."""
    lines = [f"{schedule.kind}: {schedule.num_microbatches} microbatches, {schedule.world_size} ranks"]
    width = len(f"r{max(schedule.actions, default=0)}")
    for r in sorted(schedule.actions):
        items = [a.short() for a in schedule.actions[r] if communication or a.kind not in COMMUNICATION]
        lines.append(f"r{r}".ljust(width) + ": " + " | ".join(items))
    return "\n".join(lines)
