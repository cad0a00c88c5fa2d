"""Plans: layout, serialisation and errors that name the field."""

import pytest

from loom.plan.plan import ModuleSpec, Plan, PlanError, even_boundaries

COUNTS = {"vision": 5, "audio": 5, "llm": 7}


def demo_plan(**kw) -> Plan:
    return Plan([ModuleSpec("vision"), ModuleSpec("audio"), ModuleSpec("llm", num_stages=2)], **kw)


def test_even_boundaries_split_by_layer_count():
    assert even_boundaries(7, 2) == [0, 4, 7]
    assert even_boundaries(6, 3) == [0, 2, 4, 6]
    for n in range(1, 12):
        for s in range(1, n + 1):
            b = even_boundaries(n, s)
            sizes = [b[i + 1] - b[i] for i in range(s)]
            assert b[0] == 0 and b[-1] == n and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_rank_layout_is_module_then_stage_then_replica():
    plan = Plan([ModuleSpec("vision", num_stages=2, data_parallel=2), ModuleSpec("llm", num_stages=2)],
                num_microbatches=4).resolve({"vision": 5, "llm": 7}, world_size=6)
    roles = [plan.role_of(r) for r in range(plan.world_size)]
    assert roles == [("vision", 0, 0), ("vision", 0, 1), ("vision", 1, 0), ("vision", 1, 1), ("llm", 0, 0), ("llm", 1, 0)]
    for r, (m, s, d) in enumerate(roles):
        assert plan.rank_of(m, s, d) == r
    assert plan.microbatches_of("vision", 1) == [1, 3]
    assert plan.layers_of("llm", 1) == (4, 7)


def test_json_and_toml_round_trip(tmp_path):
    plan = demo_plan(num_microbatches=8, schedule="gpipe").resolve(COUNTS, world_size=4)
    assert Plan.from_json(plan.to_json()) == plan
    (tmp_path / "p.toml").write_text(plan.to_toml())
    assert Plan.from_toml(tmp_path / "p.toml") == plan


@pytest.mark.parametrize("mutate, world, words", [
    (lambda p: None, 3, ["needs 4 ranks", "world size is 3"]),
    (lambda p: setattr(p.modules[2], "data_parallel", 2), 4, ["needs 6 ranks", "launch 6 processes"]),
    (lambda p: setattr(p.modules[2], "stage_boundaries", [0, 3, 9]), 4, ["stage_boundaries", "out of range", "7"]),
    (lambda p: setattr(p.modules[2], "stage_boundaries", [0, 3]), 4, ["stage_boundaries", "2 entries", "need 3"]),
    (lambda p: setattr(p.modules[2], "stage_boundaries", [0, 0, 7]), 4, ["strictly increase"]),
    (lambda p: setattr(p.modules[0], "name", "video"), 4, ["'video'", "unknown module name"]),
    (lambda p: setattr(p.modules[2], "num_stages", 9), None, ["num_stages = 9", "7 layers"]),
    (lambda p: setattr(p, "schedule", "zb"), 4, ["plan.schedule", "'zb'"]),
    (lambda p: setattr(p, "num_microbatches", 0), 4, ["plan.num_microbatches"]),
    (lambda p: setattr(p.modules[0], "data_parallel", 0), None, ["data_parallel = 0"]),
    (lambda p: p.modules.reverse(), 4, ["are generators", "the model's generators are []"]),
    (lambda p: p.modules.pop(1), 3, ["lacks ['audio']"]),
])
def test_bad_plans_name_the_problem(mutate, world, words):
    plan = demo_plan()
    mutate(plan)
    with pytest.raises(PlanError) as e:
        plan.resolve(COUNTS, world_size=world)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_unknown_plan_fields_are_rejected():
    with pytest.raises(PlanError, match="unknown fields"):
        Plan.from_dict({"modules": [{"name": "llm"}], "microbatches": 4})
    with pytest.raises(PlanError, match="'stages'"):
        Plan.from_dict({"modules": [{"name": "llm", "stages": 2}]})


def test_tensor_and_context_parallel_ranks_form_one_pipeline_unit():
    plan = Plan([ModuleSpec("vision", tensor_parallel=2), ModuleSpec("llm", num_stages=2, data_parallel=2,
                                                                      tensor_parallel=4, context_parallel=2)],
                num_microbatches=4).resolve({"vision": 5, "llm": 7}, world_size=2 + 2 * 2 * 8)
    assert plan.num_units == 1 + 4
    assert [plan.role_of(r) for r in (0, 1)] == [("vision", 0, 0)] * 2
    # llm stage 0 replica 1 owns ranks 2 + 8 .. 2 + 15; TP groups are contiguous
    assert plan.rank_of("llm", 0, 1) == 10 and plan.rank_of("llm", 0, 1, tp=3, cp=1) == 17
    assert {plan.role_of(r) for r in range(10, 18)} == {("llm", 0, 1)}
    assert plan.unit_of("llm", 1, 0) == 3 and plan.role_of_unit(3) == ("llm", 1, 0)
    with pytest.raises(PlanError, match="tensor_parallel = 0"):
        Plan([ModuleSpec("llm", tensor_parallel=0)]).resolve({"llm": 7})
    with pytest.raises(PlanError, match="zero_stage = 4"):
        Plan([ModuleSpec("llm", zero_stage=4)]).resolve({"llm": 7})
