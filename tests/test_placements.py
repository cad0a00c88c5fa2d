"""Placements beside ``disaggregated`` (issue 10): ``first_stage`` (Megatron-LM's layout, the
encoders inside the LLM's first pipeline position) and ``colocated`` (one replica of each
encoder on every LLM rank). Ranks and units, the schedule (local handoffs, order), the
refusals, and the simulator. The reference semantics on gloo are in
tests/test_parallel_reference.py (``first_stage``, ``first_stage_dp2_interleaved``,
``colocated_interleaved``, ``colocated_dp2``) and tests/test_tensor_parallel.py
(``first_stage_tp2``)."""

from __future__ import annotations

import re

import pytest

from loom.cost.model import Workload
from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.schedule.generators import build_schedule
from loom.schedule.ir import ActionKind
from loom.schedule.layout import BatchLayout
from loom.schedule.validate import ScheduleError, unit_cost_makespan, validate_schedule

LAYERS = {"vision": 3, "audio": 3, "llm": 8}


def _plan(dp: int = 1, stages: int = 2, virtual: int = 1, microbatches: int = 4, schedule: str = "1f1b") -> Plan:
    plan = Plan([ModuleSpec("vision", data_parallel=dp), ModuleSpec("audio", data_parallel=dp),
                 ModuleSpec("llm", num_stages=stages, data_parallel=dp, virtual_stages=virtual)],
                num_microbatches=microbatches, schedule=schedule, placement="first_stage")
    return plan.resolve(LAYERS)


