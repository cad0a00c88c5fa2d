"""Frozen-aware partitioning (cornstarch.md §3.2.2) and the loosely-coupled search (§2.6)."""

import itertools
import random

import pytest

from loom.planner.partition import (
    LayerCost,
    brute_force_partition,
    frozen_aware_boundaries,
    frozen_aware_layer_breakdown,
    frozen_aware_layer_costs,
    loosely_coupled_search,
    partition,
    plan_with_stage_counts,
    stage_bottleneck,
)
from loom.plan.plan import ModuleSpec, Plan, PlanError, even_boundaries

# ---- the DP against brute force ----------------------------------------------------------------


def _random_cases(seed: int, count: int, integers: bool):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 12)
        s = rng.randint(1, min(5, n))
        if integers:
            # small integers with many zeros: plenty of exact ties
            costs = [float(rng.choice([0, 0, 1, 1, 2, 3, 5])) for _ in range(n)]
        else:
            costs = [rng.random() * rng.choice([0.0, 1e-3, 1.0, 50.0]) for _ in range(n)]
        yield costs, s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_equals_brute_force_on_integer_costs_including_tie_breaking(seed):
    for costs, s in _random_cases(seed, 150, integers=True):
        bounds, value = partition(costs, s)
        oracle_bounds, oracle_value = brute_force_partition(costs, s)
        assert value == oracle_value, (costs, s)
        assert bounds == oracle_bounds, (costs, s)  # the same optimal partition, same tie rule
        assert stage_bottleneck(costs, bounds) == value


@pytest.mark.parametrize("seed", [10, 11])
def test_dp_equals_brute_force_on_float_costs(seed):
    for costs, s in _random_cases(seed, 150, integers=False):
        bounds, value = partition(costs, s)
        _, oracle_value = brute_force_partition(costs, s)
        assert value == pytest.approx(oracle_value, rel=1e-9, abs=1e-12), (costs, s)
        assert len(bounds) == s + 1 and bounds[0] == 0 and bounds[-1] == len(costs)
        assert all(a < b for a, b in zip(bounds, bounds[1:]))
        assert stage_bottleneck(costs, bounds) == value


def test_dp_is_optimal_against_every_partition_of_a_small_case():
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for s in range(1, len(costs) + 1):
        _, value = partition(costs, s)
        every = [stage_bottleneck(costs, [0, *cuts, len(costs)])
                 for cuts in itertools.combinations(range(1, len(costs)), s - 1)]
        assert value == min(every)


def test_ties_go_to_the_earliest_split_so_later_stages_are_longer():
    assert partition([1.0] * 5, 2) == ([0, 2, 5], 3.0)
    assert partition([0.0] * 4, 3) == ([0, 1, 2, 4], 0.0)
    assert partition([1.0, 1.0, 1.0, 1.0], 4) == ([0, 1, 2, 3, 4], 1.0)
    # the prefix is split by the same rule after the last stage is fixed
    assert partition([2.0, 0.0, 0.0, 2.0, 2.0], 3) == ([0, 1, 4, 5], 2.0)


def test_one_stage_and_one_layer_per_stage():
    assert partition([1.0, 2.0, 3.0], 1) == ([0, 3], 6.0)
    assert partition([1.0, 2.0, 3.0], 3) == ([0, 1, 2, 3], 3.0)


def _greedy_stages(costs: list[float], capacity: float) -> int:
    """Fewest contiguous stages with no stage above ``capacity`` (greedy is exact for
    non-negative costs): the oracle for the min-max bottleneck where enumeration cannot go."""
    stages, load = 1, 0.0
    for c in costs:
        if c > capacity:
            return len(costs) + 1
        if load + c > capacity:
            stages, load = stages + 1, 0.0
        load += c
    return stages


