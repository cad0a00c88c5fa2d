"""Generators in the plan and the schedule IR (issue 11, part 3): modules after the LLM, the
DAG edges from the LLM's last stage to each generator and back, the multimodal 1F1B extended
past the LLM, frozen-aware backward, routed microbatches between different data-parallel
degrees; every schedule validates and plays without deadlock."""

from __future__ import annotations

import pytest

from loom.cost.uniform import UniformCostModel
from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.schedule.generators import backward_flow, build_schedule, pipeline_edges, warmup_count
from loom.schedule.ir import ActionKind
from loom.schedule.validate import validate_schedule
from loom.sim import simulate

COUNTS = {"vision": 4, "llm": 6, "image": 4}


def plan(llm_dp: int = 1, gen_dp: int = 1, gen_stages: int = 1, llm_stages: int = 2, mbs: int = 4,
         schedule: str = "1f1b") -> Plan:
    p = Plan([ModuleSpec("vision"), ModuleSpec("llm", num_stages=llm_stages, data_parallel=llm_dp),
              ModuleSpec("image", num_stages=gen_stages, data_parallel=gen_dp)], num_microbatches=mbs,
             schedule=schedule)
    return p.resolve(COUNTS, generators=["image"])


def test_the_llm_feeds_each_generator_and_the_warmup_spans_the_whole_path():
    p = plan(gen_stages=2)
    assert p.encoder_names == ["vision"] and p.generator_names == ["image"]
    assert pipeline_edges(p) == [(("vision", 0), ("llm", 0)), (("llm", 0), ("llm", 1)), (("llm", 1), ("image", 0)),
                                 (("image", 0), ("image", 1))]
    # 1 vision + 2 LLM + 2 generator stages: the path below each stage, minus one
    assert [warmup_count(p, st) for st in [("vision", 0), ("llm", 0), ("llm", 1), ("image", 0), ("image", 1)]] == \
        [4, 3, 2, 1, 0]
    assert p.world_size == 1 + 2 + 2 and p.role_of(4) == ("image", 1, 0)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("llm_dp,gen_dp", [(1, 1), (2, 1), (1, 2)])
def test_schedules_with_a_generator_validate_and_play(kind, llm_dp, gen_dp):
    p = plan(llm_dp, gen_dp, schedule=kind)
    sched = build_schedule(p)
    validate_schedule(sched, p)
    # the LLM's last stage sends its states to the generator and waits for their gradient
    last = [a for u, acts in sched.actions.items() for a in acts if (a.module, a.stage) == ("llm", 1)]
    sends = [a for a in last if a.kind is ActionKind.SEND_ACT]
    recvs = [a for a in last if a.kind is ActionKind.RECV_GRAD]
    assert len(sends) == len(recvs) == p.num_microbatches and {a.peer_module for a in sends} == {"image"}
    for a in sends:  # routed: microbatch j goes to the generator replica that runs j
        assert a.peer == p.unit_of("image", 0, p.replica_of_microbatch("image", a.microbatch))
    cost = UniformCostModel(p, forward=1.0, backward=2.0, backward_weight=1.0, transfer=0.1)
    result = simulate(sched, p, cost)
    assert result.iteration_time > 0


def test_a_frozen_generator_with_a_trainable_projector_sends_gradients_into_the_llm():
    """The generator's frozen layers still run their input-gradient pass (cornstarch.md
    §3.2.1's rule on the extended graph): the projector's and the LLM's gradients flow back
    through them."""
    p = plan(gen_stages=2)
    trainable = {("image", 1): False}  # the generator's layers frozen, its first stage (projector) trainable
    needs, edges = backward_flow(p, trainable)
    assert needs[("image", 0)] and needs[("image", 1)]
    assert {(("llm", 1), ("image", 0)), (("image", 0), ("image", 1))} <= edges
    sched = build_schedule(p, trainable)
    validate_schedule(sched, p)
    syncs = {(a.module, a.stage) for acts in sched.actions.values() for a in acts if a.kind is ActionKind.GRAD_SYNC}
    assert ("image", 0) in syncs and ("image", 1) not in syncs  # nothing to train there
    # the whole generator frozen: it still passes the LLM its gradient
    needs, edges = backward_flow(p, {("image", 0): False, ("image", 1): False})
    assert needs[("image", 1)] and (("llm", 1), ("image", 0)) in edges
    # everything frozen: no backward anywhere
    frozen = {st: False for st in [("vision", 0), ("llm", 0), ("llm", 1), ("image", 0), ("image", 1)]}
    needs, edges = backward_flow(p, frozen)
    assert not any(needs.values()) and not edges


