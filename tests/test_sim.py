"""Tests of the simulator (`loom.sim`) against closed forms and hand-computed timelines, with
`UniformCostModel` (`loom.cost.uniform`)."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from loom.cost.model import Workload
from loom.cost.uniform import UniformCostModel
from loom.plan.plan import ModuleSpec, Plan
from loom.schedule import KINDS as ALL_KINDS
from loom.schedule import Action, ActionKind, Schedule, build_schedule, unit_cost_makespan
from loom.sim import DeadlockError, plot_gantt, simulate
from loom.sim.gantt import chart_events

from plans import multimodal

F, B = ActionKind.FORWARD, ActionKind.BACKWARD

# the schedules with one backward action (zb-h1 splits it and is priced in tests/test_zero_bubble.py)
KINDS = tuple(k for k in ALL_KINDS if k != "zb-h1")


# ---- plans -------------------------------------------------------------------------------
def chain(stages: int, microbatches: int, kind: str = "1f1b", dp: int = 1, tp: int = 1) -> Plan:
    return Plan([ModuleSpec("llm", data_parallel=dp, num_stages=stages, tensor_parallel=tp)],
                num_microbatches=microbatches, schedule=kind).resolve({"llm": 8})


def run(plan: Plan, **costs):
    return simulate(build_schedule(plan), plan, UniformCostModel(plan, **costs))


class TokenCost(UniformCostModel):
    """Forward costs the module's token count, backward twice that: a workload-driven model."""

    def stage_time(self, module, stage, kind, work):
        return float(work.tokens) * (1.0 if kind == "forward" else 2.0)


# ---- closed forms ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (1, 5), (2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (5, 3), (8, 16)])
def test_chain_closed_form(kind, stages, microbatches):
    """Uniform F and B, no communication cost: both take (M + S - 1)(F + B), bubbles are
    (S - 1) / (M + S - 1) of the time, MFU the rest."""
    f, b = 1.5, 2.5
    plan = chain(stages, microbatches, kind)
    r = run(plan, forward=f, backward=b, flops_per_microbatch=stages * (f + b), peak_flops=1.0)
    assert r.iteration_time == pytest.approx((microbatches + stages - 1) * (f + b), abs=1e-12)
    bubble = (stages - 1) / (microbatches + stages - 1)
    assert r.bubble_fraction == pytest.approx(bubble, abs=1e-12)
    assert r.mfu == pytest.approx(1 - bubble, abs=1e-12)
    for u in range(stages):
        assert r.busy[u] == pytest.approx(microbatches * (f + b))
        assert r.idle[u] == pytest.approx((stages - 1) * (f + b))


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_weights_bubbles_and_mfu(kind):
    """TP ranks of a unit run together: the world has S*TP ranks, the closed forms are unchanged."""
    stages, m, tp = 3, 5, 4
    plan = chain(stages, m, kind, tp=tp)
    r = run(plan, forward=1.0, backward=2.0, flops_per_microbatch=tp * stages * 3.0)
    assert r.world_size == stages * tp
    assert r.iteration_time == pytest.approx((m + stages - 1) * 3.0)
    assert r.mfu == pytest.approx(m / (m + stages - 1))
    assert r.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1))
    assert sorted(r.first_rank.values()) == [0, tp, 2 * tp]
    assert {e.rank for e in r.timeline} == {0, tp, 2 * tp}


@pytest.mark.parametrize("kind", KINDS)
def test_per_stage_costs_hand_computed(kind):
    """2 stages, 2 microbatches, stage 0 F=1 B=2, stage 1 F=3 B=4.
    1F1B: s0 F0[0,1] F1[1,2]; s1 F0[1,4] B0[4,8] F1[8,11] B1[11,15]; s0 B0[8,10] B1[15,17].
    GPipe: s1 F0[1,4] F1[4,7] B0[7,11] B1[11,15]; s0 B0[11,13] B1[15,17]. Both end at 17."""
    plan = chain(2, 2, kind)
    r = run(plan, forward={("llm", 0): 1.0, ("llm", 1): 3.0}, backward={("llm", 0): 2.0, ("llm", 1): 4.0})
    assert r.iteration_time == 17.0
    spans = {(e.rank, e.kind, e.microbatch): (e.start_s, e.end_s) for e in r.timeline if e.kind in ("forward", "backward")}
    if kind == "1f1b":
        assert spans[(1, "forward", 1)] == (8.0, 11.0)
        assert spans[(0, "backward", 0)] == (8.0, 10.0)
    else:
        assert spans[(1, "forward", 1)] == (4.0, 7.0)
        assert spans[(0, "backward", 0)] == (11.0, 13.0)
    assert spans[(0, "backward", 1)] == (15.0, 17.0)


