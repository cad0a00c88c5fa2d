"""Schedule generators: GPipe, (multimodal) 1F1B and ZB-H1 over a plan's stage graph.

The pipeline graph comes from a resolved `Plan`. Its nodes are stages ``(module, stage)``;
its edges run inside each module from stage ``s`` to ``s + 1``, from every encoder's last
stage to the LLM's first stage (Cornstarch modality parallelism, ``cornstarch.md`` §3.1: the
encoders are independent pipelines running in parallel on their own ranks, and the LLM's first
stage is the only node with several incoming edges), and from the LLM's last stage to every
generator's first stage (DistTrain's encoder -> LLM -> generator, disttrain.md §1: the LLM's
last stage sends each generator its states and gets their gradients back). With no encoders
and no generators this is a plain chain, so one generator handles all.

Microbatch ``j`` runs on replica ``plan.replica_of_microbatch(m, j)`` of every stage of module
``m``, so the peer of an edge is chosen per microbatch; modules may have different
data-parallel degrees (docs/architecture.md, "Placement": edges route microbatches explicitly).

Backward work is frozen-aware (``cornstarch.md`` §3.2.1): a stage with nothing trainable in or
upstream of it runs no backward and receives no gradient; see `backward_flow`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from loom.plan.plan import LLM, Plan, PlanError
from loom.schedule.ir import Action, ActionKind, Schedule, stage_key

if TYPE_CHECKING:  # the layout is data from loom.balance; only its routes are read here
    from loom.schedule.layout import BatchLayout

Stage = tuple[str, int]
Edge = tuple[Stage, Stage]

KINDS = ("gpipe", "1f1b", "zb-h1")


# ---- the stage graph ---------------------------------------------------------------------
def _check_graph(plan: Plan) -> None:
    names = plan.module_names
    if LLM not in names:
        raise PlanError(
            f"plan.modules has no {LLM!r} module: list the encoders, then {LLM!r}, then any generators, in graph "
            f"order; got {names}"
        )
    for spec in plan.modules:
        if spec.num_stages < 1:
            raise PlanError(f"plan.modules[{spec.name!r}].num_stages = {spec.num_stages}: must be at least 1")


def pipeline_stages(plan: Plan) -> list[Stage]:
    """All stages in plan order (encoders, the LLM, generators), stages increasing inside a
    module.

    This is a topological order of the stage graph: every edge goes from an earlier entry to a
    later one."""
    _check_graph(plan)
    return [(spec.name, s) for spec in plan.modules for s in range(spec.num_stages)]


def pipeline_edges(plan: Plan) -> list[Edge]:
    """The forward edges ``(src, dst)`` of the stage graph: inside each module ``(m, s) ->
    (m, s + 1)``; each encoder's last stage -> ``("llm", 0)``, encoders in plan order (the order
    in which the LLM's first stage receives them, cornstarch.md §3.1); the LLM's last stage ->
    each generator's first stage, generators in plan order."""
    edges: list[Edge] = []
    encoders, generators = set(plan.encoder_names), plan.generator_names
    for m, s in pipeline_stages(plan):
        spec = plan.spec(m)
        if s + 1 < spec.num_stages:
            edges.append(((m, s), (m, s + 1)))
        elif m in encoders:
            edges.append(((m, s), (LLM, 0)))
        elif m == LLM:
            edges.extend(((m, s), (g, 0)) for g in generators)
    return edges


def _neighbours(plan: Plan) -> tuple[dict[Stage, list[Stage]], dict[Stage, list[Stage]]]:
    """``(predecessors, successors)`` of every stage, in edge order."""
    preds: dict[Stage, list[Stage]] = {st: [] for st in pipeline_stages(plan)}
    succs: dict[Stage, list[Stage]] = {st: [] for st in preds}
    for src, dst in pipeline_edges(plan):
        succs[src].append(dst)
        preds[dst].append(src)
    return preds, succs


def _trainable_map(plan: Plan, trainable: dict[Stage, bool] | None) -> dict[Stage, bool]:
    """Every stage's trainable flag; a stage missing from ``trainable`` counts as trainable
    (the default of an unfrozen model), a key naming no stage of the plan is an error."""
    stages = pipeline_stages(plan)
    if trainable is None:
        return {st: True for st in stages}
    unknown = [k for k in trainable if k not in set(stages)]
    if unknown:
        raise ValueError(f"trainable names stages {unknown} that the plan does not have; its stages are {stages}")
    return {st: bool(trainable.get(st, True)) for st in stages}