def test_encoders_live_on_the_llms_first_position() -> None:
    plan = _plan(dp=2)
    assert plan.world_size == 4 and plan.num_units == 4  # the LLM's ranks only
    assert plan.stages_of(1) == [("vision", 0, 1), ("audio", 0, 1), ("llm", 0, 1)]
    assert plan.stages_of(3) == [("llm", 1, 1)]
    assert [plan.rank_of("audio", 0, r) for r in range(2)] == [0, 1] == [plan.rank_of("llm", 0, r) for r in range(2)]
    assert plan.unit_of("vision", 0, 1) == plan.unit_of("llm", 0, 1)
    assert plan.rank_offset("vision") == plan.rank_offset("llm") == 0
    assert [plan.role_of(r)[0] for r in range(4)] == ["llm"] * 4
    assert plan.mesh_shape("vision") == (1, 2, 1, 1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_schedule_hands_off_inside_the_unit(schedule: str) -> None:
    """Encoder outputs go to the LLM's first stage on the same unit (a local handoff, the unit
    its own peer); each encoder forwards microbatch j right before that stage does and runs its
    backward right after that stage's."""
    plan = _plan(dp=2, schedule=schedule)
    sched = build_schedule(plan)
    validate_schedule(sched, plan)
    for unit in (0, 1):
        acts = sched.actions[unit]
        sends = [a for a in acts if a.kind is ActionKind.SEND_ACT and a.module != "llm"]
        assert sends and all(a.peer == unit and (a.peer_module, a.peer_stage) == ("llm", 0) for a in sends)
        compute = [(a.kind, a.module, a.microbatch) for a in acts if a.kind is ActionKind.FORWARD]
        for j in plan.microbatches_of("llm", unit):
            i = compute.index((ActionKind.FORWARD, "llm", j))
            assert compute[i - 2:i] == [(ActionKind.FORWARD, "vision", j), (ActionKind.FORWARD, "audio", j)]
        kinds = [(a.kind, a.module, a.microbatch) for a in acts]
        llm_back = next(i for i, k in enumerate(kinds) if k[1] == "llm" and k[0] in (ActionKind.BACKWARD,
                                                                                      ActionKind.BACKWARD_INPUT))
        assert kinds.index((ActionKind.BACKWARD, "vision", kinds[llm_back][2])) > llm_back
    # the other position holds the LLM only
    assert {a.module for a in sched.actions[2]} == {"llm"}


def test_interleaved_first_position_hosts_encoders_and_chunks() -> None:
    plan = _plan(stages=4, virtual=2)
    sched = build_schedule(plan)
    validate_schedule(sched, plan)
    assert {(a.module, a.stage) for a in sched.actions[0]} == {("vision", 0), ("audio", 0), ("llm", 0), ("llm", 2)}
    assert unit_cost_makespan(sched) > 0


def test_balanced_layouts_are_refused() -> None:
    plan = Plan([ModuleSpec("vision"), ModuleSpec("llm", num_stages=2)], num_microbatches=2,
                placement="first_stage").resolve({"vision": 3, "llm": 8})
    layout = BatchLayout(slots={"vision": [(1,), (0,)], "llm": [(0,), (1,)]})
    with pytest.raises(PlanError, match="plan.placement = 'first_stage'.*balance.default = 'none'"):
        build_schedule(plan, layout=layout)


@pytest.mark.parametrize("vision,llm,words", [
    (dict(num_stages=2), {}, "plan.modules['vision'].num_stages = 2 must be 1"),
    (dict(data_parallel=2), dict(data_parallel=1), "plan.modules['vision'].data_parallel = 2 must be 1"),
    (dict(tensor_parallel=2), {}, "plan.modules['vision'].tensor_parallel = 2 must be 1"),
    ({}, dict(context_parallel=2), "plan.modules['llm'].context_parallel = 2 is not supported yet"),
    (dict(data_parallel=2, zero_stage=3), dict(data_parallel=2, zero_stage=3),
     "plan.modules['llm'].zero_stage = 3 is not supported yet"),
])
def test_bad_first_stage_plans_name_the_field(vision: dict, llm: dict, words: str) -> None:
    plan = Plan([ModuleSpec("vision", **vision), ModuleSpec("llm", num_stages=2, **llm)], num_microbatches=4,
                placement="first_stage")
    with pytest.raises(PlanError, match=re.escape(words)):
        plan.resolve({"vision": 3, "llm": 8})


def test_world_size_counts_the_llms_ranks() -> None:
    plan = Plan([ModuleSpec("vision"), ModuleSpec("llm", num_stages=2)], num_microbatches=4, placement="first_stage")
    with pytest.raises(PlanError, match="plan needs 2 ranks"):
        plan.resolve({"vision": 3, "llm": 8}, world_size=3)


def test_simulator_prices_first_stage() -> None:
    """`loom simulate --compare`'s first-stage plan: every rank in the LLM's pipeline, the
    encoder's parameters and activations on its first position, the handoff free."""
    from loom.planner.baselines import first_stage_plan, megatron_plan
    from loom.sim.scenario import load_scenario

    scenario = load_scenario("configs/sim/llama3-70b-vith-1024xh100.toml",
                             ["cluster.num_gpus=128", "parallel.data_parallel=2", "parallel.microbatches_per_pipeline=8",
                              "data.global_batch_size=64"])
    plan, separate = first_stage_plan(scenario), megatron_plan(scenario)
    assert plan.world_size == 128 and plan.spec("llm").num_stages == 8 and separate.spec("llm").num_stages == 7
    result = scenario.run(plan)
    first = plan.unit_of("llm", 0, 0)
    vision = [e for e in result.timeline if e.module == "vision" and e.kind == "forward"]
    assert vision and {e.rank for e in vision} == {plan.rank_of("llm", 0, r) for r in range(2)}
    cost = scenario.cost_model(plan)
    assert cost.transfer_time(first, first, "vision", 0, Workload(tokens=256)) == 0.0  # a local handoff
    assert cost.transfer_time(first, plan.unit_of("llm", 1, 0), "llm", 0, Workload(tokens=256)) > 0
    second = plan.unit_of("llm", 1, 0)
    assert result.peak_memory[first] > result.peak_memory[second]  # the encoder lives there too


# ---- colocated ----------------------------------------------------------------------------------
def _colocated(schedule: str = "1f1b", virtual: int = 1) -> Plan:
    plan = Plan([ModuleSpec("vision", data_parallel=4), ModuleSpec("audio", data_parallel=4),
                 ModuleSpec("llm", num_stages=2 * virtual, data_parallel=2, virtual_stages=virtual)],
                num_microbatches=8, schedule=schedule, placement="colocated")
    return plan.resolve(LAYERS)


def test_colocated_puts_an_encoder_replica_on_every_rank() -> None:
    plan = _colocated()
    assert plan.world_size == 4 and plan.num_units == 4
    assert plan.stages_of(2) == [("vision", 0, 2), ("audio", 0, 2), ("llm", 1, 0)]
    assert [plan.rank_of("vision", 0, r) for r in range(4)] == [0, 1, 2, 3]
    assert [plan.unit_of("audio", 0, r) for r in range(4)] == [0, 1, 2, 3]
    assert plan.mesh_shape("vision") == (1, 4, 1, 1)


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("1f1b", 2)])
def test_colocated_encoders_wrap_the_llm_order(schedule: str, virtual: int) -> None:
    """Each rank forwards its encoder microbatches first and runs their backwards after its
    last LLM work (Optimus's coarse rule); encoder outputs reach the LLM's first stage on
    whichever rank runs that microbatch, locally or not."""
    plan = _colocated(schedule, virtual)
    sched = build_schedule(plan)
    validate_schedule(sched, plan)
    for unit in range(4):
        compute = [(a.kind, a.module, a.microbatch) for a in sched.actions[unit]
                   if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                                 ActionKind.BACKWARD_WEIGHT)]
        mine = plan.microbatches_of("vision", unit)
        assert compute[:4] == [(ActionKind.FORWARD, m, j) for j in mine for m in ("vision", "audio")]
        assert compute[-4:] == [(ActionKind.BACKWARD, m, j) for j in mine for m in ("vision", "audio")]
    sends = [(u, a.peer) for u, acts in sched.actions.items() for a in acts
             if a.kind is ActionKind.SEND_ACT and a.module == "vision"]
    assert any(u == p for u, p in sends) and any(u != p for u, p in sends)  # local and remote handoffs