def test_dag_uniform_is_a_chain_of_the_longest_path():
    """Two one-stage encoders in parallel feeding a 2-stage LLM behave like a 3-stage chain:
    (M + 2)(F + B)."""
    for m in (1, 2, 4, 7):
        for kind in KINDS:
            r = run(multimodal(vision=1, audio=1, llm=2, microbatches=m, kind=kind), forward=1.0, backward=2.0)
            assert r.iteration_time == pytest.approx((m + 2) * 3.0)


def test_dag_hand_computed():
    """vision F=2 B=4, audio F=1 B=2, LLM stages F=1 B=2, M=2, 1F1B:
    vision F0[0,2] F1[2,4]; audio F0[0,1] F1[1,2]; llm.0 F0[2,3] F1[4,5];
    llm.1 F0[3,4] B0[4,6] F1[6,7] B1[7,9]; llm.0 B0[6,8] B1[9,11];
    vision B0[8,12] B1[12,16]; audio B0[8,10] B1[11,13]. The iteration ends at 16."""
    plan = multimodal(vision=1, audio=1, llm=2, microbatches=2)
    r = run(plan, forward={"vision": 2.0, "audio": 1.0, "llm": 1.0}, backward={"vision": 4.0, "audio": 2.0, "llm": 2.0})
    assert r.iteration_time == 16.0
    finish = {plan.role_of_unit(u)[:2]: t for u, t in r.finish.items()}
    assert finish == {("vision", 0): 16.0, ("audio", 0): 13.0, ("llm", 0): 11.0, ("llm", 1): 9.0}
    assert r.busy[plan.unit_of("vision", 0, 0)] == 12.0 and r.idle[plan.unit_of("audio", 0, 0)] == 10.0


@pytest.mark.parametrize("kind", KINDS)
def test_unit_costs_agree_with_the_validator(kind):
    """With F = B = 1 and everything else free, the simulator is the validator's unit-cost play
    (an independent implementation), over chains, DAGs, DP degrees and frozen modules."""
    plans = [chain(s, m, kind, dp) for s, m, dp in itertools.product((1, 2, 3), (2, 4, 5), (1, 2))]
    plans += [multimodal(v, a, l, m, de, dl, kind=kind)
              for v, a, l, m, de, dl in [(2, 1, 2, 4, 1, 1), (1, 0, 3, 6, 2, 1), (2, 1, 2, 8, 1, 2), (3, 2, 1, 6, 2, 3)]]
    for plan in plans:
        sched = build_schedule(plan)
        r = simulate(sched, plan, UniformCostModel(plan, forward=1.0, backward=1.0))
        assert r.iteration_time == unit_cost_makespan(sched)
    plan = multimodal(vision=2, audio=1, llm=2, microbatches=4, kind=kind)
    frozen = {("vision", 0): False, ("vision", 1): True, ("audio", 0): False, ("llm", 0): False, ("llm", 1): False}
    sched = build_schedule(plan, frozen)
    assert simulate(sched, plan, UniformCostModel(plan, forward=1.0, backward=1.0)).iteration_time == unit_cost_makespan(sched)