def test_partition_is_optimal_for_200_layers_and_32_stages():
    # too large for brute force: the bottleneck is optimal iff the greedy packing fits 32
    # stages at that capacity and needs more just below it
    rng = random.Random(7)
    costs = [rng.random() for _ in range(200)]
    bounds, value = partition(costs, 32)
    assert len(bounds) == 33 and bounds[0] == 0 and bounds[-1] == 200
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert value == pytest.approx(stage_bottleneck(costs, bounds))
    assert _greedy_stages(costs, value * (1 + 1e-9)) <= 32
    assert _greedy_stages(costs, value * (1 - 1e-9)) > 32


@pytest.mark.parametrize("costs, stages, words", [
    ([1.0, 2.0], 0, ["num_stages = 0", "between 1 and len(costs) = 2"]),
    ([1.0, 2.0], 3, ["num_stages = 3", "between 1 and len(costs) = 2"]),
    ([1.0, -2.0], 1, ["costs[1] = -2.0", "non-negative"]),
    ([1.0, float("nan")], 1, ["costs[1]", "finite"]),
    ([], 1, ["costs is empty"]),
    ([1.0, 2.0], 1.5, ["num_stages = 1.5"]),
])
def test_partition_rejects_bad_input_naming_the_argument(costs, stages, words):
    with pytest.raises(ValueError) as e:
        partition(costs, stages)
    for w in words:
        assert w in str(e.value)


# ---- frozen-aware layer costs ------------------------------------------------------------------

# vision: two encoder layers + a projector; audio: one encoder layer + a projector (always
# frozen, so it never back-propagates); llm: three layers. Forward, input-gradient and
# weight-gradient times differ by powers of ten, so every expected T_l below reads as which
# phases were counted.
FORWARD = {"vision": [1, 2, 3], "audio": [4, 5], "llm": [6, 7, 8]}
BACKWARD_INPUT = {"vision": [10, 20, 30], "audio": [40, 50], "llm": [60, 70, 80]}
BACKWARD_WEIGHT = {"vision": [100, 200, 300], "audio": [400, 500], "llm": [600, 700, 800]}
ORDER = ["vision", "audio", "llm"]


def _trainable(encoder: bool, projector: bool, llm: bool) -> dict[str, list[bool]]:
    return {"vision": [encoder, encoder, projector], "audio": [False, False], "llm": [llm] * 3}


# (encoder, projector, llm trainable) -> expected T_l for vision and llm, without and with
# recomputation; audio is frozen with nothing trainable before it: forward only, always.
EXPECTED = {
    (False, False, False): ([1, 2, 3], [6, 7, 8], [1, 2, 3], [6, 7, 8]),
    (False, False, True): ([1, 2, 3], [666, 777, 888], [1, 2, 3], [672, 784, 896]),
    (False, True, False): ([1, 2, 333], [66, 77, 88], [1, 2, 336], [72, 84, 96]),
    (False, True, True): ([1, 2, 333], [666, 777, 888], [1, 2, 336], [672, 784, 896]),
    (True, False, False): ([111, 222, 33], [66, 77, 88], [112, 224, 36], [72, 84, 96]),
    (True, False, True): ([111, 222, 33], [666, 777, 888], [112, 224, 36], [672, 784, 896]),
    (True, True, False): ([111, 222, 333], [66, 77, 88], [112, 224, 336], [72, 84, 96]),
    (True, True, True): ([111, 222, 333], [666, 777, 888], [112, 224, 336], [672, 784, 896]),
}


@pytest.mark.parametrize("flags", list(EXPECTED))
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_frozen_aware_costs_in_every_combination(flags, recompute):
    costs = frozen_aware_layer_costs(FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, _trainable(*flags), ORDER,
                                     recompute=recompute)
    vision, llm, vision_recompute, llm_recompute = EXPECTED[flags]
    assert list(costs) == ORDER
    assert costs["vision"] == (vision_recompute if recompute == "full" else vision)
    assert costs["llm"] == (llm_recompute if recompute == "full" else llm)
    assert costs["audio"] == [4, 5]


