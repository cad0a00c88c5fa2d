"""Interleaved 1F1B (virtual pipeline stages, optimus.md §3.11): the plan's placement of chunks,
Megatron's order on every position, the bubble it saves, memory in flight and the refusals.
The reference semantics of interleaved runs are in tests/test_parallel_reference.py (LLM alone
and multimodal) and tests/test_balance_runtime.py (with Entrain's balancing)."""

from __future__ import annotations

import re

import pytest

from loom.cost.memory import in_flight_count
from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.schedule.generators import build_schedule
from loom.schedule.ir import ActionKind, Action
from loom.schedule.layout import BatchLayout
from loom.schedule.validate import ScheduleError, unit_cost_makespan, validate_schedule


def _llm_plan(pp: int, v: int, m: int, dp: int = 1, schedule: str = "1f1b", layers: int = 48) -> Plan:
    plan = Plan([ModuleSpec("llm", num_stages=pp * v, virtual_stages=v, data_parallel=dp)], num_microbatches=m,
                schedule=schedule)
    return plan.resolve({"llm": layers}, pp * dp)


def _megatron_order(pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Megatron-core's interleaved schedule from its index formulas (optimus.md §3.11), written
    independently of the generator: forward k -> chunk (k mod PV) // P, microbatch
    (k // PV) P + k mod P; backward k mirrors the chunk; warmup (P - r - 1) 2 + (V - 1) P."""
    total = m * v

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def chunk(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    warmup = min(total, (pp - rank - 1) * 2 + (v - 1) * pp)
    out = [("F", chunk(k, True) * pp + rank, mb(k)) for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        out.append(("F", chunk(k, True) * pp + rank, mb(k)))
        out.append(("B", chunk(i, False) * pp + rank, mb(i)))
    out += [("B", chunk(k, False) * pp + rank, mb(k)) for k in range(total - warmup, total)]
    return out


def _compute(acts: list[Action]) -> list[tuple[str, int, int]]:
    tag = {ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B"}
    return [(tag[a.kind], a.stage, a.microbatch) for a in acts if a.kind in tag]


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 6), (4, 3, 12), (3, 2, 3)])
def test_order_is_megatrons(pp: int, v: int, m: int) -> None:
    plan = _llm_plan(pp, v, m)
    schedule = build_schedule(plan)
    validate_schedule(schedule, plan)
    for rank in range(pp):
        assert _compute(schedule.actions[rank]) == _megatron_order(pp, v, m, rank), rank
        # each chunk named on its actions; one grad sync and one optimizer share per hosted stage
        acts = schedule.actions[rank]
        assert all(a.chunk == a.stage // pp for a in acts)
        assert [a.stage for a in acts if a.kind is ActionKind.GRAD_SYNC] == list(range(rank, pp * v, pp))
        assert [a.stage for a in acts if a.kind is ActionKind.OPTIMIZER_STEP] == list(range(rank, pp * v, pp))


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 6), (4, 4, 16)])
def test_bubble_shrinks_by_the_chunk_count(pp: int, v: int, m: int) -> None:
    """Under unit costs per chunk, 1F1B's bubble of 2 (P - 1) whole-stage passes becomes
    2 (P - 1) chunk passes, i.e. ``1 / V`` of it (Narayanan et al., optimus.md §3.11)."""
    interleaved = unit_cost_makespan(build_schedule(_llm_plan(pp, v, m)))
    assert interleaved == 2 * m * v + 2 * (pp - 1)
    plain = unit_cost_makespan(build_schedule(_llm_plan(pp, 1, m)))  # one unit = V chunks of work
    assert plain == 2 * (m + pp - 1)
    bubble, plain_bubble = interleaved - 2 * m * v, (plain - 2 * m) * v  # both in chunk passes
    assert bubble * v == plain_bubble


def test_gpipe_forwards_everything_first() -> None:
    plan = _llm_plan(2, 2, 4, schedule="gpipe")
    schedule = build_schedule(plan)
    validate_schedule(schedule, plan)
    kinds = [k for k, _, _ in _compute(schedule.actions[0])]
    assert kinds == ["F"] * 8 + ["B"] * 8


def test_plan_places_chunks_round_robin() -> None:
    plan = _llm_plan(2, 2, 4, dp=2)
    assert plan.world_size == 4 and plan.num_units == 4
    assert plan.stages_of(0) == [("llm", 0, 0), ("llm", 2, 0)]
    assert plan.stages_of(3) == [("llm", 1, 1), ("llm", 3, 1)]
    assert [plan.rank_of("llm", s, 1) for s in range(4)] == [1, 3, 1, 3]
    assert plan.mesh_shape("llm") == (2, 2, 1, 1)
    assert plan.coordinate_of(2).index == (1, 0, 0, 0)


def test_multimodal_and_replicas_validate() -> None:
    """Encoders feeding an interleaved LLM look as far ahead as its first stage forwards (the
    validator's deadlock play), with data parallelism on either side."""
    for enc_dp, llm_dp, m in [(1, 1, 6), (2, 1, 6), (2, 2, 12), (1, 2, 12), (3, 1, 6)]:
        plan = Plan([ModuleSpec("vision", data_parallel=enc_dp), ModuleSpec("audio", num_stages=2),
                     ModuleSpec("llm", num_stages=6, virtual_stages=2, data_parallel=llm_dp)], num_microbatches=m)
        plan.resolve({"vision": 4, "audio": 4, "llm": 12})
        validate_schedule(build_schedule(plan), plan)