# ---- communication, grad sync, optimizer ----------------------------------------------------
def test_transfer_cost_on_two_stages():
    """1F1B, 2 stages, F=1 B=2, transfer t each way. M=2: s1 F0[1+t,2+t] B0[2+t,4+t] F1 B1[5+t,7+t];
    s0 B0 waits for the gradient until 4+2t, B1 until 7+2t: 9 + 2t. M=3: s0 runs F2 after B0, at
    6+2t, so s1 F2 starts at 7+3t and s0 B2 at 10+4t: 12 + 4t."""
    for t in (0.0, 0.25, 1.0, 3.0):
        assert run(chain(2, 2), forward=1.0, backward=2.0, transfer=t).iteration_time == pytest.approx(9 + 2 * t)
        assert run(chain(2, 3), forward=1.0, backward=2.0, transfer=t).iteration_time == pytest.approx(12 + 4 * t)


def test_link_contention_serialises_a_units_sends():
    """GPipe, 2 stages, M=2, F=1 B=2, t=3. Free links: activations arrive at 4 and 5, gradients
    (sent at 8 and 10) at 11 and 13: 15. One link per unit: the second activation waits for the
    first (arrives 7), gradients leave at 10 and 12 and arrive 13 and 16: 18."""
    plan = chain(2, 2, "gpipe")
    sched, cost = build_schedule(plan), UniformCostModel(plan, forward=1.0, backward=2.0, transfer=3.0)
    assert simulate(sched, plan, cost).iteration_time == 15.0
    assert simulate(sched, plan, cost, link_contention=True).iteration_time == 18.0


def test_gradient_transfer_uses_the_shape_of_the_forward_edge():
    """A gradient from llm.0 back to vision's last stage has the shape of vision's output."""
    seen = []

    class Recording(UniformCostModel):
        def transfer_time(self, src_unit, dst_unit, module, stage, work):
            seen.append((src_unit, dst_unit, module, stage, work.tokens))
            return 0.0

    plan = multimodal(vision=2, audio=0, llm=2, microbatches=2)
    work = [{"vision": Workload(10 + j), "llm": Workload(100 + j)} for j in range(2)]
    simulate(build_schedule(plan), plan, Recording(plan), work)
    v1, l0 = plan.unit_of("vision", 1, 0), plan.unit_of("llm", 0, 0)
    assert (v1, l0, "vision", 1, 10) in seen  # activation
    assert (l0, v1, "vision", 1, 10) in seen  # gradient, same shape
    assert (l0, plan.unit_of("llm", 1, 0), "llm", 0, 101) in seen


def test_a_message_without_rows_is_neither_sent_nor_awaited():
    """Audio (1 stage) and vision feeding a 1-stage LLM, 1F1B, 2 microbatches, F=1 B=2, messages
    of 1 s. Microbatch 0 has no audio: its audio activation and gradient have no rows, and the
    executor's communicator skips empty tensors (`P2PCommunicator.recv_shaped`), so the audio
    rank's receive of that gradient ends where it starts instead of waiting for the LLM's
    backward. Without workloads (sizes unknown) every message is awaited."""
    plan = multimodal(vision=1, audio=1, llm=1, microbatches=2)
    cost = UniformCostModel(plan, forward=1.0, backward=2.0, transfer=1.0)
    work = [{"vision": Workload(4), "audio": Workload(0), "llm": Workload(8)},
            {"vision": Workload(4), "audio": Workload(3), "llm": Workload(8)}]
    audio = plan.rank_of("audio", 0, 0)

    def gradient_receives(w):
        r = simulate(build_schedule(plan), plan, cost, w)
        return {e.microbatch: (e.start_s, e.end_s) for e in r.timeline if e.rank == audio and e.kind == "recv_grad"}

    grads = gradient_receives(work)
    assert grads[0][1] == pytest.approx(grads[0][0])
    assert grads[1][1] > grads[1][0] + 1.0  # microbatch 1's gradient comes after the LLM's backward
    unknown = gradient_receives(None)
    assert unknown[0][1] > unknown[0][0] + 1.0


