"""ZB-H1, the zero-bubble schedule (Qi et al., "Zero Bubble Pipeline Parallelism", §3.1): the IR's
split backward (``BACKWARD_INPUT`` then a deferred ``BACKWARD_WEIGHT``), its generator on the
multimodal DAG, the validator's order rules, the simulator's pricing of the two parts, and the
executor's split autograd passes. The reference semantics on gloo (loss and every gradient
against the single process) run in tests/test_parallel_reference.py's multimodal launch (cases
``multimodal_zb-h1`` and ``frozen_encoders_zb-h1``)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from loom.cost.analytic import AnalyticCostModel
from loom.cost.hardware import Cluster
from loom.cost.uniform import UniformCostModel
from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError
from loom.schedule import (
    Action,
    ActionKind,
    ScheduleError,
    backward_flow,
    build_schedule,
    validate_schedule,
)
from loom.runtime.split_backward import backward_input, backward_weight
from loom.schedule.layout import BatchLayout
from loom.sim import simulate

from plans import multimodal
from test_cost import WORK, small_arch, small_plan

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
BI, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
GRAD_SYNC = ActionKind.GRAD_SYNC


def chain(stages: int, microbatches: int, kind: str = "zb-h1", dp: int = 1) -> Plan:
    return Plan([ModuleSpec(LLM, data_parallel=dp, num_stages=stages)], num_microbatches=microbatches,
                schedule=kind).resolve({LLM: 8})


def uniform(plan: Plan, **kw) -> UniformCostModel:
    """F = 1, B = 2 of which W = 1: the zero-bubble paper's T_F = T_B = T_W."""
    return UniformCostModel(plan, **{"forward": 1.0, "backward": 2.0, "backward_weight": 1.0, **kw})


# ---- the generator -----------------------------------------------------------------------
def test_split_only_where_both_parts_exist():
    """A stage splits its backward iff it holds trainable parameters and sends an input
    gradient back; an encoder's first stage (no input gradient) keeps one BACKWARD, a frozen
    stage that only passes gradients keeps one BACKWARD and has no weight action."""
    plan = multimodal(vision=2, audio=1, llm=2, microbatches=4, kind="zb-h1")
    cases = [None, {("vision", 0): False, ("vision", 1): True, ("llm", 0): False, ("llm", 1): False}]
    for trainable in cases:
        sched = build_schedule(plan, trainable)
        validate_schedule(sched, plan)
        needs, grad_edges = backward_flow(plan, trainable)
        for u, acts in sched.actions.items():
            m, s, _ = plan.role_of_unit(u)
            kinds = {a.kind for a in acts}
            trains = trainable is None or trainable.get((m, s), True)
            sends_back = any(dst == (m, s) for _, dst in grad_edges)
            if needs[(m, s)] and trains and sends_back:
                assert BI in kinds and W in kinds and B not in kinds, (m, s)
            else:
                assert BI not in kinds and W not in kinds, (m, s)
                assert (B in kinds) == needs[(m, s)], (m, s)


@pytest.mark.parametrize("stages,microbatches,dp", [(2, 4, 1), (3, 6, 1), (4, 8, 1), (4, 3, 1), (3, 8, 2)])
def test_weight_passes_follow_their_input_pass_and_precede_the_sync(stages, microbatches, dp):
    sched = build_schedule(chain(stages, microbatches, dp=dp))
    for u, acts in sched.actions.items():
        pos = {(a.kind, a.microbatch): i for i, a in enumerate(acts)}
        mbs = [a.microbatch for a in acts if a.kind is F]
        if not any(a.kind is BI for a in acts):  # the first stage: no input gradient to send
            continue
        for j in mbs:
            assert pos[(BI, j)] < pos[(W, j)] < pos[(GRAD_SYNC, -1)]
            # the gradient leaves right after the input pass, before any weight pass of it
            assert pos[(SEND_GRAD, j)] == pos[(BI, j)] + 1
        backward_work = [a for a in acts if a.kind in (BI, W)]
        assert backward_work[-1].kind is W


