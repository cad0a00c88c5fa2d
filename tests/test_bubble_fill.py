"""Optimus's bubble fill as an IR transform (`loom.sim.bubble_fill`, ``plan.bubble_fill``):
the colocated encoders' blocks move into the LLM's bubbles, the LLM's own order never changes,
the result is a valid, causal IR that the simulator plays no slower, and every path that
accepts the field runs it or refuses it by name. The reference semantics on gloo (vision and
audio, alone and under orchmllm) are in tests/test_balance_runtime.py (``optimus-*``)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from loom.cost.uniform import UniformCostModel
from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError
from loom.runtime.engine import ParallelEngine
from loom.schedule.generators import build_schedule
from loom.schedule.ir import ActionKind
from loom.schedule.layout import contiguous_layout
from loom.schedule.validate import validate_schedule
from loom.sim import simulate
from loom.sim.bubble_fill import fill_bubbles

LAYERS = {"vision": 2, "audio": 2, "llm": 8}
COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)


def _plan(stages: int = 2, microbatches: int = 8, schedule: str = "1f1b", audio: bool = True) -> Plan:
    encoders = [ModuleSpec("vision", data_parallel=stages)] + ([ModuleSpec("audio", data_parallel=stages)] if audio else [])
    plan = Plan([*encoders, ModuleSpec(LLM, num_stages=stages)], num_microbatches=microbatches, schedule=schedule,
                placement="colocated", bubble_fill="optimus")
    return plan.resolve({k: v for k, v in LAYERS.items() if audio or k != "audio"})


def _cost(plan: Plan) -> UniformCostModel:
    # an LLM stage's backward twice its forward, half of it the weights' (ZB-H1); encoders cheaper
    return UniformCostModel(plan, forward={"vision": 1.0, "audio": 0.5, LLM: 2.0},
                            backward={"vision": 2.0, "audio": 1.0, LLM: 4.0}, backward_weight=2.0, transfer=0.1)


@pytest.mark.parametrize("stages,microbatches,schedule", [(2, 8, "1f1b"), (4, 8, "1f1b"), (4, 16, "1f1b"),
                                                          (2, 4, "gpipe"), (4, 8, "zb-h1")])
def test_fill_keeps_the_llm_order_and_is_never_slower(stages: int, microbatches: int, schedule: str) -> None:
    plan = _plan(stages, microbatches, schedule)
    built = build_schedule(plan)
    got = fill_bubbles(built, plan, _cost(plan))
    validate_schedule(got.schedule, plan)  # well formed, EF_i <= F_i / EB_i >= B_i on every unit, no deadlock
    assert got.filled_s <= got.coarse_s
    assert got.filled_s == pytest.approx(simulate(got.schedule, plan, _cost(plan)).iteration_time)
    assert got.coarse_s == pytest.approx(simulate(built, plan, _cost(plan)).iteration_time)
    for u, acts in built.actions.items():
        new = got.schedule.actions[u]
        assert Counter(map(repr, new)) == Counter(map(repr, acts))  # the same actions, nothing lost or doubled
        assert [a for a in new if a.module == LLM] == [a for a in acts if a.module == LLM]  # the skeleton's order
        for m in ("vision", "audio"):  # one encoder's microbatches keep their forward and backward blocks whole
            mine = [a for a in new if a.module == m and a.kind in COMPUTE]
            assert sorted(a.microbatch for a in mine if a.kind is ActionKind.FORWARD) == \
                sorted(a.microbatch for a in mine if a.kind is ActionKind.BACKWARD)


def test_fill_moves_encoder_work_into_the_bubbles() -> None:
    """On 4 stages the last stage idles through the warmup and the first through the
    cooldown: the fill moves encoder blocks there and the step gets shorter."""
    plan = _plan(4, 8)
    built = build_schedule(plan)
    got = fill_bubbles(built, plan, _cost(plan))
    assert got.moved > 0 and got.filled_s < got.coarse_s
    first = plan.unit_of(LLM, 0, 0)
    order = [(a.kind, a.module) for a in got.schedule.actions[first] if a.kind in COMPUTE]
    coarse = [(a.kind, a.module) for a in built.actions[first] if a.kind in COMPUTE]
    # the coarse rule puts every encoder forward before the LLM's first; the fill defers some
    lead = next(i for i, k in enumerate(order) if k[1] == LLM)
    assert lead < next(i for i, k in enumerate(coarse) if k[1] == LLM)
    # and runs some encoder backwards before the LLM's last backward on that rank
    last_llm = max(i for i, k in enumerate(order) if k[1] == LLM)
    assert any(k == (ActionKind.BACKWARD, m) for k in order[:last_llm] for m in ("vision", "audio"))


def test_fill_with_a_balanced_layout_routes_the_same_parts() -> None:
    """Under a layout (routed encoder-to-LLM messages) the blocks keep their sends and receives."""
    plan = _plan(2, 4, audio=False)
    layout = contiguous_layout(8, 4, plan.module_names)
    layout.slots["vision"] = [[0, 2], [1, 3], [4, 6], [5, 7]]  # encoder slots hold other samples than the LLM's
    built = build_schedule(plan, layout=layout)
    work = {j: {m: _w(2) for m in plan.module_names} for j in range(4)}
    per_sample = [{m: _w(1) for m in plan.module_names} for _ in range(8)]
    got = fill_bubbles(built, plan, _cost(plan), work, per_sample)
    validate_schedule(got.schedule, plan)
    for u in built.actions:
        assert Counter(map(repr, got.schedule.actions[u])) == Counter(map(repr, built.actions[u]))


def _w(tokens: int):
    from loom.cost.model import Workload

    return Workload(tokens=tokens)


def test_bubble_fill_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(PlanError, match=re.escape("plan.bubble_fill = 'optimus'") + ".*placement = 'disaggregated'"):
        Plan([ModuleSpec("vision"), ModuleSpec(LLM, num_stages=2)], bubble_fill="optimus").resolve({"vision": 2, "llm": 8})
    with pytest.raises(PlanError, match=re.escape("plan.bubble_fill = 'fine'") + ".*choose one of"):
        dataclasses.replace(_plan(), bubble_fill="fine").resolve(LAYERS)
    disagg = Plan([ModuleSpec("vision"), ModuleSpec(LLM, num_stages=2)]).resolve({"vision": 2, "llm": 8})
    with pytest.raises(PlanError, match="placement = 'colocated'"):
        fill_bubbles(build_schedule(disagg), disagg, _cost(disagg))
    text = _plan().to_toml()
    assert 'bubble_fill = "optimus"' in text
    assert Plan.from_dict(_plan().to_dict()).bubble_fill == "optimus"


def test_engine_runs_the_fill_only_through_its_transform() -> None:
    """The runtime cannot compute the fill (it does not import the simulator): without the
    transform ``loom train`` gives it, the engine refuses the plan by name; with one, the
    schedule it runs is the transform's, validated."""
    plan = _plan(2, 4)
    layout = contiguous_layout(8, 4, plan.module_names)
    engine = SimpleNamespace(plan=plan, trainable=None, eager_forward=0, _schedules={}, schedule_transform=None)
    with pytest.raises(PlanError, match=re.escape("plan.bubble_fill = 'optimus'") + ".*schedule_transform"):
        ParallelEngine.schedule_for(engine, layout)
    seen = []

    def transform(schedule, run_plan):
        seen.append(run_plan.num_microbatches)
        return fill_bubbles(schedule, run_plan, _cost(plan)).schedule

    engine.schedule_transform = transform
    got = ParallelEngine.schedule_for(engine, layout)
    assert seen == [4] and got.actions != build_schedule(plan, layout=layout).actions