def test_grad_sync_and_optimizer_add_once():
    """2 stages x 2 replicas, 4 microbatches (2 per replica): each replica's pipeline takes
    (2 + 1)(F + B) = 9; stage 0's replicas meet at 9, sync g, step o: 9 + g + o."""
    g, o = 0.75, 0.5
    plan = chain(2, 4, dp=2)
    r = run(plan, forward=1.0, backward=2.0, grad_sync=g, optimizer=o)
    assert r.iteration_time == pytest.approx(9 + g + o)
    for u in range(plan.num_units):
        assert r.sync[u] == pytest.approx(g)
        assert r.busy[u] == pytest.approx(2 * 3.0 + g + o)
        assert sum(e.kind == "grad_sync" for e in r.timeline if e.rank == r.first_rank[u]) == 1
    # one replica: nothing to synchronise, as the CostModel contract says
    assert run(chain(2, 2), forward=1.0, backward=2.0, grad_sync=g, optimizer=o).iteration_time == pytest.approx(9 + o)


def test_grad_sync_waits_for_the_slowest_replica():
    """One stage, two replicas; microbatch 0 (replica 0) has 1 token, microbatch 1 (replica 1) 3:
    replica 0 is done at 3, replica 1 at 9; both leave the sync at 9 + g."""
    g = 0.5
    plan = chain(1, 2, dp=2)
    cost = TokenCost(plan, grad_sync=g)
    work = {0: {"llm": Workload(1)}, 1: {"llm": Workload(3)}}
    r = simulate(build_schedule(plan), plan, cost, work)
    assert r.iteration_time == pytest.approx(9 + g)
    syncs = {e.rank: (e.start_s, e.end_s) for e in r.timeline if e.kind == "grad_sync"}
    assert syncs == {0: (3.0, 9 + g), 1: (9.0, 9 + g)}
    assert r.idle[0] == pytest.approx(6.0) and r.idle[1] == pytest.approx(0.0)
    # work as a list gives the same result; a missing microbatch is named
    assert simulate(build_schedule(plan), plan, cost, [work[0], work[1]]).iteration_time == r.iteration_time
    with pytest.raises(KeyError, match=r"\[1\]"):
        simulate(build_schedule(plan), plan, cost, {0: work[0]})


def test_samples_per_second_and_summary():
    plan = chain(2, 4)
    r = simulate(build_schedule(plan), plan, UniformCostModel(plan, activation=1.0), num_samples=30)
    assert r.samples_per_s == pytest.approx(30 / r.iteration_time)
    s = json.loads(json.dumps(r.summary(per_unit=True)))
    assert s["simulated"] is True and s["iteration_time_s"] == r.iteration_time and len(s["units"]) == 2
    assert r.mfu == 0.0  # no FLOPs declared


# ---- memory ------------------------------------------------------------------------------
@pytest.mark.parametrize("stages,microbatches", [(4, 8), (4, 4), (4, 2), (3, 7)])
def test_peak_memory_counts_microbatches_in_flight(stages, microbatches):
    """One byte per microbatch in flight, 10 static: 1F1B stage s holds min(S - s, M), GPipe M."""
    for kind in KINDS:
        r = run(chain(stages, microbatches, kind), activation=1.0, static=10.0)
        for s in range(stages):
            held = microbatches if kind == "gpipe" else min(stages - s, microbatches)
            assert r.peak_memory[s] == 10.0 + held


def test_peak_memory_without_backward_counts_one_forward():
    """A frozen encoder (no backward) frees each activation after its forward."""
    plan = multimodal(vision=1, audio=0, llm=2, microbatches=4, kind="gpipe")
    sched = build_schedule(plan, {("vision", 0): False, ("llm", 0): True, ("llm", 1): True})
    r = simulate(sched, plan, UniformCostModel(plan, activation={"vision": 5.0, "llm": 1.0}))
    assert r.peak_memory[plan.unit_of("vision", 0, 0)] == 5.0
    assert r.peak_memory[plan.unit_of("llm", 0, 0)] == 4.0


# ---- failures ----------------------------------------------------------------------------
def test_deadlock_is_reported_with_units_and_actions():
    """Each stage first waits for something only the other sends later."""
    plan = chain(2, 1)
    l0 = [Action(ActionKind.RECV_GRAD, "llm", 0, 0, 1, "llm", 1), Action(F, "llm", 0, 0),
          Action(ActionKind.SEND_ACT, "llm", 0, 0, 1, "llm", 1), Action(B, "llm", 0, 0)]
    l1 = [Action(ActionKind.RECV_ACT, "llm", 1, 0, 0, "llm", 0), Action(F, "llm", 1, 0), Action(B, "llm", 1, 0),
          Action(ActionKind.SEND_GRAD, "llm", 1, 0, 0, "llm", 0)]
    sched = Schedule("1f1b", 1, {0: l0, 1: l1})
    with pytest.raises(DeadlockError, match=r"unit 0 \(llm\.0 dp0\) waits at recvG llm\.0 mb0.*unit 1 \(llm\.1 dp0\) waits at recvA"):
        simulate(sched, plan, UniformCostModel(plan))