def test_input_passes_keep_one_f_one_b_order_and_weights_lag_by_the_stage_position():
    """The forwards and input passes come in 1F1B's order; stage ``s`` of a chain runs the
    weight pass of its ``i``-th backward after its ``(i + s)``-th input pass, the last ones at
    the end."""
    stages, m = 4, 8
    zb = build_schedule(chain(stages, m))
    one = build_schedule(chain(stages, m, kind="1f1b"))
    for u in zb.actions:
        order = [(a.kind if a.kind is F else B, a.microbatch) for a in zb.actions[u] if a.kind in (F, B, BI)]
        assert order == [(a.kind, a.microbatch) for a in one.actions[u] if a.kind in (F, B)]
    for s in range(1, stages):
        work = [(a.kind, a.microbatch) for a in zb.actions[s] if a.kind in (BI, W)]
        for i in range(m):
            after = work.index((BI, min(i + s, m - 1)))
            assert work.index((W, i)) > after
            assert all(k is W for k, _ in work[after + 1:work.index((W, i)) + 1])
    labels = [a.short() for a in zb.actions[2] if a.kind in (BI, W)]
    assert labels[:5] == ["BI llm.2 mb0", "BI llm.2 mb1", "BI llm.2 mb2", "W llm.2 mb0", "BI llm.2 mb3"]
    assert labels[-4:] == ["BI llm.2 mb7", "W llm.2 mb5", "W llm.2 mb6", "W llm.2 mb7"]


def test_deferred_encoder_gradients_are_refused():
    """A balanced layout that defers an encoder microbatch's gradients to a later round (Entrain's
    split backward) is refused under zb-h1, naming plan.schedule."""
    plan = multimodal(vision=1, audio=0, llm=1, microbatches=2, kind="zb-h1")
    layout = BatchLayout({"vision": ((0, 2), (1, 3)), LLM: ((0, 1), (2, 3))})
    with pytest.raises(PlanError, match="plan.schedule = 'zb-h1'"):
        build_schedule(plan, layout=layout)
    validate_schedule(build_schedule(plan, layout=layout, kind="1f1b"), dataclasses.replace(plan, schedule="1f1b"))


def test_plan_accepts_zb_h1():
    assert chain(2, 4).schedule == "zb-h1"
    with pytest.raises(PlanError, match="zb-h1"):
        Plan([ModuleSpec(LLM)], schedule="zb-h2").resolve({LLM: 4})


# ---- the validator -----------------------------------------------------------------------
def _zb_chain() -> tuple[Plan, list[Action], list[Action]]:
    plan = chain(2, 2)
    sched = build_schedule(plan)
    return plan, sched.actions[0], sched.actions[1]


def _replace(acts: list[Action], old: Action, new: Action | None) -> list[Action]:
    return [new if a == old else a for a in acts if not (a == old and new is None)]


def _check(plan: Plan, a0: list[Action], a1: list[Action]) -> None:
    from loom.schedule.ir import Schedule
    validate_schedule(Schedule("zb-h1", 2, {0: a0, 1: a1}), plan)


def test_rejects_weight_before_input_pass():
    plan, a0, a1 = _zb_chain()
    i, w = a1.index(Action(BI, LLM, 1, 1)), a1.index(Action(W, LLM, 1, 1))
    a1[i], a1[w] = a1[w], a1[i]
    with pytest.raises(ScheduleError, match="weight pass before its input pass"):
        _check(plan, a0, a1)


def test_rejects_grad_sync_before_a_weight_pass():
    plan, a0, a1 = _zb_chain()
    w = Action(W, LLM, 1, 1)
    a1 = _replace(a1, w, None)
    a1.insert(len(a1) - 1, w)  # after the sync, before the step
    with pytest.raises(ScheduleError, match=r"sync llm\.1: before the rank's last backward"):
        _check(plan, a0, a1)


def test_rejects_input_pass_without_weight_pass():
    plan, a0, a1 = _zb_chain()
    with pytest.raises(ScheduleError, match="one backward_input then one backward_weight"):
        _check(plan, a0, _replace(a1, Action(W, LLM, 1, 0), None))


def test_rejects_mixing_whole_and_split_backward():
    plan, a0, a1 = _zb_chain()
    with pytest.raises(ScheduleError, match="one backward_input then one backward_weight"):
        _check(plan, a0, _replace(a1, Action(W, LLM, 1, 0), Action(B, LLM, 1, 0)))