def test_any_trainable_encoder_makes_the_llm_backpropagate():
    # only audio's projector trains: vision stays forward-only, the LLM computes input gradients
    trainable = {"vision": [False] * 3, "audio": [False, True], "llm": [False] * 3}
    costs = frozen_aware_layer_costs(FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, trainable, ORDER)
    assert costs == {"vision": [1, 2, 3], "audio": [4, 555], "llm": [66, 77, 88]}


def test_recompute_per_module_and_the_breakdown():
    trainable = _trainable(True, True, False)
    costs = frozen_aware_layer_costs(FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, trainable, ORDER,
                                     recompute={"llm": "full"})
    assert costs == {"vision": [111, 222, 333], "audio": [4, 5], "llm": [72, 84, 96]}
    parts = frozen_aware_layer_breakdown(FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, trainable, ORDER,
                                         recompute={"llm": "full"})
    assert parts["llm"][0] == LayerCost(forward=6, backward_weight=0, backward_input=60, recompute=6,
                                        trainable=False, backpropagates=True)
    assert parts["audio"][1] == LayerCost(5, 0, 0, 0, trainable=False, backpropagates=False)
    assert parts["vision"][2].backward == 330 and parts["vision"][2].total == 333


@pytest.mark.parametrize("change, words", [
    (lambda f, t, o: f["llm"].append(9), ["backward_input['llm'] has 3 entries", "forward['llm'] has 4"]),
    (lambda f, t, o: t["vision"].pop(), ["trainable['vision'] has 2 entries"]),
    (lambda f, t, o: o.reverse(), ["must end with 'llm'"]),
    (lambda f, t, o: o.remove("audio"), ["forward has modules ['audio']"]),
    (lambda f, t, o: f["audio"].__setitem__(0, -1), ["forward['audio'][0] = -1.0"]),
])
def test_layer_costs_reject_inconsistent_input(change, words):
    forward = {k: list(v) for k, v in FORWARD.items()}
    trainable = _trainable(True, True, True)
    order = list(ORDER)
    change(forward, trainable, order)
    with pytest.raises(ValueError) as e:
        frozen_aware_layer_costs(forward, BACKWARD_INPUT, BACKWARD_WEIGHT, trainable, order)
    for w in words:
        assert w in str(e.value)


# ---- Cornstarch Fig. 7: frozen encoder, trainable projector, frozen LLM ------------------------

# Paper constants (cornstarch.md §3.2.1): B_w = B_d = F. Eight frozen encoder layers do forward
# only; the trainable projector costs F + B_w + B_d = 3; the frozen LLM layers back-propagate
# input gradients only, 2F.
FIG7_FORWARD = {"vision": [1.0] * 9, "llm": [2.0] * 8}
FIG7_TRAINABLE = {"vision": [False] * 8 + [True], "llm": [False] * 8}


def _fig7_costs(frozen_aware: bool) -> dict[str, list[float]]:
    trainable = FIG7_TRAINABLE if frozen_aware else {k: [True] * len(v) for k, v in FIG7_FORWARD.items()}
    return frozen_aware_layer_costs(FIG7_FORWARD, FIG7_FORWARD, FIG7_FORWARD, trainable, ["vision", "llm"])


def test_fig7_frozen_encoder_stages_get_more_layers_before_the_projector():
    costs = _fig7_costs(frozen_aware=True)
    assert costs["vision"] == [1.0] * 8 + [3.0] and costs["llm"] == [4.0] * 8
    bounds, value = partition(costs["vision"], 3)
    even = even_boundaries(9, 3)
    assert bounds != even
    assert value < stage_bottleneck(costs["vision"], even)
    # the stage holding the (expensive) projector takes fewer layers than under the even split
    assert bounds[-1] - bounds[-2] < even[-1] - even[-2]


def test_fig7_encoder_gets_one_fewer_stage_and_the_llm_one_more():
    # steady-state model of a balanced pipeline: the slowest stage of any module sets the pace
    def search(costs):
        def iteration_time(counts):
            return max(partition(costs[m], k)[1] for m, k in counts.items())
        return loosely_coupled_search(costs["llm"], {"vision": costs["vision"]}, 4, iteration_time)

    unaware = search(_fig7_costs(frozen_aware=False))
    aware = search(_fig7_costs(frozen_aware=True))
    assert unaware.stage_counts == {"vision": 2, "llm": 2}
    assert aware.stage_counts == {"vision": 1, "llm": 3}