def test_grad_sync_deadlock_names_missing_replicas():
    plan = chain(1, 2, dp=2)
    sched = build_schedule(plan)
    # replica 1 waits for a message nobody sends, so replica 0 waits at its grad sync forever
    sched.actions[1].insert(0, Action(ActionKind.RECV_ACT, "llm", 0, 1, 0, "llm", 0))
    with pytest.raises(DeadlockError, match=r"unit 0 \(llm\.0 dp0\) waits at sync llm\.0 .* with 1 of 2 replicas arrived \(missing units \[1\]\)"):
        simulate(sched, plan, UniformCostModel(plan))


def test_schedule_of_another_plan_is_rejected():
    with pytest.raises(ValueError, match="pipeline units"):
        simulate(build_schedule(chain(3, 4)), chain(2, 4), UniformCostModel(chain(2, 4)))


# ---- timelines ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_timeline_is_consistent(kind, tmp_path):
    plan = multimodal(vision=2, audio=1, llm=3, microbatches=6, kind=kind, dp_enc=2)
    sched = build_schedule(plan)
    r = simulate(sched, plan, UniformCostModel(plan, transfer=0.3, grad_sync=0.5, optimizer=0.2), step=7)
    assert len(r.timeline) == sum(len(a) for a in sched.actions.values())
    by_rank: dict[int, list] = {}
    for e in r.timeline:
        by_rank.setdefault(e.rank, []).append(e)
        assert e.step == 7 and 0.0 <= e.start_s <= e.end_s <= r.iteration_time + 1e-12
    assert set(by_rank) == set(r.first_rank.values())
    for u, rank in r.first_rank.items():
        evs = by_rank[rank]
        assert [e.label for e in evs] == [a.short() for a in sched.actions[u]]  # program order
        for a, b in zip(evs, evs[1:]):
            assert a.end_s <= b.start_s + 1e-12  # a unit does one thing at a time
        compute = sum(e.duration_s for e in evs if e.kind in ("forward", "backward", "optimizer_step"))
        assert compute == pytest.approx(r.compute[u])
        assert evs[-1].end_s == pytest.approx(r.finish[u])
    assert max(e.end_s for e in r.timeline) == pytest.approx(r.iteration_time)

    path = r.to_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(r.timeline)
    assert any(e["ph"] == "M" and "vision.1 dp1" in e["args"]["name"] for e in trace["traceEvents"])


def test_gantt_png(tmp_path):
    pytest.importorskip("matplotlib")
    plan = multimodal(vision=2, audio=1, llm=2, microbatches=4)
    r = run(plan, transfer=0.1, grad_sync=0.3)
    for path in (r.plot_gantt(tmp_path / "sim.png"), plot_gantt(r.timeline, tmp_path / "raw.png", title="raw")):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    # encoders' compute in colours of its own, the LLM's and communication as they were
    kinds = {(e.module, e.kind) for e in chart_events(r.timeline)}
    assert {("vision", "encoder_forward"), ("audio", "encoder_backward"), ("llm", "forward")} <= kinds
    assert not any(m != "llm" and k in ("forward", "backward") for m, k in kinds)
    assert ("vision", "send_act") in kinds