def test_rejects_gradient_sent_before_the_input_pass():
    plan, a0, a1 = _zb_chain()
    send = next(a for a in a1 if a.kind is SEND_GRAD and a.microbatch == 0)
    a1 = _replace(a1, send, None)
    a1.insert(a1.index(Action(BI, LLM, 1, 0)), send)
    with pytest.raises(ScheduleError, match="send before the backward that produces it"):
        _check(plan, a0, a1)


# ---- the simulator -----------------------------------------------------------------------
def test_parts_are_priced_by_their_phase():
    plan = chain(2, 3)
    r = simulate(build_schedule(plan), plan, uniform(plan, backward={(LLM, 0): 2.0, (LLM, 1): 3.0},
                                                      backward_weight={(LLM, 0): 1.0, (LLM, 1): 0.5}))
    durations = {(e.kind, e.stage): e.end_s - e.start_s for e in r.timeline if e.kind.startswith("backward")}
    assert durations == {("backward", 0): 2.0, ("backward_input", 1): 2.5, ("backward_weight", 1): 0.5}


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 4), (4, 8), (3, 12), (5, 10)])
def test_bubble_falls_against_one_f_one_b(stages, microbatches):
    """With T_F = T_B = T_W the same work takes less time: the input gradients climb the
    pipeline sooner and the weight passes fill the waits. On a chain it meets the paper's
    ZB-H1 figure: M (F + B) + (S - 1)(T_F + T_B - T_W) (zero-bubble §3.1; B = T_B + T_W)."""
    results = {}
    for kind in ("1f1b", "zb-h1"):
        plan = chain(stages, microbatches, kind)
        results[kind] = simulate(build_schedule(plan), plan, uniform(plan))
    one, zb = results["1f1b"], results["zb-h1"]
    assert one.iteration_time == pytest.approx((microbatches + stages - 1) * 3.0)  # 1F1B's closed form
    assert zb.iteration_time < one.iteration_time
    assert zb.iteration_time == pytest.approx(microbatches * 3.0 + (stages - 1) * (1.0 + 1.0 - 1.0))
    assert zb.bubble_fraction < one.bubble_fraction
    for u in zb.busy:  # the same work on every unit, only placed otherwise
        assert zb.busy[u] == pytest.approx(one.busy[u]) == pytest.approx(microbatches * 3.0)


def test_bubble_falls_on_the_multimodal_dag_frozen_or_not():
    trainables = [None, {("vision", 0): False, ("vision", 1): True, ("audio", 0): False}]
    for trainable, dp in itertools.product(trainables, [(1, 1), (2, 1)]):
        times = {}
        for kind in ("1f1b", "zb-h1"):
            plan = multimodal(vision=2, audio=1, llm=3, microbatches=8, dp_enc=dp[0], dp_llm=dp[1], kind=kind)
            sched = build_schedule(plan, trainable)
            validate_schedule(sched, plan)
            times[kind] = simulate(sched, plan, uniform(plan)).iteration_time
        assert times["zb-h1"] < times["1f1b"], (trainable, dp, times)


def test_memory_peak_is_one_f_one_b_s():
    """A microbatch is held from its forward to its weight pass: stage ``s`` holds 1F1B's
    ``S - s`` plus its lag ``s``, i.e. ``S``: the first stage's 1F1B peak, which ZB-H1 keeps
    (zero-bubble §3.1), never more (capped by the microbatch count)."""
    for stages, microbatches in [(4, 8), (3, 3), (2, 6), (4, 2)]:
        peaks = {}
        for kind in ("1f1b", "zb-h1"):
            plan = chain(stages, microbatches, kind)
            peaks[kind] = simulate(build_schedule(plan), plan, uniform(plan, activation=1.0)).peak_memory
        for u in peaks["1f1b"]:
            assert peaks["1f1b"][u] <= peaks["zb-h1"][u] <= min(stages, microbatches)
        assert max(peaks["zb-h1"].values()) == max(peaks["1f1b"].values())


def test_uniform_model_needs_the_weight_part():
    plan = chain(2, 2)
    with pytest.raises(ValueError, match="backward_weight is not set"):
        simulate(build_schedule(plan), plan, UniformCostModel(plan))


