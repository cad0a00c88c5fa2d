"""The simulator and the cost model agree with what runs (issue 9 point 9): gradient clipping's
norm all-reduce (one fp32 scalar over the world per iteration when ``optim.max_grad_norm`` > 0,
joined where the executor joins it) and ``run.dtype``'s bytes per element (activations and
messages 2 or 4 bytes, weights, gradients and optimizer state fp32)."""

from __future__ import annotations

import pytest

from loom.cost import comm
from loom.cost.analytic import AnalyticCostModel
from loom.cost.arch import ModelArch
from loom.cost.hardware import Cluster
from loom.cost.model import Workload
from loom.cost.uniform import UniformCostModel
from loom.plan.plan import ModuleSpec, Plan
from loom.planner.baselines import megatron_plan
from loom.schedule import ActionKind, build_schedule
from loom.sim import simulate
from loom.sim.scenario import ScenarioError, load_scenario
from test_cost import LLM_H, WORK, llm_module, small_arch

SCENARIO = "configs/sim/llama3-70b-vith-1024xh100.toml"
CLIP = 0.25


class ClipCost(UniformCostModel):
    def clip_time(self) -> float:
        return CLIP


def _chain() -> Plan:
    return Plan([ModuleSpec("llm", num_stages=2)], num_microbatches=2).resolve({"llm": 8})


def test_clip_waits_for_every_unit_before_the_optimizer_steps():
    """2 stages, 2 microbatches, 1F1B, stage 0 F=1 B=2, stage 1 F=3 B=4 (test_sim's hand-computed
    timeline): stage 1's backward ends at 15, stage 0's at 17. Both join the norm before their
    optimizer step and leave at 17 + clip; each step (0.5) follows."""
    plan = _chain()
    costs = dict(forward={("llm", 0): 1.0, ("llm", 1): 3.0}, backward={("llm", 0): 2.0, ("llm", 1): 4.0},
                 optimizer=0.5)
    schedule = build_schedule(plan)
    off = simulate(schedule, plan, ClipCost(plan, **costs))
    on = simulate(schedule, plan, ClipCost(plan, **costs), clip=True)
    assert off.iteration_time == 17.5 and not any(e.kind == "clip" for e in off.timeline)
    assert on.iteration_time == 17.5 + CLIP
    clips = {e.rank: (e.start_s, e.end_s) for e in on.timeline if e.kind == "clip"}
    assert clips == {0: (17.0, 17.0 + CLIP), 1: (15.0, 17.0 + CLIP)}
    steps = {e.rank: (e.start_s, e.end_s) for e in on.timeline if e.kind == "optimizer_step"}
    assert steps == {0: (17.0 + CLIP, 17.5 + CLIP), 1: (17.0 + CLIP, 17.5 + CLIP)}
    assert on.sync == {0: CLIP, 1: CLIP}  # the collective's own time, as a grad sync's


def test_a_frozen_unit_joins_after_its_last_action():
    """A frozen encoder has no optimizer step: it joins after its last action (its forwards), as
    the executor's frozen ranks do, and every unit leaves together."""
    plan = Plan([ModuleSpec("vision"), ModuleSpec("llm", num_stages=2)], num_microbatches=2).resolve(
        {"vision": 4, "llm": 8})
    trainable = {("vision", 0): False, ("llm", 0): True, ("llm", 1): True}
    schedule = build_schedule(plan, trainable)
    vision = plan.unit_of("vision", 0, 0)
    assert not any(a.kind is ActionKind.OPTIMIZER_STEP for a in schedule.actions[vision])
    cost = ClipCost(plan, forward=1.0, backward=2.0, optimizer=0.5)
    off = simulate(schedule, plan, cost)
    on = simulate(schedule, plan, cost, clip=True)
    clips = [e for e in on.timeline if e.kind == "clip"]
    assert sorted(e.rank for e in clips) == sorted(on.first_rank.values())  # once per unit
    end = clips[0].end_s
    assert all(e.end_s == end for e in clips)
    first = on.first_rank[vision]
    vision_clip = next(e for e in clips if e.rank == first)
    assert vision_clip.start_s == off.finish[vision]  # after its last action
    assert end == pytest.approx(max(off.finish[u] - (0.5 if u != vision else 0.0) for u in off.finish) + CLIP)
    assert on.finish[vision] == end
    assert all(e.start_s >= end for e in on.timeline if e.kind == "optimizer_step")


def test_analytic_clip_time_is_a_scalar_all_reduce_over_the_world():
    arch = small_arch()
    plan = Plan([ModuleSpec("vision"), ModuleSpec("audio"), ModuleSpec("llm", num_stages=2, data_parallel=2)],
                num_microbatches=4)
    one_node = AnalyticCostModel(arch, plan, Cluster("H100", 8, 8))
    two_nodes = AnalyticCostModel(arch, plan, Cluster("H100", 8, 4))
    assert one_node.clip_time() == pytest.approx(
        comm.all_reduce_time(4, 6, comm.intra_node_link(one_node.cluster)))
    assert two_nodes.clip_time() == pytest.approx(
        comm.all_reduce_time(4, 6, comm.inter_node_link(two_nodes.cluster)))
    assert two_nodes.clip_time() > one_node.clip_time() > 0