@pytest.mark.parametrize("vision,llm,words", [
    (dict(data_parallel=2), {}, "plan.modules['vision'].data_parallel = 2 must be 4"),
    (dict(data_parallel=4, num_stages=2), {}, "plan.modules['vision'].num_stages = 2 must be 1"),
    (dict(data_parallel=4, tensor_parallel=2), {}, "plan.modules['vision'].tensor_parallel = 2 must be 1"),
    (dict(data_parallel=2, tensor_parallel=4), dict(data_parallel=1, tensor_parallel=2),
     "plan.modules['vision'].tensor_parallel = 4 must be 2"),
    (dict(data_parallel=1), dict(data_parallel=1, tensor_parallel=2), "plan.modules['vision'].data_parallel = 1 must be 4"),
    (dict(data_parallel=4), dict(context_parallel=2), "plan.modules['llm'].context_parallel = 2"),
    (dict(data_parallel=4, zero_stage=1), dict(zero_stage=1), "plan.modules['llm'].zero_stage = 1"),
])
def test_bad_colocated_plans_name_the_field(vision: dict, llm: dict, words: str) -> None:
    spec = {"num_stages": 2, "data_parallel": 2, **llm}
    plan = Plan([ModuleSpec("vision", **vision), ModuleSpec("llm", **spec)], num_microbatches=4,
                placement="colocated")
    with pytest.raises(PlanError, match=re.escape(words)):
        plan.resolve({"vision": 3, "llm": 8})