# ---- loosely-coupled search (Algorithm 1) -------------------------------------------------------


def test_search_picks_the_argmin_within_the_budget():
    llm = [4.0] * 8
    encoders = {"vision": [1.0] * 6 + [3.0], "audio": [2.0] * 4}
    seen = []

    def iteration_time(counts):
        seen.append(dict(counts))
        # synthetic: pipeline fill grows with total depth, the steady phase shrinks with it
        depth = sum(counts.values())
        return 100.0 / counts["llm"] + 3.0 * depth

    result = loosely_coupled_search(llm, encoders, 8, iteration_time)
    evaluated = [c for c in result.candidates if c.within_budget]
    assert [c.stage_counts for c in evaluated] == seen
    assert all(c.devices <= 8 for c in evaluated)
    assert all(not c.within_budget and c.devices > 8 for c in result.candidates if c not in evaluated)
    best = min(evaluated, key=lambda c: c.iteration_time)
    assert result.stage_counts == best.stage_counts and result.iteration_time == best.iteration_time
    assert list(result.stage_counts) == ["vision", "audio", "llm"]
    for c in result.candidates:
        # every encoder takes the fewest stages that meet the LLM's stage time
        for name, k in c.stage_counts.items():
            if name == "llm":
                continue
            assert c.stage_times[name] <= c.target_stage_time or k == len(encoders[name])
            if k > 1:
                assert partition(encoders[name], k - 1)[1] > c.target_stage_time
        assert c.boundaries["llm"] == partition(llm, c.stage_counts["llm"])[0]
    assert result.boundaries == best.boundaries


def test_search_counts_ranks_per_stage_and_caps_llm_depth():
    llm = [1.0] * 6
    encoders = {"vision": [1.0] * 6}
    result = loosely_coupled_search(llm, encoders, 10, lambda counts: -counts["llm"], max_llm_stages=4,
                                    ranks_per_stage={"llm": 2})
    assert [c.stage_counts["llm"] for c in result.candidates] == [1, 2, 3, 4]
    # LLM stages of 6, 3, 2 and 2 layers; vision matches each with 1, 2, 3 and 3 stages
    assert [c.stage_counts["vision"] for c in result.candidates] == [1, 2, 3, 3]
    assert [c.devices for c in result.candidates] == [3, 6, 9, 11]
    assert [c.within_budget for c in result.candidates] == [True, True, True, False]
    assert result.stage_counts == {"vision": 3, "llm": 3} and result.devices == 9


def test_search_clamps_an_encoder_that_cannot_meet_the_target():
    # a single vision layer costs more than any LLM stage: one layer per stage is the best it can do
    result = loosely_coupled_search([1.0] * 4, {"vision": [10.0, 10.0]}, 6, lambda counts: 1.0)
    assert all(c.stage_counts["vision"] == 2 for c in result.candidates)
    assert result.stage_counts == {"vision": 2, "llm": 1}  # ties go to the smaller plan


def test_search_raises_when_nothing_fits_and_names_the_minimum():
    with pytest.raises(ValueError) as e:
        loosely_coupled_search([1.0] * 4, {"vision": [10.0, 10.0], "audio": [1.0]}, 3, lambda counts: 1.0)
    assert "device_budget = 3" in str(e.value) and "needs 4 devices" in str(e.value)


@pytest.mark.parametrize("kwargs, words", [
    (dict(device_budget=0), ["device_budget = 0"]),
    (dict(ranks_per_stage={"video": 2}), ["ranks_per_stage names ['video']"]),
    (dict(max_llm_stages=0), ["max_llm_stages = 0"]),
    (dict(encoder_layer_costs={"llm": [1.0]}), ["encoder_layer_costs has an entry named 'llm'"]),
    (dict(encoder_layer_costs={"vision": []}), ["encoder_layer_costs['vision']", "empty"]),
])
def test_search_rejects_bad_input(kwargs, words):
    args = dict(llm_layer_costs=[1.0] * 4, encoder_layer_costs={"vision": [1.0]}, device_budget=4,
                iteration_time=lambda counts: 1.0)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        loosely_coupled_search(**args)
    for w in words:
        assert w in str(e.value)


