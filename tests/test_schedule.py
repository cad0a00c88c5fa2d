"""Tests of the schedule generators and validator (`loom.schedule`)."""

from __future__ import annotations

import itertools
import json

import pytest

from loom.plan.plan import ModuleSpec, Plan
from loom.schedule import (
    KINDS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    backward_flow,
    build_schedule,
    pipeline_edges,
    render,
    stage_key,
    unit_cost_makespan,
    validate_schedule,
)

from plans import multimodal

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD


# the schedules whose backward is one action (zb-h1 splits it: tests/test_zero_bubble.py)
WHOLE_BACKWARD = tuple(k for k in KINDS if k != "zb-h1")


# ---- plans -------------------------------------------------------------------------------
def chain(stages: int, microbatches: int, dp: int = 1, kind: str = "1f1b") -> Plan:
    return Plan([ModuleSpec("llm", data_parallel=dp, num_stages=stages)], num_microbatches=microbatches,
                schedule=kind).resolve({"llm": 6})


def in_flight(actions: list[Action]) -> int:
    """Most microbatches forwarded but not yet backwarded at any point of one rank's list."""
    live = peak = 0
    for a in actions:
        live += (a.kind is F) - (a.kind is B)
        peak = max(peak, live)
    return peak


def stage_count(plan: Plan, module: str) -> int:
    return plan.spec(module).num_stages


# ---- the graph ---------------------------------------------------------------------------
def test_pipeline_edges():
    plan = multimodal(vision=2, audio=1, llm=2)
    assert pipeline_edges(plan) == [
        (("vision", 0), ("vision", 1)), (("vision", 1), ("llm", 0)), (("audio", 0), ("llm", 0)),
        (("llm", 0), ("llm", 1)),
    ]
    assert pipeline_edges(chain(3, 4)) == [(("llm", 0), ("llm", 1)), (("llm", 1), ("llm", 2))]


# ---- generated schedules are valid -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("dp", [1, 2])
def test_chain_schedules_validate(kind, stages, dp):
    for m in range(dp, 9):
        plan = chain(stages, m, dp, kind)
        sched = build_schedule(plan)
        assert sched.kind == kind and sched.world_size == stages * dp
        validate_schedule(sched, plan)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dp_enc,dp_llm", [(1, 1), (2, 2), (2, 1), (1, 2), (3, 2), (2, 3)])
def test_multimodal_schedules_validate(kind, dp_enc, dp_llm):
    for vision, audio, llm in itertools.product([1, 2, 3], [0, 1, 2], [1, 2, 3]):
        for m in (1, 2, 3, 5, 8):
            if max(dp_enc, dp_llm) > m:
                continue
            plan = multimodal(vision, audio, llm, m, dp_enc, dp_llm)
            validate_schedule(build_schedule(plan, kind=kind), plan)


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_schedules_validate(kind):
    for dp_enc, dp_llm in [(1, 1), (2, 1), (1, 2)]:
        plan = multimodal(2, 1, 2, 4, dp_enc, dp_llm)
        stages = [(m.name, s) for m in plan.modules for s in range(m.num_stages)]
        for flags in itertools.product([False, True], repeat=len(stages)):
            sched = build_schedule(plan, dict(zip(stages, flags)), kind)
            validate_schedule(sched, plan)