def test_routed_layout_validates() -> None:
    """A balanced layout routes encoder rows to other LLM microbatches, and defers some to a
    later round (Entrain): the interleaved LLM side still validates."""
    plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=4, virtual_stages=2)],
                num_microbatches=4).resolve({"vision": 2, "llm": 8})
    # vision slot 0 (round 0) holds sample 6, which LLM slot 3 (round 1) takes: a deferred part
    layout = BatchLayout(slots={"vision": [(0, 5, 6), (1, 4), (2, 7), (3,)], "llm": [(0, 1), (4, 5), (2, 3), (6, 7)]})
    schedule = build_schedule(plan, layout=layout)
    validate_schedule(schedule, plan)
    parts = [a for a in schedule.actions[0] if a.kind is ActionKind.BACKWARD and a.microbatch == 0]
    assert len(parts) == 2  # Entrain's split backward on the encoder (entrain.md §3.6)


def test_validator_rejects_a_stage_the_unit_does_not_host() -> None:
    plan = _llm_plan(2, 2, 4)
    schedule = build_schedule(plan)
    acts = schedule.actions[0]
    i = next(i for i, a in enumerate(acts) if a.kind is ActionKind.FORWARD)
    acts[i] = Action(ActionKind.FORWARD, "llm", 1, acts[i].microbatch)  # stage 1 lives on position 1
    with pytest.raises(ScheduleError, match=r"llm.0 \(replica 0\), llm.2 \(replica 0\) on this rank, not llm.1"):
        validate_schedule(schedule, plan)


def test_memory_counts_interleaved_warmup() -> None:
    """Position p holds (P - p - 1) 2 + (V - 1) P + 1 chunk activations (Megatron's warmup plus
    one), spread over its V chunks."""
    plan = _llm_plan(4, 2, 16)
    assert [in_flight_count(plan, "llm", s) for s in range(4)] == [6, 5, 4, 3]  # ceil(12/2), ceil(10/2), ...
    assert in_flight_count(plan, "llm", 4) == 6  # chunk 1 of position 0
    plain = _llm_plan(4, 1, 16)
    assert [in_flight_count(plain, "llm", s) for s in range(4)] == [4, 3, 2, 1]


@pytest.mark.parametrize("spec,microbatches,schedule,field", [
    (dict(num_stages=6, virtual_stages=4), 4, "1f1b", "virtual_stages = 4 does not divide num_stages = 6"),
    (dict(num_stages=2, virtual_stages=2), 4, "1f1b", "leaves one pipeline position"),
    (dict(num_stages=4, virtual_stages=2), 5, "1f1b", "plan.num_microbatches = 5"),
    (dict(num_stages=4, virtual_stages=2, data_parallel=2), 6, "1f1b", "use a multiple of 4"),
    (dict(num_stages=4, virtual_stages=2), 4, "zb-h1", "plan.schedule = 'zb-h1'"),
    (dict(num_stages=4, virtual_stages=2, context_parallel=2), 4, "1f1b", "context_parallel = 2"),
    (dict(num_stages=4, virtual_stages=2, zero_stage=2, data_parallel=2), 8, "1f1b", "zero_stage = 2"),
    (dict(num_stages=4, virtual_stages=0), 4, "1f1b", "virtual_stages = 0"),
])
def test_bad_virtual_stages_name_the_field(spec: dict, microbatches: int, schedule: str, field: str) -> None:
    plan = Plan([ModuleSpec("llm", **spec)], num_microbatches=microbatches, schedule=schedule)
    with pytest.raises(PlanError, match=re.escape(field)):
        plan.resolve({"llm": 8})


def test_virtual_stages_on_an_encoder_are_refused() -> None:
    plan = Plan([ModuleSpec("vision", num_stages=2, virtual_stages=2), ModuleSpec("llm", num_stages=2)],
                num_microbatches=4)
    with pytest.raises(PlanError, match=r"plan.modules\['vision'\].virtual_stages = 2"):
        plan.resolve({"vision": 4, "llm": 4})


def test_round_trips_through_toml_and_json(tmp_path) -> None:
    plan = _llm_plan(2, 2, 4)
    path = tmp_path / "plan.toml"
    path.write_text(plan.to_toml())
    assert Plan.from_toml(path).modules[0].virtual_stages == 2
    assert Plan.from_json(plan.to_json()).modules[0].virtual_stages == 2


def test_simulator_prices_interleaving_at_scale() -> None:
    """`loom simulate parallel.virtual_stages=2`: the Megatron-style plan keeps its ranks, deals
    twice the stages over them, and the simulated bubble and iteration shrink (its first
    position holds more activations: Megatron's deeper warmup)."""
    from loom.planner.baselines import megatron_plan
    from loom.sim.scenario import load_scenario

    small = ["cluster.num_gpus=144", "parallel.data_parallel=2", "parallel.microbatches_per_pipeline=16",
             "data.global_batch_size=256"]
    plain, chunked = (load_scenario("configs/sim/llama3-70b-vith-1024xh100.toml", small + extra)
                      for extra in ([], ["parallel.virtual_stages=2"]))
    p1, p2 = megatron_plan(plain), megatron_plan(chunked)
    assert p2.world_size == p1.world_size == 144
    assert p2.spec("llm").pipeline_depth == p1.spec("llm").num_stages == 8 and p2.spec("llm").num_stages == 16
    r1, r2 = plain.run(p1), chunked.run(p2)
    assert r2.iteration_time < 0.9 * r1.iteration_time
    assert r2.summary()["bubble_fraction"] < r1.summary()["bubble_fraction"]
    first = p1.rank_of("llm", 0, 0)
    assert r2.peak_memory[p2.unit_of("llm", 0, 0)] > r1.peak_memory[p1.unit_of("llm", 0, 0)]
    assert first == p2.rank_of("llm", 8, 0)  # chunk 1 of position 0 lives on the same rank