def test_generators_are_refused_where_they_cannot_run():
    p = Plan([ModuleSpec("vision"), ModuleSpec("llm"), ModuleSpec("image")], num_microbatches=2,
             placement="first_stage")
    with pytest.raises(PlanError, match="generators \\['image'\\].*disaggregated"):
        p.resolve(COUNTS, generators=["image"])
    p = Plan([ModuleSpec("image"), ModuleSpec("llm"), ModuleSpec("vision")], num_microbatches=2)
    with pytest.raises(PlanError, match="are generators, but the model's generators are \\['image'\\]"):
        p.resolve(COUNTS, generators=["image"])



@pytest.mark.parametrize("llm_dp,gen_dp,kind", [(2, 2, "1f1b"), (2, 1, "1f1b"), (1, 2, "1f1b"), (2, 2, "gpipe"),
                                                 (2, 2, "zb-h1")])
def test_a_generator_rearranged_on_its_own_gets_routed_rows_in_its_round(llm_dp, gen_dp, kind):
    """OrchMLLM's and Entrain's generator phase (`loom.balance.policy.generator_slots`): each
    round's samples rebalanced over the round's generator slots by their generator cost, the
    LLM's last stage sending each generator microbatch its samples' rows; the schedule
    validates and plays, and a generator route out of its round is refused by name."""
    import numpy as np

    from loom.balance.orchmllm import slot_arrays
    from loom.balance.policy import generator_slots
    from loom.schedule.layout import BatchLayout, LayoutError, contiguous_layout, round_size

    p = plan(llm_dp=llm_dp, gen_dp=gen_dp, llm_stages=2, mbs=4, schedule=kind)
    n = 12
    base = contiguous_layout(n, 4, p.module_names)
    work = np.array([5.0, 0, 0, 9, 1, 0, 7, 0, 3, 0, 0, 2])  # the generator's cost per sample
    index = generator_slots(base, p, work, "image")
    r = round_size(p)
    assert (index // r == base.slot_index("llm") // r).all()  # every sample stays in its round
    arrays = {**base.arrays, "image": slot_arrays(index, 4)}
    layout = BatchLayout(None, {m: "orchmllm" for m in p.module_names}, arrays=arrays)
    layout.check(n, p.module_names)
    layout.check_routes(p)
    assert not layout.shares_llm_slots("image")
    s = build_schedule(p, layout=layout, kind=kind)
    validate_schedule(s, p)
    routed = [a for acts in s.actions.values() for a in acts if a.module == "llm" and a.peer_module == "image"]
    assert routed and all(a.samples is not None for a in routed)
    simulate(s, p, UniformCostModel(p, forward=1.0, backward=2.0, backward_weight=1.0, transfer=0.1))
    assert r == 2  # rounds of 2 slots: sample 0 (round 0) into slot 3 (round 1)
    moved = index.copy()
    moved[0] = 3
    bad = BatchLayout(None, {m: "orchmllm" for m in p.module_names},
                      arrays={**base.arrays, "image": slot_arrays(moved, 4)})
    with pytest.raises(LayoutError, match="a generator's routes must stay in the round"):
        bad.check_routes(p)


def test_the_encoders_entry_of_balance_policy_does_not_name_a_generator():
    from loom.balance.config import BalanceConfig

    config = BalanceConfig(default="none", policy={"encoders": "orchmllm"})
    assert config.summary(["vision", "llm", "image"]) == {"vision": "orchmllm", "llm": "none", "image": "none"}
    config = BalanceConfig(default="none", policy={"encoders": "orchmllm", "image": "orchmllm"})
    assert config.summary(["vision", "llm", "image"])["image"] == "orchmllm"


def test_a_plan_refuses_what_a_generator_cannot_run():
    """Refused by `Plan.resolve`, so the runtime and the simulator refuse the same plans."""
    counts = {"vision": 5, "llm": 7, "image": 4}
    base = [ModuleSpec("vision"), ModuleSpec("llm", num_stages=2), ModuleSpec("image")]
    for modules, field in (
        ([*base[:2], ModuleSpec("image", context_parallel=2)], "modules['image'].context_parallel"),
        ([*base[:2], ModuleSpec("image", num_stages=4, virtual_stages=2)], "modules['image'].virtual_stages"),
        ([*base[:2], ModuleSpec("image", data_parallel=2, tensor_parallel=2, zero_stage=2)],
         "modules['image'].zero_stage"),
    ):
        with pytest.raises(PlanError, match=field.replace("[", r"\[").replace("]", r"\]")):
            Plan(modules).resolve(counts, generators=["image"])