def test_forward_and_backward_blocks():
    """Each forward is [recv from every predecessor] F [send]; each backward [recv] B [send]."""
    plan = multimodal(vision=2, audio=1, llm=2, microbatches=2)
    sched = build_schedule(plan, kind="gpipe")
    llm0 = sched.actions[plan.rank_of("llm", 0, 0)]
    v1, a0, l1 = plan.rank_of("vision", 1, 0), plan.rank_of("audio", 0, 0), plan.rank_of("llm", 1, 0)
    assert llm0[:4] == [
        Action(RECV_ACT, "llm", 0, 0, v1, "vision", 1),
        Action(RECV_ACT, "llm", 0, 0, a0, "audio", 0),
        Action(F, "llm", 0, 0),
        Action(SEND_ACT, "llm", 0, 0, l1, "llm", 1),
    ]
    first_backward = [a for a in llm0 if a.kind in (RECV_GRAD, B, SEND_GRAD)][:4]
    assert first_backward == [
        Action(RECV_GRAD, "llm", 0, 0, l1, "llm", 1),
        Action(B, "llm", 0, 0),
        Action(SEND_GRAD, "llm", 0, 0, v1, "vision", 1),
        Action(SEND_GRAD, "llm", 0, 0, a0, "audio", 0),
    ]
    # The LLM's last stage computes the loss: no gradient to receive; encoder first stages
    # load data: no activation to receive.
    assert not any(a.kind is RECV_GRAD for a in sched.actions[l1])
    assert not any(a.kind is RECV_ACT for a in sched.actions[plan.rank_of("vision", 0, 0)])
    assert sched.actions[l1][-2:] == [Action(ActionKind.GRAD_SYNC, "llm", 1), Action(ActionKind.OPTIMIZER_STEP, "llm", 1)]
    assert sched.needs_backward == {stage_key(m, s): True for m, s in
                                    [("vision", 0), ("vision", 1), ("audio", 0), ("llm", 0), ("llm", 1)]}


def test_routing_across_data_parallel_degrees():
    """Encoder dp 2, LLM dp 1: microbatch j comes from vision replica j % 2."""
    plan = multimodal(vision=1, audio=0, llm=1, microbatches=4, dp_enc=2, dp_llm=1)
    sched = build_schedule(plan)
    llm = sched.actions[plan.rank_of("llm", 0, 0)]
    senders = [a.peer for a in llm if a.kind is RECV_ACT]
    assert senders == [plan.rank_of("vision", 0, j % 2) for j in range(4)]
    for r in range(2):
        own = sched.actions[plan.rank_of("vision", 0, r)]
        assert [a.microbatch for a in own if a.kind is F] == plan.microbatches_of("vision", r)


# ---- makespan and in-flight bounds -------------------------------------------------------
@pytest.mark.parametrize("kind", WHOLE_BACKWARD)
def test_chain_unit_makespan(kind):
    for stages, m in itertools.product(range(1, 5), range(1, 9)):
        sched = build_schedule(chain(stages, m), kind=kind)
        assert unit_cost_makespan(sched) == 2 * (m + stages - 1), (stages, m)