def test_an_encoder_at_tp_1_beside_a_tp_2_llm_runs_in_lanes() -> None:
    """Colocated vision at TP 1 x DP 8 beside an LLM at TP 2 x PP 2 x DP 2 (issue 10's example):
    one replica per rank, the two of a unit sharing each of its microbatches (`Plan.lanes`);
    the IR addresses the unit, payloads go to its leader, the cost model prices a lane's share.
    The reference semantics on gloo are tests/test_tensor_parallel.py's ``colocated_lanes``."""
    from loom.balance.config import BalanceConfig, BalanceError, check_balance_config
    from loom.balance.payload import slot_destinations
    from loom.cost.model import Workload

    plan = Plan([ModuleSpec("vision", data_parallel=8), ModuleSpec("llm", num_stages=2, data_parallel=2,
                                                                      tensor_parallel=2)],
                num_microbatches=8, placement="colocated").resolve({"vision": 3, "llm": 8})
    assert plan.world_size == 8 and plan.lanes("vision") == 2 and plan.lanes("llm") == 1
    assert [plan.replica_of_microbatch("vision", j) for j in range(8)] == [0, 2, 4, 6] * 2
    assert [plan.unit_of("vision", 0, r) for r in (0, 2, 4, 6)] == [0, 1, 2, 3]
    assert plan.stages_of(5) == [("vision", 0, 4), ("llm", 1, 0)]  # rank 5: unit 2's second lane
    assert slot_destinations(plan, "vision", 8).ravel().tolist() == [0, 2, 4, 6] * 2  # the units' leaders
    validate_schedule(build_schedule(plan), plan)
    assert Workload(101, 1000, 3).share(2) == Workload(51, 500, 2)
    with pytest.raises(BalanceError, match=re.escape("plan.modules['vision'] in lanes")):
        check_balance_config(BalanceConfig(default="orchmllm"), plan, 16)


def test_simulator_prices_colocated() -> None:
    """A colocated plan plays in the simulator: every rank computes encoder work, and the
    encoder's gradients sync over all ranks."""
    from loom.sim.scenario import load_scenario

    scenario = load_scenario("configs/sim/llama3-70b-vith-1024xh100.toml",
                             ['model.llm="llama3-8b"', "cluster.num_gpus=16", "data.global_batch_size=64"])
    plan = Plan([ModuleSpec("vision", data_parallel=16), ModuleSpec("llm", num_stages=4, data_parallel=4)],
                num_microbatches=16, placement="colocated").resolve(scenario.arch.layer_counts(), 16)
    result = scenario.run(plan)
    assert {e.rank for e in result.timeline if e.module == "vision" and e.kind == "forward"} == set(range(16))
    assert result.iteration_time > 0


@pytest.mark.parametrize("placement", ["first_stage", "colocated"])
def test_validator_names_the_broken_encoder_dependency(placement: str) -> None:
    """optimus.md §3.6: an encoder's forward of microbatch i must come before the LLM's
    (EF_i <= F_i) and its backward after the LLM's (EB_i >= B_i); an IR that swaps them on a
    rank is rejected with the microbatch named, not as a bare deadlock."""
    plan = _plan(dp=2) if placement == "first_stage" else _colocated()
    base = build_schedule(plan)
    acts = base.actions[0]
    mb = next(a.microbatch for a in acts if a.kind is ActionKind.FORWARD and a.module == "llm")
    # move the LLM's receive of vision's output (and its forward) before vision's forward
    recv = next(a for a in acts if a.kind is ActionKind.RECV_ACT and a.peer_module == "vision" and a.microbatch == mb)
    swapped = [recv] + [a for a in acts if a is not recv]
    base.actions[0] = swapped
    with pytest.raises(ScheduleError, match=rf"microbatch {mb}: .* \(optimus.md §3.6: EF_i <= F_i\)"):
        validate_schedule(base, plan)
    base.actions[0] = acts
    grad = next(a for a in acts if a.kind is ActionKind.RECV_GRAD and a.module == "vision" and a.peer == 0)
    early = [a for a in acts if a is not grad]
    first_llm_back = next(i for i, a in enumerate(early) if a.module == "llm" and a.kind in (
        ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT))
    early.insert(first_llm_back, grad)
    base.actions[0] = early
    with pytest.raises(ScheduleError, match=rf"microbatch {grad.microbatch}: .*EB_i >= B_i"):
        validate_schedule(base, plan)