# ---- scale -------------------------------------------------------------------------------
def test_1024_gpu_plan_simulates():
    """vision 2 stages x DP 8 x TP 4 (64) + audio 2 x 8 x 4 (64) + LLM 14 x 8 x 8 (896) = 1024
    GPUs, 144 pipeline units, 64 microbatches. Speed is a benchmark's business; this only
    checks the play completes and is sane at this size."""
    plan = Plan([ModuleSpec("vision", data_parallel=8, num_stages=2, tensor_parallel=4),
                 ModuleSpec("audio", data_parallel=8, num_stages=2, tensor_parallel=4),
                 ModuleSpec("llm", data_parallel=8, num_stages=14, tensor_parallel=8)],
                num_microbatches=64).resolve({"vision": 24, "audio": 24, "llm": 56})
    assert plan.world_size == 1024 and plan.num_units == 144
    sched = build_schedule(plan)
    cost = UniformCostModel(plan, forward={"vision": 0.5, "audio": 0.25, "llm": 1.0},
                            backward={"vision": 1.0, "audio": 0.5, "llm": 2.0}, transfer=0.05, grad_sync=1.0,
                            optimizer=0.1, activation=1.0)
    start = time.perf_counter()
    r = simulate(sched, plan, cost)
    elapsed = time.perf_counter() - start
    print(f"simulate(1024 GPUs, 144 units, 64 microbatches): {elapsed:.3f} s")
    # 8 microbatches per LLM pipeline over 16 stages on the longest path (vision/audio 2 + LLM 14)
    assert r.iteration_time >= (8 + 16 - 1) * 3.0
    assert 0.0 < r.bubble_fraction < 1.0
    assert len(r.timeline) == sum(len(a) for a in sched.actions.values())


# ---- the batch dispatch (loom.sim.dispatch) ------------------------------------------------
def _links(ranks_per_node: int = 2):
    from loom.cost.comm import Link
    from loom.sim.dispatch import Links

    # round numbers: intra 1 us + 1 ns/B, inter 10 us + 10 ns/B
    return Links(Link("intra", 1e9, 1e-6), Link("inter", 1e8, 1e-5), ranks_per_node)


def test_dispatch_runs_before_the_schedule_on_every_unit():
    from loom.sim.dispatch import DISPATCH, DispatchCost

    plan = multimodal(vision=2, audio=1, llm=3, microbatches=6, dp_enc=2)
    sched = build_schedule(plan)
    cost = UniformCostModel(plan, transfer=0.3, grad_sync=0.5, optimizer=0.2)
    base = simulate(sched, plan, cost)
    d = DispatchCost(gather=0.25, decide=0.5, payload={"vision": 0.125, "audio": 0.0, "llm": 0.0625})
    r = simulate(sched, plan, cost, dispatch=d)
    assert d.total == 0.9375
    assert r.dispatch == d.total and r.dispatch_parts is d
    assert r.iteration_time == pytest.approx(base.iteration_time + d.total)
    for u in base.finish:
        assert r.finish[u] == pytest.approx(base.finish[u] + d.total)
        assert r.busy[u] == pytest.approx(base.busy[u] + d.total)
        assert r.idle[u] == pytest.approx(base.idle[u])  # the dispatch is work, not a bubble
    assert len(r.timeline) == len(base.timeline) + len(base.first_rank) * len(d.parts())
    for u, rank in r.first_rank.items():
        evs = [e for e in r.timeline if e.rank == rank]
        head = evs[:len(d.parts())]
        assert [e.kind for e in head] == [DISPATCH] * 5
        assert [e.label for e in head] == ["gather metadata", "decide layout", "all-to-all vision",
                                           "all-to-all audio", "all-to-all llm"]
        assert head[0].start_s == 0.0 and head[-1].end_s == pytest.approx(d.total)
        assert evs[len(head)].start_s == pytest.approx(d.total)  # the schedule starts after it
    assert r.summary()["dispatch_s"] == d.total and r.summary()["dispatch"]["decide_s"] == 0.5