def test_analytic_parts_sum_to_the_backward():
    """The analytic model's two parts are the layers' backward-input and backward-weight costs
    (recompute with the input part), and sum to the whole backward."""
    cost = AnalyticCostModel(small_arch(), small_plan(recompute="full"), Cluster("A100-80GB", 8))
    for module, work in WORK.items():
        whole = cost.stage_time(module, 0, "backward", work)
        parts = [cost.stage_time(module, 0, p, work) for p in ("backward_input", "backward_weight")]
        assert whole > 0 and sum(parts) == pytest.approx(whole)
        assert parts == [cost.phase_time(module, 0, p, work) for p in ("backward_input", "backward_weight")]


def test_refused_combinations_name_the_schedule():
    with pytest.raises(PlanError, match=r"plan.schedule = 'zb-h1' with plan.modules\['llm'\].context_parallel = 2"):
        Plan([ModuleSpec(LLM, num_stages=2, context_parallel=2)], num_microbatches=4, schedule="zb-h1").resolve({LLM: 4})
    for zero in (1, 2, 3):  # ZeRO runs under zb-h1 (tests/test_zero.py's pipelined cases)
        Plan([ModuleSpec(LLM, num_stages=2, data_parallel=2, zero_stage=zero)], num_microbatches=4,
             schedule="zb-h1").resolve({LLM: 4})


# ---- the split autograd passes (loom.runtime.split_backward) -----------------------------
class _Stage(torch.nn.Module):
    """A stage with an embedding merged into the received activation, a block used twice
    (optionally checkpointed, optionally with tied weights), a frozen layer between, and
    optionally the loss."""

    def __init__(self, tie: bool, recompute: bool, loss: bool):
        super().__init__()
        self.l1, self.l2, self.norm = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
        self.emb, self.frozen = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        if tie:
            self.l2.weight = self.l1.weight
        self.recompute, self.loss = recompute, loss

    def block(self, h):
        return h + torch.tanh(self.l2(torch.relu(self.l1(self.norm(h)))))

    def forward(self, x, ids, use_x):
        h = self.emb(ids) + (x if use_x else 0)
        for layer in (self.block, self.frozen, self.block):
            h = checkpoint(layer, h, use_reentrant=False) if self.recompute and layer != self.frozen else layer(h)
        return (h ** 2).sum() if self.loss else h


@pytest.mark.parametrize("tie,recompute,loss,use_x", list(itertools.product([False, True], repeat=4)))
def test_input_then_weight_pass_equals_one_backward(tie, recompute, loss, use_x):
    """The input pass gives the input its gradient and no parameter any; the weight pass then
    gives every parameter exactly the gradient of one whole backward (an input the output does
    not use, a layer used twice, tied weights, recompute, the loss)."""
    torch.manual_seed(0)
    m = _Stage(tie, recompute, loss)
    ids, x = torch.randint(0, 10, (4,)), torch.randn(4, 8)
    g = None if loss else torch.randn(4, 8)
    x1 = x.clone().requires_grad_()
    torch.autograd.backward(m(x1, ids, use_x), g)
    ref = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    x2 = x.clone().requires_grad_()
    wp = backward_input(m(x2, ids, use_x), g, [x2])
    assert all(p.grad is None for p in m.parameters())
    if use_x:
        torch.testing.assert_close(x2.grad, x1.grad)
    backward_weight(wp)
    got = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


def test_split_passes_on_transformer_layers():
    """Attention's packed in-projection and the feed-forward: parameter groups that merge (a
    parameter reaching several boundaries) still give one backward's gradients."""
    torch.manual_seed(1)
    layers = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
                                   for _ in range(2)])
    x, g = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    x1 = x.clone().requires_grad_()
    torch.autograd.backward(layers(x1), g)
    ref = {n: p.grad.clone() for n, p in layers.named_parameters()}
    layers.zero_grad(set_to_none=True)
    x2 = x.clone().requires_grad_()
    backward_weight(backward_input(layers(x2), g, [x2]))
    torch.testing.assert_close(x2.grad, x1.grad)
    for n, p in layers.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)