def test_simulator_prices_the_fill() -> None:
    """`Scenario.run` plays the filled schedule for ``bubble_fill = "optimus"``: no slower than
    the coarse colocated order of the same plan."""
    from loom.sim.scenario import load_scenario

    scenario = load_scenario("configs/sim/llama3-70b-vith-1024xh100.toml",
                             ['model.llm="llama3-8b"', "cluster.num_gpus=8", "data.global_batch_size=32"])
    plan = Plan([ModuleSpec("vision", data_parallel=4), ModuleSpec(LLM, num_stages=4)], num_microbatches=16,
                placement="colocated").resolve(scenario.arch.layer_counts(), 4)
    coarse = scenario.run(plan)
    filled = scenario.run(dataclasses.replace(plan, bubble_fill="optimus"))
    assert filled.iteration_time < coarse.iteration_time


def test_compare_sets_an_optimus_plan_beside_the_others() -> None:
    """``loom simulate --compare``'s Optimus plan: colocated, every rank in the LLM's pipeline,
    the fill on, encoders at the LLM's TP; with context parallelism (which the colocated runtime
    does not run), a `ScenarioError` that names the field."""
    from loom.planner.baselines import optimus_plan
    from loom.sim.scenario import ScenarioError, load_scenario

    config = "configs/sim/llama3-70b-vith-1024xh100.toml"
    with pytest.raises(ScenarioError, match=re.escape("parallel.context_parallel = 2")):
        optimus_plan(load_scenario(config, ["parallel.context_parallel=2"]))
    big = optimus_plan(load_scenario(config))  # 1024 GPUs at TP 8 x DP 8: 16 positions, a ViT replica per unit
    assert (big.spec(LLM).pipeline_depth, big.spec("vision").data_parallel, big.spec("vision").tensor_parallel,
            big.spec(LLM).zero_stage) == (16, 128, 8, 0)
    scenario = load_scenario(config, ['model.llm="llama3-8b"', "cluster.num_gpus=8", "parallel.tensor_parallel=1",
                                      "parallel.zero_stage=0", "parallel.data_parallel=2",
                                      "parallel.microbatches_per_pipeline=8", "data.global_batch_size=32"])
    plan = optimus_plan(scenario)
    assert (plan.placement, plan.bubble_fill, plan.world_size) == ("colocated", "optimus", 8)
    assert plan.spec("vision").data_parallel == 8 and plan.spec(LLM).pipeline_depth == 4
    assert scenario.run(plan).iteration_time < scenario.run(dataclasses.replace(plan, bubble_fill="none")).iteration_time