def test_all_to_all_prices_intra_and_inter_node_links():
    from loom.sim.dispatch import all_to_all_seconds, max_internode_send

    links = _links(ranks_per_node=2)
    zero = [[5e6, 0, 0, 0], [0, 7e6, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert all_to_all_seconds(zero, links) == 0.0  # bytes that stay home skip the collective
    intra = [[0, 1e6, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # rank 0 -> 1, one node
    inter = [[0, 0, 1e6, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # rank 0 -> 2, across nodes
    assert all_to_all_seconds(intra, links) == pytest.approx(1e-6 + 1e6 / 1e9)
    assert all_to_all_seconds(inter, links) == pytest.approx(1e-5 + 1e6 / 1e8)
    # the two links work at once; messages on one link share it
    both = [[0, 1e6, 1e6, 1e6], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert all_to_all_seconds(both, links) == pytest.approx(2 * (1e-5 + 1e6 / 1e8))
    # a receiver's column counts too: three senders into rank 3 share its inter-node link
    fan_in = [[0, 0, 0, 1e6], [0, 0, 0, 1e6], [0, 0, 0, 1e6], [0, 0, 0, 0]]
    assert all_to_all_seconds(fan_in, links) == pytest.approx(2 * (1e-5 + 1e6 / 1e8))
    assert max_internode_send(both, 2) == 2e6 and max_internode_send(intra, 2) == 0.0
    # the same bytes, permuted so they stay inside nodes (what node-wise rearrangement does), cost less
    assert all_to_all_seconds(intra, links) < all_to_all_seconds(inter, links)


def test_price_dispatch_parts_and_refusals():
    from loom.cost.comm import all_gather_time
    from loom.data.sample import AudioMeta, ImageMeta, SampleMeta
    from loom.cost.workload import HEADER, PER_SAMPLE
    from loom.sim.dispatch import (DispatchModelError, decision_seconds_model, metadata_bytes, price_dispatch)

    metas = [SampleMeta(0, 10), SampleMeta(1, 12, images=(ImageMeta(32, 32),) * 2),
             SampleMeta(2, 8, audios=(AudioMeta(16000, 16000),))]
    # the padded table the dispatcher gathers: ranks x (the header + 16 per sample of a shard)
    assert metadata_bytes(metas) == 8 * 1 * (HEADER + 16 * 3)
    assert metadata_bytes(metas, world_size=4) == 8 * 4 * (HEADER + 16 * 1)
    # a shard whose row (header, the per-sample fields, 2 per image) outgrows that takes a second round
    many = [SampleMeta(3, 40, images=(ImageMeta(32, 32),) * 10)] + metas
    assert metadata_bytes(many, world_size=4) == 8 * 4 * ((HEADER + 16 * 1) + (HEADER + PER_SAMPLE + 2 * 10))
    links = _links(ranks_per_node=2)
    payload = {"vision": np.array([[0, 0, 4e6, 0], [0] * 4, [0] * 4, [0] * 4], dtype=float),
               "llm": np.full((4, 4), 100.0)}
    d = price_dispatch(4, links, metadata_bytes=4096, decision_seconds=0.003, payload=payload)
    assert d.gather == pytest.approx(all_gather_time(4096, 4, links.inter))  # 4 ranks span 2 nodes
    assert d.decide == 0.003
    assert list(d.payload) == ["vision", "llm"] and d.payload["vision"] == pytest.approx(1e-5 + 4e6 / 1e8)
    assert d.payload_bytes == {"vision": 4e6, "llm": 1200.0} and d.internode_bytes["vision"] == 4e6
    assert d.total == pytest.approx(d.gather + d.decide + sum(d.payload.values()))
    one_node = price_dispatch(4, _links(ranks_per_node=4), metadata_bytes=4096, decision_seconds=0.0, payload=payload)
    assert one_node.total < d.total
    assert decision_seconds_model("none", 10_000) == 0.0
    assert decision_seconds_model({"vision": "orchmllm", "llm": "none"}, 2560 * 60) == pytest.approx(0.02119)
    with pytest.raises(DispatchModelError, match="payload\\['llm'\\] is 3 x 3"):
        price_dispatch(4, links, metadata_bytes=0, decision_seconds=0, payload={"llm": np.zeros((3, 3))})
    with pytest.raises(DispatchModelError, match="square"):
        price_dispatch(4, links, metadata_bytes=0, decision_seconds=0, payload={"llm": np.zeros(4)})
    with pytest.raises(DispatchModelError, match="decision_seconds"):
        price_dispatch(4, links, metadata_bytes=0, decision_seconds=-1, payload={})
    with pytest.raises(DispatchModelError, match="known"):
        decision_seconds_model("magic", 10)