def test_loom_simulate_prices_clipping_from_optim_max_grad_norm():
    """The scenario's ``optim.max_grad_norm`` (as in a run's config) turns the norm's all-reduce
    on: one clip event per unit, and the iteration is at least its price longer."""
    off = load_scenario(SCENARIO)
    on = load_scenario(SCENARIO, ["optim.max_grad_norm=1.0"])
    assert off.max_grad_norm == 0.0 and on.max_grad_norm == 1.0
    plan = megatron_plan(off)
    a, b = off.run(plan), on.run(plan)
    clips = [e for e in b.timeline if e.kind == "clip"]
    assert not any(e.kind == "clip" for e in a.timeline)
    assert len(clips) == plan.num_units
    price = on.cost_model(plan).clip_time()
    # 1024 ranks over nodes: 2 x 1023 network latencies
    assert price == pytest.approx(comm.all_reduce_time(4, 1024, comm.inter_node_link(on.cluster)))
    assert b.iteration_time >= a.iteration_time + price - 1e-12


def test_scenario_refuses_bad_precision_and_clipping():
    with pytest.raises(ScenarioError, match=r"run.dtype = 'fp16': unknown value; choose one of \['fp32', 'bf16'\]"):
        load_scenario(SCENARIO, ['run.dtype="fp16"'])
    with pytest.raises(ScenarioError, match=r"optim.max_grad_norm = -1.0: .*use 0 for no clipping"):
        load_scenario(SCENARIO, ["optim.max_grad_norm=-1.0"])
    assert load_scenario(SCENARIO, ['run.dtype="fp32"']).dtype == "fp32"


def test_bytes_per_element_follow_run_dtype():
    """Messages and activations: 2 bytes (bf16) or 4 (fp32); weights, gradients (and their
    all-reduce) and optimizer state: fp32 under both; bf16 keeps the GEMM weights' bf16 copy."""
    arch = small_arch()
    plan = Plan([ModuleSpec("vision"), ModuleSpec("audio"), ModuleSpec("llm", num_stages=2, data_parallel=2)],
                num_microbatches=4)
    cluster = Cluster("H100", 8, 8)
    bf16, fp32 = (AnalyticCostModel(arch, plan, cluster, dtype_bytes=b) for b in (2, 4))
    link = comm.intra_node_link(cluster)
    w = WORK["vision"]
    for cost, b in ((bf16, 2), (fp32, 4)):
        got = cost.transfer_time(plan.unit_of("vision", 0, 0), plan.unit_of("llm", 0, 0), "vision", 0, w)
        assert got == pytest.approx(comm.p2p_time(w.tokens * LLM_H * b, link))
    for module, stage in (("vision", 0), ("llm", 0), ("llm", 1)):
        assert bf16.static_breakdown(module, stage) == fp32.static_breakdown(module, stage)
        assert bf16.grad_sync_time(module, stage) == fp32.grad_sync_time(module, stage)
        assert bf16.optimizer_time(module, stage) == fp32.optimizer_time(module, stage)
    # an LLM alone, full recompute: stage 0 (embedding, block) keeps each block's input only,
    # and its output until the gradient comes back
    llm = ModelArch({"llm": llm_module()})
    one = Plan([ModuleSpec("llm", num_stages=2, stage_boundaries=[0, 2, 5], recompute="full")], num_microbatches=2)
    tokens = Workload.of_lengths([10])
    for b in (2, 4):
        assert AnalyticCostModel(llm, one, cluster, dtype_bytes=b).activation_memory("llm", 0, tokens) == 2 * 10 * b * 64
    with pytest.raises(ValueError, match="dtype_bytes = 1: choose 2 .run.dtype bf16. or 4 .fp32."):
        AnalyticCostModel(llm, one, cluster, dtype_bytes=1)


def test_memory_bound_compute_follows_run_dtype():
    """Compute prices the bytes it moves at run.dtype's width: a norm (memory-bound, no GEMM)
    takes twice as long in fp32 as in bf16."""
    llm = ModelArch({"llm": llm_module()})
    plan = Plan([ModuleSpec("llm")], num_microbatches=1)
    cluster = Cluster("H100", 8, 8)
    work = Workload.of_lengths([512])
    bf16, fp32 = (AnalyticCostModel(llm, plan, cluster, dtype_bytes=b).layer_costs("llm", 0, work) for b in (2, 4))
    (norm16,), (norm32,) = ([c for c in costs if c.kind == "norm"] for costs in (bf16, fp32))
    assert norm16.forward > 0 and norm32.forward == pytest.approx(2 * norm16.forward)