# ---- writing boundaries into a plan -------------------------------------------------------------


def test_frozen_aware_boundaries_fill_a_plan_that_resolves():
    costs = _fig7_costs(frozen_aware=True)
    plan = Plan([ModuleSpec("vision", num_stages=3), ModuleSpec("llm", num_stages=3)])
    filled = frozen_aware_boundaries(plan, costs)
    assert plan.modules[0].stage_boundaries is None  # the input plan is left alone
    assert filled.spec("vision").stage_boundaries == partition(costs["vision"], 3)[0]
    assert filled.spec("llm").stage_boundaries == partition(costs["llm"], 3)[0]
    filled.resolve({"vision": 9, "llm": 8}, world_size=6)


def test_frozen_aware_boundaries_keep_given_boundaries_unless_overridden():
    costs = _fig7_costs(frozen_aware=True)
    plan = Plan([ModuleSpec("vision", num_stages=3, stage_boundaries=[0, 3, 6, 9]), ModuleSpec("llm", num_stages=2)])
    kept = frozen_aware_boundaries(plan, costs)
    assert kept.spec("vision").stage_boundaries == [0, 3, 6, 9]
    redone = frozen_aware_boundaries(plan, costs, override=True)
    assert redone.spec("vision").stage_boundaries == partition(costs["vision"], 3)[0]
    with pytest.raises(PlanError, match="no entry for plan.modules\\['llm'\\]"):
        frozen_aware_boundaries(plan, {"vision": costs["vision"]})
    with pytest.raises(PlanError, match="num_stages = 9"):
        frozen_aware_boundaries(Plan([ModuleSpec("llm", num_stages=9)]), costs)


def test_plan_with_stage_counts_repartitions_the_named_modules():
    costs = _fig7_costs(frozen_aware=True)
    plan = Plan([ModuleSpec("vision", num_stages=2, stage_boundaries=[0, 5, 9]), ModuleSpec("llm")])
    result = loosely_coupled_search(costs["llm"], {"vision": costs["vision"]}, 4,
                                    lambda counts: max(partition(costs[m], k)[1] for m, k in counts.items()))
    built = plan_with_stage_counts(plan, result.stage_counts, costs)
    assert {m.name: m.num_stages for m in built.modules} == result.stage_counts
    assert {m.name: m.stage_boundaries for m in built.modules} == result.boundaries
    built.resolve({"vision": 9, "llm": 8}, world_size=4)


def test_partition_and_cost_model_share_one_frozen_rule():
    """`frozen_aware_layer_breakdown` and `loom.cost.frozen.backward_needs` apply the same rule,
    including the raw-data refinement: a trainable front-end computes no input gradient."""
    from loom.cost.frozen import needs_from_flags

    trainable = {"vision": [True, False, True], "llm": [False, False, False]}
    reads_data = {"vision": [True, False, False], "llm": [True, False, False]}
    ones = {m: [1.0] * len(f) for m, f in trainable.items()}
    breakdown = frozen_aware_layer_breakdown(ones, ones, ones, trainable, ["vision", "llm"], reads_data=reads_data)
    needs = needs_from_flags(trainable, reads_data)
    for m in trainable:
        assert [c.backward_input > 0 for c in breakdown[m]] == [n.input for n in needs[m]]
        assert [c.backward_weight > 0 for c in breakdown[m]] == [n.weight for n in needs[m]]
    assert [n.input for n in needs["vision"]] == [False, True, True]  # front-end: nothing before it
    assert [n.input for n in needs["llm"]] == [True, True, True]  # the embedding feeds the merge's gradient