def test_chain_unit_makespan_with_data_parallel():
    # Each replica is an independent chain over its own microbatches.
    for stages, m in itertools.product(range(1, 4), [2, 4, 6]):
        for kind in WHOLE_BACKWARD:
            assert unit_cost_makespan(build_schedule(chain(stages, m, 2), kind=kind)) == 2 * (m // 2 + stages - 1)


def test_one_f_one_b_in_flight_chain():
    """1F1B holds at most P - s microbatches at stage s; exactly min(P - s, own microbatches)."""
    for stages, m, dp in itertools.product(range(1, 5), range(1, 9), [1, 2]):
        if dp > m:
            continue
        plan = chain(stages, m, dp)
        sched = build_schedule(plan)
        for rank, acts in sched.actions.items():
            _, s, r = plan.role_of(rank)
            assert in_flight(acts) == min(stages - s, len(plan.microbatches_of("llm", r))), (stages, m, dp, rank)
        gpipe = build_schedule(plan, kind="gpipe")
        for rank, acts in gpipe.actions.items():
            assert in_flight(acts) == len(plan.microbatches_of("llm", plan.role_of(rank)[2]))


def test_one_f_one_b_in_flight_multimodal():
    """Cornstarch's warmup (cornstarch.md §3.1): LLM stage s holds at most P_llm - s, encoder
    stage s at most P_m + P_llm - s microbatches (encoders with at least the LLM's dp)."""
    for vision, audio, llm, m, (dp_enc, dp_llm) in itertools.product(
        [1, 2, 3], [0, 2], [1, 2, 3], [1, 3, 8], [(1, 1), (2, 2), (2, 1)]
    ):
        if dp_enc > m:
            continue
        plan = multimodal(vision, audio, llm, m, dp_enc, dp_llm)
        sched = build_schedule(plan)
        p_llm = stage_count(plan, "llm")
        for rank, acts in sched.actions.items():
            mod, s, r = plan.role_of(rank)
            bound = p_llm - s if mod == "llm" else stage_count(plan, mod) + p_llm - s
            assert in_flight(acts) == min(bound, len(plan.microbatches_of(mod, r))), (plan.to_dict(), rank)


def test_encoder_looks_further_ahead_when_llm_has_more_replicas():
    """Vision (1 stage, dp 1) into an LLM (3 stages, dp 2). LLM replica 0 forwards mb 0, 2, 4
    before its first backward; with Cornstarch's plain warmup the encoder would forward only
    mb 0..3 before waiting for mb0's gradient, and the two would deadlock. The generator raises
    the encoder's lookahead to match, so it holds 5 microbatches instead of P_m + P_llm = 4."""
    plan = Plan([ModuleSpec("vision", 1, 1), ModuleSpec("llm", 2, 3)], num_microbatches=6).resolve({"vision": 4, "llm": 6})
    sched = build_schedule(plan)
    validate_schedule(sched, plan)
    assert in_flight(sched.actions[plan.rank_of("vision", 0, 0)]) == 5
    assert in_flight(sched.actions[plan.rank_of("llm", 0, 0)]) == 3


# ---- frozen-aware backward ---------------------------------------------------------------
V0, V1, L0, L1 = ("vision", 0), ("vision", 1), ("llm", 0), ("llm", 1)
EDGE_V = (V0, V1)
EDGE_VL = (V1, L0)
EDGE_L = (L0, L1)

# (encoder trainable, projector stage trainable, llm trainable) ->
#     (needs_backward of v0, v1, l0, l1, gradient-carrying edges), written out by hand.
FROZEN_CASES = {
    (False, False, False): ((False, False, False, False), set()),
    (False, False, True): ((False, False, True, True), {EDGE_L}),
    (False, True, False): ((False, True, True, True), {EDGE_VL, EDGE_L}),
    (False, True, True): ((False, True, True, True), {EDGE_VL, EDGE_L}),
    (True, False, False): ((True, True, True, True), {EDGE_V, EDGE_VL, EDGE_L}),
    (True, False, True): ((True, True, True, True), {EDGE_V, EDGE_VL, EDGE_L}),
    (True, True, False): ((True, True, True, True), {EDGE_V, EDGE_VL, EDGE_L}),
    (True, True, True): ((True, True, True, True), {EDGE_V, EDGE_VL, EDGE_L}),
}


@pytest.mark.parametrize("flags", sorted(FROZEN_CASES))
def test_backward_flow_cases(flags):
    enc, proj, llm = flags
    plan = multimodal(vision=2, audio=0, llm=2)
    trainable = {V0: enc, V1: proj, L0: llm, L1: llm}
    needs, edges = backward_flow(plan, trainable)
    want_needs, want_edges = FROZEN_CASES[flags]
    assert tuple(needs[st] for st in (V0, V1, L0, L1)) == want_needs
    assert edges == want_edges

    sched = build_schedule(plan, trainable, "1f1b")
    validate_schedule(sched, plan)
    for rank, acts in sched.actions.items():
        mod, s, _ = plan.role_of(rank)
        kinds = {a.kind for a in acts}
        assert (B in kinds) == needs[(mod, s)]
        # Only stages holding trainable parameters sync gradients and step.
        assert (ActionKind.GRAD_SYNC in kinds) == trainable[(mod, s)]
        assert (ActionKind.OPTIMIZER_STEP in kinds) == trainable[(mod, s)]
        sends_grad = any(a.kind is SEND_GRAD for a in acts)
        assert sends_grad == any(e[1] == (mod, s) for e in edges)


def test_backward_flow_frozen_audio_beside_projector():
    """Frozen vision with a trainable projector, frozen audio, frozen LLM (cornstarch.md §3.2.1)."""
    plan = multimodal(vision=2, audio=1, llm=2)
    trainable = {V0: False, V1: True, ("audio", 0): False, L0: False, L1: False}
    needs, edges = backward_flow(plan, trainable)
    assert needs == {V0: False, V1: True, ("audio", 0): False, L0: True, L1: True}
    assert edges == {EDGE_VL, EDGE_L}
    sched = build_schedule(plan, trainable)
    validate_schedule(sched, plan)
    llm0 = sched.actions[plan.rank_of("llm", 0, 0)]
    assert {a.peer_module for a in llm0 if a.kind is SEND_GRAD} == {"vision"}
    audio = sched.actions[plan.rank_of("audio", 0, 0)]
    assert [a.kind for a in audio] == [F, SEND_ACT] * 4
    assert sched.needs_backward[stage_key("audio", 0)] is False


def test_backward_flow_defaults_and_errors():
    plan = multimodal()
    needs, edges = backward_flow(plan)
    assert all(needs.values()) and edges == set(pipeline_edges(plan))
    # A stage missing from the dict counts as trainable.
    needs, _ = backward_flow(plan, {V0: False})
    assert not needs[V0] and needs[V1] and needs[L0]
    with pytest.raises(ValueError, match="stages"):
        backward_flow(plan, {("vision", 7): True})


def test_fully_frozen_runs_forwards_only():
    plan = multimodal()
    stages = [(m.name, s) for m in plan.modules for s in range(m.num_stages)]
    sched = build_schedule(plan, {st: False for st in stages})
    validate_schedule(sched, plan)
    assert not any(a.kind in (B, SEND_GRAD, RECV_GRAD) for acts in sched.actions.values() for a in acts)
    # Forward-only pipeline: vision (2 stages) + llm (2 stages) deep, 4 microbatches.
    assert unit_cost_makespan(sched) == 4 + 4 - 1


# ---- errors from the generator -----------------------------------------------------------
def test_build_rejects_bad_input():
    plan = Plan([ModuleSpec("llm", num_stages=2)], num_microbatches=4)
    with pytest.raises(ValueError, match="unresolved"):
        build_schedule(plan)
    plan.resolve({"llm": 6})
    with pytest.raises(ValueError, match="unknown"):
        build_schedule(plan, kind="zigzag")
    with pytest.raises(ValueError, match="has no 'llm' module"):
        build_schedule(Plan([ModuleSpec("vision")], num_microbatches=2))


# ---- malformed IRs -----------------------------------------------------------------------
def _mutable(sched: Schedule) -> Schedule:
    return Schedule(sched.kind, sched.num_microbatches, {r: list(a) for r, a in sched.actions.items()},
                    dict(sched.needs_backward))


def test_rejects_missing_recv():
    plan = chain(2, 4)
    sched = _mutable(build_schedule(plan))
    acts = sched.actions[1]
    acts.remove(next(a for a in acts if a.kind is RECV_ACT))
    with pytest.raises(ScheduleError, match=r"rank 0: sendA llm\.0 mb0 -> r1: unmatched"):
        validate_schedule(sched)


def test_rejects_send_to_wrong_peer():
    plan = multimodal(vision=2, audio=1, llm=2)
    sched = _mutable(build_schedule(plan))
    v1 = plan.rank_of("vision", 1, 0)
    acts = sched.actions[v1]
    i = next(i for i, a in enumerate(acts) if a.kind is SEND_ACT)
    acts[i] = Action(SEND_ACT, "vision", 1, acts[i].microbatch, plan.rank_of("audio", 0, 0), "llm", 0)
    with pytest.raises(ScheduleError, match="unmatched"):
        validate_schedule(sched)
    with pytest.raises(ScheduleError, match=r"rank 1: sendA vision\.1 mb0 -> r2: peer rank 2 runs audio\.0"):
        validate_schedule(sched, plan)


def test_rejects_communication_without_peer():
    sched = _mutable(build_schedule(chain(2, 2)))
    i = next(i for i, a in enumerate(sched.actions[0]) if a.kind is SEND_ACT)
    sched.actions[0][i] = Action(SEND_ACT, "llm", 0, 0)
    with pytest.raises(ScheduleError, match="without peer"):
        validate_schedule(sched)


def test_rejects_duplicated_forward():
    sched = _mutable(build_schedule(chain(1, 3)))
    sched.actions[0].insert(0, Action(F, "llm", 0, 2))
    with pytest.raises(ScheduleError, match=r"rank 0: F llm\.0 mb2: forward duplicated"):
        validate_schedule(sched)


def test_rejects_duplicated_message():
    sched = _mutable(build_schedule(chain(2, 2)))
    acts = sched.actions[0]
    send = next(a for a in acts if a.kind is SEND_ACT)
    acts.insert(acts.index(send) + 1, send)
    with pytest.raises(ScheduleError, match="duplicated"):
        validate_schedule(sched)


def test_rejects_backward_before_forward():
    sched = _mutable(build_schedule(chain(1, 2)))
    acts = sched.actions[0]
    assert [a.kind for a in acts[:2]] == [F, B]
    acts[0], acts[1] = acts[1], acts[0]
    with pytest.raises(ScheduleError, match=r"rank 0: B llm\.0 mb0: backward precedes its forward"):
        validate_schedule(sched)


def test_rejects_missing_backward():
    sched = _mutable(build_schedule(chain(1, 3)))
    sched.actions[0].remove(Action(B, "llm", 0, 1))
    with pytest.raises(ScheduleError, match=r"rank 0: F llm\.0 mb1: missing backward"):
        validate_schedule(sched)


def test_rejects_backward_of_stage_without_backward():
    sched = _mutable(build_schedule(chain(1, 2)))
    sched.needs_backward[stage_key("llm", 0)] = False
    with pytest.raises(ScheduleError, match="stage without backward"):
        validate_schedule(sched)


def test_rejects_receive_after_its_compute():
    sched = _mutable(build_schedule(chain(2, 2)))
    acts = sched.actions[1]
    recv = acts.pop(0)
    acts.insert(2, recv)
    with pytest.raises(ScheduleError, match="receive after the forward"):
        validate_schedule(sched)


def test_rejects_deadlock_two_ranks_receiving_first():
    """Each of two ranks first waits for the other's activation."""
    actions = {
        0: [Action(RECV_ACT, "a", 0, 0, 1, "b", 0), Action(F, "a", 0, 0), Action(SEND_ACT, "a", 0, 0, 1, "b", 0)],
        1: [Action(RECV_ACT, "b", 0, 0, 0, "a", 0), Action(F, "b", 0, 0), Action(SEND_ACT, "b", 0, 0, 0, "a", 0)],
    }
    sched = Schedule("custom", 1, actions, {"a:0": False, "b:0": False})
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 waits at recvA a\.0 mb0 <- r1.*rank 1 waits at recvA b\.0 mb0 <- r0"):
        validate_schedule(sched)
    with pytest.raises(ScheduleError, match="deadlock"):
        unit_cost_makespan(sched)


def test_rejects_deadlock_gradient_awaited_before_sending_activation():
    """A 2-stage chain where stage 0 waits for mb0's gradient before sending mb0's activation."""
    sched = _mutable(build_schedule(chain(2, 2)))
    acts = sched.actions[0]
    recv_grad = next(a for a in acts if a.kind is RECV_GRAD)
    acts.remove(recv_grad)
    acts.insert(acts.index(Action(SEND_ACT, "llm", 0, 0, 1, "llm", 1)), recv_grad)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 waits at recvG llm\.0 mb0 <- r1"):
        validate_schedule(sched)


def test_rejects_schedule_not_matching_plan():
    plan = chain(2, 4)
    with pytest.raises(ScheduleError, match="ranks"):
        validate_schedule(build_schedule(chain(3, 4)), plan)
    sched = _mutable(build_schedule(plan))
    sched.actions[0] = [a for a in sched.actions[0] if a.microbatch != 3]
    sched.actions[1] = [a for a in sched.actions[1] if a.microbatch != 3]
    validate_schedule(sched)  # consistent on its own...
    with pytest.raises(ScheduleError, match=r"microbatches \[3\] are never forwarded"):
        validate_schedule(sched, plan)  # ...but the plan has 4 microbatches at every stage
    swapped = _mutable(build_schedule(plan))
    swapped.actions[0], swapped.actions[1] = swapped.actions[1], swapped.actions[0]
    with pytest.raises(ScheduleError, match="the plan places llm.0"):
        validate_schedule(swapped, plan)


def test_rejects_missing_grad_sync_on_a_replica():
    plan = chain(1, 4, dp=2)
    sched = _mutable(build_schedule(plan))
    sched.actions[1] = [a for a in sched.actions[1] if a.kind is not ActionKind.GRAD_SYNC]
    with pytest.raises(ScheduleError, match=r"ranks \[1\] also run llm\.0"):
        validate_schedule(sched, plan)


# ---- serialisation and rendering ---------------------------------------------------------
def test_round_trip_json():
    plan = multimodal(2, 1, 2, 4, dp_enc=2, dp_llm=1)
    sched = build_schedule(plan, {V0: False, ("audio", 0): False})
    back = Schedule.from_dict(json.loads(sched.to_json()))
    assert back.actions == sched.actions
    assert back.needs_backward == sched.needs_backward
    assert (back.kind, back.num_microbatches) == (sched.kind, sched.num_microbatches)
    validate_schedule(back, plan)


def test_render():
    plan = chain(2, 2)
    text = render(build_schedule(plan), communication=False)
    assert text.splitlines() == [
        "1f1b: 2 microbatches, 2 ranks",
        "r0: F llm.0 mb0 | F llm.0 mb1 | B llm.0 mb0 | B llm.0 mb1 | sync llm.0 | step llm.0",
        "r1: F llm.1 mb0 | B llm.1 mb0 | F llm.1 mb1 | B llm.1 mb1 | sync llm.1 | step llm.1",
    ]
    assert "sendA llm.0 mb0 -> r1" in render(build_schedule(plan))


def test_batch_layout_arrays_are_read_only_and_keyed():
    import numpy as np

    from loom.schedule.layout import BatchLayout, contiguous_layout, identity_layout

    phases = ["vision", "llm"]
    a = identity_layout([[0, 2], [1, 3]], phases)
    order, bounds = a.arrays["llm"]
    with pytest.raises(ValueError):
        order[0] = 5  # the cached slots could not follow
    with pytest.raises(TypeError):
        a.arrays["llm"] = (order, bounds)
    with pytest.raises(AttributeError):
        a.arrays = {}
    assert a.slots["llm"] == ((0, 2), (1, 3))
    # the key follows the slots (not the policy) and is hashable
    b = BatchLayout({p: ((0, 2), (1, 3)) for p in phases}, {p: "orchmllm" for p in phases})
    assert a.key() == b.key() and hash(a.key()) == hash(b.key())
    c = identity_layout([[0, 3], [1, 2]], phases)
    d = BatchLayout({"vision": ((0, 2), (1, 3)), "llm": ((0, 2), (3, 1))})
    assert len({a.key(), c.key(), d.key()}) == 3
    e = contiguous_layout(4, 2, phases)
    assert e.key() == identity_layout([[0, 1], [2, 3]], phases).key() and e.is_identity()
    # a caller's array is not frozen by the layout built over it
    mine = np.array([0, 1, 2, 3])
    BatchLayout(None, arrays={p: (mine, np.array([0, 2, 4])) for p in phases})
    mine[0] = 0


def test_check_skips_only_orders_vouched_as_an_argsort():
    import numpy as np

    from loom.balance.orchmllm import slot_arrays
    from loom.schedule.layout import BatchLayout, LayoutError

    phases = ["vision", "llm"]
    rng = np.random.default_rng(0)
    index = np.concatenate((np.arange(8), rng.integers(0, 8, size=200)))  # every slot non-empty
    arrays = {p: slot_arrays(index, 8) for p in phases}
    a = BatchLayout(None, arrays=arrays)
    for p in phases:
        a.set_slot_index(p, index)
    # what the skip relies on: slot_arrays' order is a permutation of the positions, slot-sorted
    order, bounds = a.arrays["llm"]
    assert np.array_equal(np.sort(order), np.arange(index.size))
    assert np.array_equal(a.slot_index("llm")[order], np.repeat(np.arange(8), np.diff(bounds)))
    a.check(index.size, phases)
    with pytest.raises(LayoutError, match="drops samples"):
        a.check(index.size + 1, phases)  # the size is still checked
    # a duplicated sample: caught, also after slot_index scattered (not vouched) an index
    dup = np.array([0, 1, 1, 3])
    b = BatchLayout(None, arrays={p: (dup, np.array([0, 2, 4])) for p in phases})
    b.slot_index("llm")
    with pytest.raises(LayoutError, match="duplicated"):
        b.check(4, phases)