def test_a_chunked_encoder_is_filled_chunk_by_chunk() -> None:
    """A colocated encoder cut into chunks (``virtual_stages = num_stages``, all on each unit):
    each chunk's work is a block of its own, moved in chain order (a chunk's forward before the
    next one's, its backward after), so finer blocks fit gaps a whole encoder does not."""
    plan = Plan([ModuleSpec("vision", data_parallel=4, num_stages=2, virtual_stages=2),
                 ModuleSpec("audio", data_parallel=4), ModuleSpec(LLM, num_stages=4)], num_microbatches=8,
                placement="colocated", bubble_fill="optimus").resolve(LAYERS)
    assert plan.stages_of(1) == [("vision", 0, 1), ("vision", 1, 1), ("audio", 0, 1), (LLM, 1, 0)]
    got = fill_bubbles(build_schedule(plan), plan, _cost(plan))
    validate_schedule(got.schedule, plan)
    assert got.moved > 0 and got.filled_s < got.coarse_s
    for acts in got.schedule.actions.values():
        order = [(a.kind, a.stage, a.microbatch) for a in acts if a.module == "vision" and a.kind in COMPUTE]
        for j in {mb for _, _, mb in order}:
            assert order.index((ActionKind.FORWARD, 0, j)) < order.index((ActionKind.FORWARD, 1, j))
            assert order.index((ActionKind.BACKWARD, 1, j)) < order.index((ActionKind.BACKWARD, 0, j))
    with pytest.raises(PlanError, match=re.escape("plan.modules['vision'].virtual_stages = 2 with num_stages = 4")):
        Plan([ModuleSpec("vision", data_parallel=2, num_stages=4, virtual_stages=2), ModuleSpec(LLM, num_stages=2)],
             placement="colocated").resolve({"vision": 4, "llm": 8})


def test_finer_chunks_fill_more_on_the_analytic_model() -> None:
    """EVA-CLIP-E beside Llama-3-8B on 4 GPUs: cutting the encoder into 4 chunks lets the fill
    use gaps a whole encoder microbatch does not fit (simulated: 1.244 s whole, 1.224 s in 4)."""
    from loom.planner.baselines import optimus_plan
    from loom.sim.scenario import load_scenario

    scenario = load_scenario("configs/sim/llama3-70b-vith-1024xh100.toml", [
        'model.llm="llama3-8b"', 'model.encoders={vision="eva-clip-e"}', "model.freeze=[]", 'cluster.gpu="H200"',
        "cluster.num_gpus=4", "parallel.tensor_parallel=1", "parallel.zero_stage=0", "parallel.data_parallel=1",
        "parallel.microbatches_per_pipeline=16", "data.global_batch_size=32"])
    whole = optimus_plan(scenario)
    vision = dataclasses.replace(whole.spec("vision"), num_stages=4, virtual_stages=4, stage_boundaries=None)
    chunked = dataclasses.replace(whole, modules=[vision, whole.spec(LLM)]).resolve(scenario.arch.layer_counts(), 4)
    assert scenario.run(chunked).iteration_time < scenario.run(whole).iteration_time


def test_a_block_may_overrun_a_gap_when_the_play_says_it_pays() -> None:
    """A vision forward of 2.5 against LLM stages of 1 (forward) and 2 (backward): no gap holds
    a whole block, so the strict fill changes nothing; letting a block run past a gap's end by
    up to half its time (`OVERFLOWS`) still shortens the step, and the play keeps it."""
    plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec(LLM, num_stages=2)], num_microbatches=4,
                placement="colocated", bubble_fill="optimus").resolve({"vision": 2, "llm": 8})
    cost = UniformCostModel(plan, forward={"vision": 2.5, LLM: 1.0}, backward={"vision": 5.0, LLM: 2.0}, transfer=0.1)
    built = build_schedule(plan)
    strict = fill_bubbles(built, plan, cost, overflows=(0.0,))
    assert strict.filled_s == strict.coarse_s == pytest.approx(30.4) and strict.schedule is built
    got = fill_bubbles(built, plan, cost)
    assert got.filled_s == pytest.approx(29.3) and got.moved > 0
    validate_schedule(got.schedule, plan)