# ---- frozen-aware backward ---------------------------------------------------------------
def backward_flow(
    plan: Plan, trainable: dict[Stage, bool] | None = None
) -> tuple[dict[Stage, bool], set[Edge]]:
    """Which stages run a backward and which edges carry a gradient (cornstarch.md §3.2.1).

    ``trainable[(m, s)]`` says whether stage ``(m, s)`` holds trainable parameters (``None``:
    every stage does). Following the paper's rule (backward cost 0 if "frozen and no trainable
    module prior to this module"), and the dissertation's ``p(L)`` propagation (§3.2.2, eq. 3.3):

    - a stage *wants gradient* if it or anything upstream of it is trainable;
    - an edge ``src -> dst`` carries a gradient iff ``src`` wants gradient (someone at or
      before ``src`` has parameters whose gradient flows through that activation);
    - a stage needs a backward iff it is trainable (weight gradients) or one of its incoming
      edges carries a gradient (it must produce that input gradient).

    Returns ``(needs_backward, gradient_edges)``: ``needs_backward`` maps every stage to a bool,
    ``gradient_edges`` is the set of gradient-carrying ``(src, dst)`` edges.

    Example: a frozen vision encoder whose last stage holds a trainable projector, and a frozen
    LLM: the vision encoder's last stage and every LLM stage (input gradient only) need a
    backward, the earlier vision stages do not, and the edge vision -> llm carries a gradient.
    """
    train = _trainable_map(plan, trainable)
    preds, _ = _neighbours(plan)
    wants: dict[Stage, bool] = {}
    for st in pipeline_stages(plan):  # topological order: predecessors are already decided
        wants[st] = train[st] or any(wants[p] for p in preds[st])
    gradient_edges = {(src, dst) for src, dst in pipeline_edges(plan) if wants[src]}
    needs_backward = {
        st: train[st] or any((p, st) in gradient_edges for p in preds[st]) for st in wants
    }
    return needs_backward, gradient_edges


# ---- schedules ---------------------------------------------------------------------------
def _check_resolved(plan: Plan) -> None:
    _check_graph(plan)
    if plan.num_microbatches < 1:
        raise PlanError(f"plan.num_microbatches = {plan.num_microbatches}: must be at least 1")
    for spec in plan.modules:
        where = f"plan.modules[{spec.name!r}]"
        if spec.stage_boundaries is None:
            raise PlanError(f"{where}.stage_boundaries is unresolved; call Plan.resolve(layer_counts) first")
        if spec.data_parallel < 1:
            raise PlanError(f"{where}.data_parallel = {spec.data_parallel}: must be at least 1")
        if spec.data_parallel // plan.lanes(spec.name) > plan.num_microbatches:  # lanes share a unit's microbatches
            raise PlanError(
                f"{where}.data_parallel = {spec.data_parallel} exceeds plan.num_microbatches = "
                f"{plan.num_microbatches}: every replica needs at least one microbatch"
            )


def warmup_count(plan: Plan, stage: Stage) -> int:
    """Forwards a 1F1B rank runs before its first backward, minus one (cornstarch.md §3.1):
    ``P_llm - s - 1`` for LLM stage ``s``, ``P_m + P_llm - s - 1`` for stage ``s`` of encoder
    ``m`` (``P`` counts stages). An encoder's warmup is longer because its microbatches must
    also travel the whole LLM pipeline before their gradients come back. Generators extend the
    path the same way: the LLM's stages add the deepest generator's ``P_g``, a generator's stage
    ``s`` waits ``P_g - s - 1``."""
    m, s = stage
    p_llm = plan.spec(LLM).num_stages
    p_gen = max((plan.spec(g).num_stages for g in plan.generator_names), default=0)
    if m in plan.generator_names:
        return plan.spec(m).num_stages - s - 1
    if m == LLM:
        return p_gen + p_llm - s - 1
    return plan.spec(m).num_stages + p_gen + p_llm - s - 1


def warmup_lookahead(plan: Plan, kind: str, route_slack: int = 0, eager: int = 0,
                     given: dict[Stage, float] | None = None) -> dict[Stage, float]:
    """Per stage, how far ahead (in *global* microbatch indices) a rank forwards before each
    backward: before ``B(a)`` it runs every forward of its own microbatches ``j <= a + D``.

    GPipe forwards everything first (``D`` infinite). For 1F1B, ``D = warmup * dp`` gives
    exactly Cornstarch's warmup of ``warmup`` own microbatches, since a replica's microbatches
    are ``dp`` apart. Across an edge ``src -> dst`` the sender must look at least as far ahead
    as the receiver (``D_src >= D_dst``): otherwise ``dst`` may wait for the activation of a
    microbatch that ``src`` only forwards after a backward whose gradient ``dst`` has not yet
    sent, a deadlock. With equal data-parallel degrees Cornstarch's formula already satisfies
    this; when a downstream module has more replicas we raise the sender's lookahead (it then
    holds more microbatches in flight than the formula, which is the price of the routing).

    ``route_slack``: a balanced layout lets LLM microbatch ``k`` take samples from any encoder
    microbatch of its round of ``R`` slots, and an encoder microbatch's gradients come from any
    LLM microbatch of that round; the encoder then forwards ``2 (R - 1)`` further ahead so the
    LLM never waits for a forward that waits for a backward of the same round.

    ``eager``: encoder stages forward that many more of their own microbatches before their
    first backward (Entrain's eager forward execution, entrain.md §3.6: the deferred backward
    parts then find free slots mid-iteration), at the price of as many more activations held.

    Replicas in lockstep: under ZeRO 2/3 (FSDP2, `loom.runtime.zero`) every forward and
    backward of a replica issues collectives that pair with the other replicas' actions of
    the same position, so replica ``r``'s ``i``-th backward cannot finish before every
    replica's ``i``-th has started, after their forwards ``j <= i dp + r' + D``. A sender
    feeding several replicas of such a module (fewer replicas than it) must therefore forward
    ``dp - 1`` further ahead than the receiver, or one replica's forward waits for the sender,
    which waits for the gradient of a backward that waits for that replica.

    ``given``: stages whose lookahead their own order fixes (interleaved positions,
    `interleaved_order`); their senders still look at least as far ahead.
    """
    stages = pipeline_stages(plan)
    if kind == "gpipe":
        return {st: math.inf for st in stages}
    # zb-h1 keeps 1F1B's warmup (and so its activations in flight, zero-bubble §3.1)
    _, succs = _neighbours(plan)
    lookahead: dict[Stage, float] = {}
    for st in reversed(stages):  # successors first
        if given and st in given:
            lookahead[st] = given[st]
            continue
        d = (warmup_count(plan, st) + (eager if st[0] in plan.encoder_names else 0)) * plan.spec(st[0]).data_parallel
        lookahead[st] = max([d] + [lookahead[dst] + (route_slack if st[0] != dst[0] else 0) + _lockstep_slack(plan, st, dst)
                                   for dst in succs[st]])
    return lookahead


def _lockstep_slack(plan: Plan, src: Stage, dst: Stage) -> int:
    """How much further ahead ``src`` forwards because ``dst``'s replicas run in lockstep
    (`warmup_lookahead`): ``dp - 1`` when ``dst``'s module pairs its replicas' actions (ZeRO
    2/3) and ``src`` feeds several of them."""
    spec, feeder = plan.spec(dst[0]), plan.spec(src[0])
    if spec.zero_stage >= 2 and feeder.data_parallel < spec.data_parallel:
        return spec.data_parallel - 1
    return 0


def _compute_order(microbatches: list[int], lookahead: float | None) -> list[tuple[ActionKind, int]]:
    """Order one rank's forwards and backwards. ``lookahead`` ``None``: no backward at all.

    Backwards run in increasing microbatch order (for GPipe too: any order is valid, and
    increasing keeps gradients flowing in the same order as activations); before the backward
    of ``a`` the rank forwards every microbatch ``j <= a + lookahead``. For 1F1B this yields
    warmup forwards, then one forward / one backward, then the cooldown backwards."""
    if lookahead is None:
        return [(ActionKind.FORWARD, j) for j in microbatches]
    order: list[tuple[ActionKind, int]] = []
    next_forward = 0
    for a in microbatches:
        while next_forward < len(microbatches) and microbatches[next_forward] <= a + lookahead:
            order.append((ActionKind.FORWARD, microbatches[next_forward]))
            next_forward += 1
        order.append((ActionKind.BACKWARD, a))
    return order


def _weight_slots(order: list[tuple[ActionKind, int]], lag: int) -> dict[int, list[int]]:
    """ZB-H1's placement of one rank's weight-gradient actions (zero-bubble, Qi et al., §3.1
    "ZB-H1"): own backward ``a`` -> the weight passes to run right after the input pass ``B(a)``.

    The weight pass of the rank's ``i``-th backward runs after the input pass of its
    ``i + lag``-th, the last ones at the end of its backward work (before ``GRAD_SYNC``);
    ``lag`` is the stage's position on the pipeline graph's longest path (0 for the first
    stage, ``s`` for stage ``s`` of a chain). A stage holds ``warmup + 1`` microbatches between
    forward and input pass under 1F1B, and ``lag`` more until their weight passes:
    ``warmup + 1 + lag`` is the path's depth, the first stage's 1F1B peak, so no rank holds
    more than 1F1B's deepest one (the paper's "same peak memory as 1F1B"). Meanwhile each
    input gradient leaves without waiting for weight work, so the gradients climb the pipeline
    at the pace of the input passes, and the deferred weight passes fill the waits that 1F1B
    has downstream at the start of its steady phase and upstream in its cooldown."""
    backwards = [j for k, j in order if k is ActionKind.BACKWARD]
    slots: dict[int, list[int]] = {a: [] for a in backwards}
    for i, a in enumerate(backwards):
        slots[backwards[min(i + lag, len(backwards) - 1)]].append(a)
    return slots


def interleaved_order(plan: Plan, hosted: list[Stage], microbatches: list[int], kind: str,
                      needs_backward: dict[Stage, bool]) -> list[tuple[Stage, ActionKind, int]]:
    """One pipeline position's forwards and backwards over its ``virtual_stages`` chunks,
    Megatron's interleaved 1F1B (optimus.md §3.11): the position's microbatches go in rounds
    of ``pipeline_depth``; forwards run each round through chunk 0, then chunk 1, ...,
    backwards through the chunks in reverse. The warmup is ``(P - p - 1) * 2 + (V - 1) * P``
    forwards on position ``p`` of ``P`` (GPipe: all of them), then one forward and one backward
    alternate, then the remaining backwards drain. Stages with no backward (frozen-aware) are
    left out of the backward sequence."""
    pp = plan.spec(hosted[0][0]).pipeline_depth
    position = hosted[0][1] % pp
    rounds = [microbatches[i:i + pp] for i in range(0, len(microbatches), pp)]
    forwards = [(st, ActionKind.FORWARD, j) for group in rounds for st in hosted for j in group]
    backwards = [(st, ActionKind.BACKWARD, j) for group in rounds for st in reversed(hosted) for j in group
                 if needs_backward[st]]
    warmup = len(forwards) if kind == "gpipe" else min(len(forwards), (pp - position - 1) * 2 + (len(hosted) - 1) * pp)
    order = forwards[:warmup]
    for i, f in enumerate(forwards[warmup:]):
        order.append(f)
        if i < len(backwards):
            order.append(backwards[i])
    return order + backwards[max(0, len(forwards) - warmup):]


def _with_guests(order: list[tuple[Stage, ActionKind, int]], guests: list[Stage],
                 needs_backward: dict[Stage, bool]) -> list[tuple[Stage, ActionKind, int]]:
    """The LLM's first position with its hosted encoders (``first_stage``, Megatron-LM's
    layout): each encoder forwards microbatch ``j`` right before the LLM's first stage does,
    and runs its backward of ``j`` right after the LLM's (whose input gradient it needs)."""
    out: list[tuple[Stage, ActionKind, int]] = []
    for st, k, j in order:
        first = st == (LLM, 0)
        if first and k is ActionKind.FORWARD:
            out.extend((g, ActionKind.FORWARD, j) for g in guests)
        out.append((st, k, j))
        if first and k is ActionKind.BACKWARD:
            out.extend((g, ActionKind.BACKWARD, j) for g in guests if needs_backward[g])
    return out


def _around(order: list[tuple[Stage, ActionKind, int]], guests: list[Stage], microbatches: list[int],
            needs_backward: dict[Stage, bool]) -> list[tuple[Stage, ActionKind, int]]:
    """A unit's LLM order with its own replica of each encoder around it (``colocated``): the
    encoder forwards first, as early as possible, the backwards after the unit's last LLM work,
    when their gradients have come back (Optimus's coarse schedule, optimus.md §3.4 steps 1 and
    3, without its shift and fine packing). Nothing waits on an encoder backward, and the
    encoder forwards wait on nothing, so the units cannot deadlock; the price is every encoder
    activation held until the end of the iteration."""
    forwards = [(g, ActionKind.FORWARD, j) for j in microbatches for g in guests]
    # an encoder cut into chunks back-propagates its last chunk first
    reverse = sorted(guests, key=lambda g: (guests.index((g[0], 0)), -g[1]))
    backwards = [(g, ActionKind.BACKWARD, j) for j in microbatches for g in reverse if needs_backward[g]]
    return forwards + order + backwards


def _order_lookahead(order: list[tuple[Stage, ActionKind, int]], stage: Stage) -> float:
    """How far ahead (in global microbatch indices) ``order`` forwards ``stage`` before each
    of its backwards: the `warmup_lookahead` an interleaved position realises (inf: no backward)."""
    seen, ahead = -1, -math.inf
    for st, k, j in order:
        if st != stage:
            continue
        if k is ActionKind.FORWARD:
            seen = max(seen, j)
        else:
            ahead = max(ahead, seen - j)
    return math.inf if ahead == -math.inf else ahead


def build_schedule(
    plan: Plan,
    trainable: dict[Stage, bool] | None = None,
    kind: str | None = None,
    layout: "BatchLayout | None" = None,
    eager: int = 0,
) -> Schedule:
    """Build the schedule of one training iteration for a resolved plan.

    ``kind`` is ``"gpipe"`` or ``"1f1b"`` (default ``plan.schedule``); ``trainable`` as in
    `backward_flow`. Rank ``(m, s, r)`` handles ``plan.microbatches_of(m, r)`` in increasing
    order:

    - forward of ``j``: ``RECV_ACT`` from each predecessor's replica for ``j`` (at the LLM's first
      stage one per encoder, in plan order; encoder first stages load ``j`` from data instead),
      ``FORWARD``, ``SEND_ACT`` to each successor's replica for ``j`` (from the LLM's last stage,
      one per generator);
    - backward of ``j`` (only where `backward_flow` says so): ``RECV_GRAD`` from each successor
      whose edge carries a gradient (none at a stage that computes a loss: the LLM's last
      without generators, a generator's last), ``BACKWARD``, ``SEND_GRAD`` to each
      predecessor whose edge carries a gradient;
    - at the end, for stages holding trainable parameters: ``GRAD_SYNC`` then ``OPTIMIZER_STEP``.

    GPipe runs all forwards, then all backwards (increasing order). 1F1B uses Cornstarch's
    multimodal warmup (cornstarch.md §3.1, `warmup_count`), capped at the rank's microbatch
    count, then alternates one forward and one backward, then drains; see `warmup_lookahead` for how
    the warmup carries over to modules of different data-parallel degrees.
    ZB-H1 (zero-bubble, Qi et al., §3.1) is 1F1B with the backward of each stage that has
    both parts (trainable parameters and an incoming gradient edge) split into
    ``BACKWARD_INPUT``, at the backward's place and followed by its ``SEND_GRAD``s, and a
    deferred ``BACKWARD_WEIGHT`` (`_weight_slots`).

    With a ``layout`` (`loom.schedule.layout.BatchLayout`, one per iteration) the microbatch
    count is the layout's, and an encoder's microbatch ``j`` and the LLM's ``k`` may hold
    different samples. Each encoder-to-LLM edge then becomes one message per ``(j, k)`` pair
    that shares samples (``samples`` names them, ``peer_microbatch`` the other side): encoder
    outputs go straight to the LLM microbatch of their samples (OrchMLLM's rearrangement
    composition, orchmllm.md §2.1), and gradients come back the transposed way. An encoder
    microbatch whose samples reach a later round's LLM microbatch (Entrain's deferral) runs a
    split backward (entrain.md §3.6): the part whose gradients are due at once at its usual
    place, the deferred part just before the rank's next backward, when their gradients have
    arrived; the input gradient to an earlier encoder stage leaves after the last part.
    ``eager`` deepens the encoders' warmup by that many microbatches (see `warmup_lookahead`), or
    by the layout's ``eager_forward`` where that is deeper (the policy's choice).
    """
    kind = plan.schedule if kind is None else kind
    if layout is not None:
        eager = max(eager, layout.eager_forward)
    if kind not in KINDS:
        raise ValueError(f"schedule kind {kind!r} is unknown: choose one of {list(KINDS)}")
    if layout is not None:
        if layout.is_identity() and layout.num_microbatches == plan.num_microbatches:
            layout = None  # the plain j -> j edges carry exactly these samples
        elif plan.placement == "first_stage":
            raise PlanError("plan.placement = 'first_stage' runs each encoder microbatch with the LLM microbatch of the "
                            "same slot: a balanced layout is not supported with it; use balance.default = 'none' or "
                            "placement = 'disaggregated'")
        else:
            plan = dataclasses.replace(plan, num_microbatches=layout.num_microbatches)
    _check_resolved(plan)
    train = _trainable_map(plan, trainable)
    needs_backward, gradient_edges = backward_flow(plan, trainable)
    preds, succs = _neighbours(plan)
    rnd = math.lcm(*(m.data_parallel for m in plan.modules))
    if eager < 0:
        raise ValueError(f"eager = {eager}: the extra encoder warmup must be 0 or more microbatches")
    # interleaved positions set their stages' lookahead by their order; the encoders feeding the
    # LLM's first stage then look at least that far ahead (`warmup_lookahead`)
    given: dict[Stage, float] = {}
    for spec in plan.modules:
        if spec.virtual_stages > 1:
            for p in range(spec.pipeline_depth):
                hosted = [(spec.name, st) for st in spec.hosted_stages(p)]
                for r in range(spec.data_parallel):
                    order = interleaved_order(plan, hosted, plan.microbatches_of(spec.name, r), kind, needs_backward)
                    for st in hosted:
                        given[st] = max(given.get(st, -math.inf), _order_lookahead(order, st))
    lookahead = warmup_lookahead(plan, kind, 2 * (rnd - 1) if layout is not None else 0, eager, given)
    # ZB-H1 splits the backward of a stage that has both parts: parameters to train and an
    # input gradient to send back; elsewhere the backward is one kind of work and stays whole
    split_stages = {st for st in needs_backward if kind == "zb-h1" and train[st]
                    and any((p, st) in gradient_edges for p in preds[st])}
    depth = (plan.spec(LLM).num_stages + max((plan.spec(e).num_stages for e in plan.encoder_names), default=0)
             + max((plan.spec(g).num_stages for g in plan.generator_names), default=0))

    def peer_rank(stage: Stage, microbatch: int) -> int:
        m, s = stage
        return plan.unit_of(m, s, plan.replica_of_microbatch(m, microbatch))

    encoder_set = set(plan.encoder_names)
    # generators whose slots the layout rearranged on their own (OrchMLLM's and Entrain's
    # generator phase): the LLM's last stage sends each of them rows by sample
    routed_generators = {g for g in plan.generator_names if layout is not None and not layout.shares_llm_slots(g)}
    last_llm = (LLM, plan.spec(LLM).num_stages - 1)

    def routed(src: Stage, dst: Stage) -> bool:  # an edge whose microbatches hold other samples each side
        if layout is None:
            return False
        return (dst == (LLM, 0) and src[0] in encoder_set) or (src == last_llm and dst[0] in routed_generators)

    def edge_messages(here: Stage, there: Stage, j: int, kind_: ActionKind) -> list[Action]:
        """The messages of one microbatch ``j`` of ``here`` along the edge to/from ``there``."""
        m, s = here
        if routed(here, there):  # the sending side: one message per microbatch it feeds
            return [Action(kind_, m, s, j, peer_rank(there, k), there[0], there[1], samples=part, peer_microbatch=k)
                    for k, part in layout.routes_out(m, there[0], j)]
        if routed(there, here):  # the receiving side: one message per microbatch feeding it
            return [Action(kind_, m, s, j, peer_rank(there, i), there[0], there[1], samples=part, peer_microbatch=i)
                    for i, part in layout.routes_in(there[0], m, j)]
        return [Action(kind_, m, s, j, peer_rank(there, j), there[0], there[1])]

    actions: dict[int, list[Action]] = {}
    for unit in range(plan.num_units):  # a pipeline unit; a rank when TP = CP = 1
        stages_here = plan.stages_of_unit(unit)
        hosted = [(m, s) for m, s, _ in stages_here]
        m, _, replica = plan.role_of_unit(unit)
        mine = plan.microbatches_of(m, replica)
        own = [st for st in hosted if st[0] == m]
        if len(own) > 1:  # virtual stages: Megatron's interleaved order over the hosted chunks
            order = interleaved_order(plan, own, mine, kind, needs_backward)
        else:
            me = own[0]
            order = [(me, k, j) for k, j in _compute_order(mine, lookahead[me] if needs_backward[me] else None)]
        guests = [st for st in hosted if st[0] != m]
        if guests and plan.placement == "colocated":  # an encoder replica of its own beside the LLM's stages
            guest_mbs = plan.microbatches_of(guests[0][0], next(r for g, _, r in stages_here if g != m))
            order = _around(order, guests, guest_mbs, needs_backward)
        elif guests:  # first_stage: the encoders ride on the LLM's first stage
            order = _with_guests(order, guests, needs_backward)
        acts: list[Action] = []
        # per stage: own backward -> ZB-H1 weight passes after it; deferred split-backward parts
        weight_after = {me: _weight_slots([(k, j) for st, k, j in order if st == me],
                                          depth - 1 - warmup_count(plan, me)) for me in hosted if me in split_stages}
        deferred: dict[tuple[Stage, int], list[Action]] = {}  # (stage, own microbatch) -> parts to run before it
        tail: list[Action] = []  # deferred parts with no later own backward
        for me, kind_, j in order:
            m, s = me
            if kind_ is ActionKind.BACKWARD and (me, j) in deferred:
                acts.extend(deferred.pop((me, j)))
            if kind_ is ActionKind.FORWARD:
                for src in preds[me]:
                    acts.extend(edge_messages(me, src, j, ActionKind.RECV_ACT))
                acts.append(Action(ActionKind.FORWARD, m, s, j))
                for dst in succs[me]:
                    acts.extend(edge_messages(me, dst, j, ActionKind.SEND_ACT))
                continue
            recvs = [r for dst in succs[me] if (me, dst) in gradient_edges
                     for r in edge_messages(me, dst, j, ActionKind.RECV_GRAD)]
            sends = [x for src in preds[me] if (src, me) in gradient_edges
                     for x in edge_messages(me, src, j, ActionKind.SEND_GRAD)]
            now = [r for r in recvs if r.other_microbatch // rnd <= j // rnd]
            later = [r for r in recvs if r.other_microbatch // rnd > j // rnd]
            if not later:
                if me in split_stages:  # ZB-H1: the input gradient now, the weights where `_weight_slots` says
                    acts.extend(now + [Action(ActionKind.BACKWARD_INPUT, m, s, j)] + sends)
                    acts.extend(Action(ActionKind.BACKWARD_WEIGHT, m, s, w) for w in weight_after[me].get(j, ()))
                else:
                    acts.extend(now + [Action(ActionKind.BACKWARD, m, s, j)] + sends)
                continue
            if kind == "zb-h1":
                raise PlanError(
                    f"plan.schedule = 'zb-h1' with a layout that defers encoder gradients to a later round "
                    f"(Entrain's split backward, {m}.{s} mb{j}) is not supported: use plan.schedule = '1f1b' with "
                    f"this balancing policy, or a policy that keeps each microbatch's samples in its round")
            # Split backward: samples whose gradients come from a later round wait for them.
            first = tuple(x for r in now for x in r.samples)
            if first:
                acts.extend(now + [Action(ActionKind.BACKWARD, m, s, j, samples=first)])
            else:
                acts.extend(now)
            rest = later + [Action(ActionKind.BACKWARD, m, s, j, samples=tuple(x for r in later for x in r.samples))] + sends
            nxt = next((b for st, k_, b in order if st == me and k_ is ActionKind.BACKWARD and b > j), None)
            if nxt is None:
                tail.extend(rest)
            else:
                deferred.setdefault((me, nxt), []).extend(rest)
        acts.extend(tail)
        # gradients synced stage by stage, then each stage's share of the rank's optimizer step
        acts.extend(Action(ActionKind.GRAD_SYNC, m, s) for m, s in hosted if train[(m, s)])
        acts.extend(Action(ActionKind.OPTIMIZER_STEP, m, s) for m, s in hosted if train[(m, s)])
        if len(hosted) > 1:  # name each action's chunk (traces; the stage already says it)
            pp = plan.spec(m).pipeline_depth
            acts = [dataclasses.replace(a, chunk=a.stage // pp) for a in acts]
        actions[unit] = acts

    return Schedule(
        kind=kind,
        num_microbatches=plan.num_microbatches,
        actions=actions,
        needs_backward={stage_key(m, s): nb for (m, s), nb in needs_backward.items()},
    )

