"""Oobleck's planning (oobleck.md §3): node specification, templates, instantiation, batch
distribution, reinstantiation and layer ownership, against the paper's worked examples and brute
force on small instances."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from loom.balance.oobleck import BatchDistributionError, distribute_batch
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.planner.oobleck import (
    OobleckError, Pipeline, best_instantiation, enumerate_instantiations, instantiate, layer_copies,
    layer_holders, node_specification, pipelines_of, reinstantiate, template_plan,
)
from loom.planner.oobleck_templates import LayerTimes, TemplateError, plan_templates
from loom.schedule.generators import build_schedule
from loom.schedule.validate import validate_schedule


# ---- node specification (§3.2) -----------------------------------------------------------------
def test_node_specification_sizes_and_theorem_2_extension():
    assert node_specification(6, 1, 2).template_sizes == (2, 3, 4)
    # N - f n0 = 4 < 2 n0 - 1 = 5: extended so a merge of two short pipelines has a template
    assert node_specification(7, 1, 3).template_sizes == (3, 4, 5)
    assert node_specification(3, 0, 2).template_sizes == (2, 3)  # f = 0: capped at N


def test_node_specification_errors_name_the_numbers():
    with pytest.raises(OobleckError, match=r"\(f \+ 1\) x n0 = 3 x 3 = 9 nodes.*there are 8.*f <= 1"):
        node_specification(8, 2, 3)
    with pytest.raises(OobleckError, match="min_nodes = 2 is below the 3 nodes"):
        node_specification(8, 1, 2, memory_min_nodes=3)


def _feasible(sizes, total, f):
    """Brute force: every vector of counts with sum x_j n_j = total and sum x_j >= f + 1."""
    ranges = [range(total // n + 1) for n in sizes]
    return sorted(x for x in itertools.product(*ranges)
                  if sum(k * n for k, n in zip(x, sizes)) == total and sum(x) >= f + 1)


def test_theorem_1_every_surviving_count_has_an_instantiation():
    for N in range(1, 25):
        for f in range(0, 4):
            for n0 in range(1, 6):
                if (f + 1) * n0 > N:
                    continue
                sizes = node_specification(N, f, n0).template_sizes
                for survivors in range((f + 1) * n0, N + 1):
                    assert enumerate_instantiations(sizes, survivors, f), (N, f, n0, survivors)
                # Theorem 2: every merged size n0 .. 2 n0 - 1 (up to N) has a template
                assert set(range(n0, min(2 * n0 - 1, N) + 1)) <= set(sizes)


# ---- instantiation (§3.4, Eq. 2.5) --------------------------------------------------------------
def test_figure_2_7_worked_example():
    assert enumerate_instantiations([2, 3, 4], 7, 1) == [(2, 1, 0), (0, 1, 1)]
    assert enumerate_instantiations([2, 3, 4], 7, 2) == [(2, 1, 0)]


def test_enumeration_matches_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        sizes = sorted(rng.sample(range(1, 9), rng.randint(1, 4)))
        total, f = rng.randint(0, 20), rng.randint(0, 3)
        got = enumerate_instantiations(sizes, total, f)
        assert len(got) == len(set(got))
        assert sorted(got) == _feasible(sizes, total, f)


# ---- batch distribution (Eq. 2.6) ---------------------------------------------------------------
def _brute_distribution(a, c, m, batch, objective):
    best = math.inf
    for s in itertools.product(*(range(lo, batch + 1) for lo in m)):
        if sum(s) != batch:
            continue
        t = np.asarray(a) + np.asarray(c) * np.asarray(s)
        best = min(best, float(((t - t.mean()) ** 2).sum()) if objective == "eq2.6" else float(t.max()))
    return best


def test_batch_distribution_is_exact_on_small_instances():
    rng = random.Random(1)
    for _ in range(150):
        x = rng.randint(1, 4)
        a = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(x)]
        c = [rng.choice([1.0, 0.5, rng.uniform(0.1, 2)]) for _ in range(x)]
        m = [rng.randint(0, 2) for _ in range(x)]
        batch = rng.randint(max(1, sum(m)), 13)
        for objective in ("eq2.6", "makespan"):
            d = distribute_batch(a, c, batch, m, objective)
            assert sum(d.samples) == batch and all(s >= lo for s, lo in zip(d.samples, m))
            value = d.squared_deviation if objective == "eq2.6" else d.step_time
            assert value <= _brute_distribution(a, c, m, batch, objective) + 1e-9


def test_batch_distribution_follows_speed_and_keeps_the_batch():
    d = distribute_batch([0.0, 0.0], [1.0, 2.0], 9)  # a pipeline twice as fast takes twice the samples
    assert d.samples == (6, 3) and d.times == (6.0, 6.0)
    big = distribute_batch([1.0, 2.0, 3.0, 1.0], [0.01, 0.02, 0.013, 0.01], 8192)
    assert sum(big.samples) == 8192 and max(big.times) - min(big.times) <= 0.02 + 1e-9  # within a sample


def test_batch_distribution_too_small_recommends_a_batch():
    with pytest.raises(BatchDistributionError, match="at least 6 samples"):
        distribute_batch([0, 0, 0], [1, 1, 1], 5, [2, 2, 2])


# ---- templates (§3.3) ---------------------------------------------------------------------------
def _compositions(total, parts):
    if total == 0:
        yield ()
        return
    for g in parts:
        if g <= total:
            for rest in _compositions(total - g, parts):
                yield (g,) + rest


def _exhaustive(times, n, M, parts, nb):
    """Every GPU assignment (each node's GPUs split into stages) x every contiguous partition."""
    L, best = times.num_layers, math.inf
    for per_node in itertools.product(list(_compositions(M, parts)), repeat=n):
        gpus = [g for node in per_node for g in node]
        if len(gpus) > L:
            continue
        for cuts in itertools.combinations(range(1, L), len(gpus) - 1):
            b = (0, *cuts, L)
            t = [times.stage_time(b[s], b[s + 1], g) for s, g in enumerate(gpus)]
            best = min(best, sum(t) + (nb - 1) * max(t))
    return best


def _random_times(rng, L, M):
    forward = {1: [rng.uniform(0.1, 2) for _ in range(L)]}
    for g in range(2, M + 1):
        forward[g] = [x / g * rng.uniform(1, 1.5) + 0.01 for x in forward[1]]
    return LayerTimes(forward, {g: [2 * x for x in v] for g, v in forward.items()},
                      {g: rng.uniform(0, 1) for g in forward})


def test_templates_match_exhaustive_search():
    rng = random.Random(2)
    for _ in range(40):
        L, M, nb = rng.randint(3, 7), rng.choice([1, 2, 3]), rng.randint(1, 12)
        times = _random_times(rng, L, M)
        for n in range(1, 3):
            if n > L:
                continue
            mixed = plan_templates(times, [n], M, tensor_parallel="mixed", planning_microbatches=nb)[n]
            assert mixed.iteration_time == pytest.approx(_exhaustive(times, n, M, range(1, M + 1), nb), rel=1e-12)
            uniform = plan_templates(times, [n], M, planning_microbatches=nb)[n]
            best = min(_exhaustive(times, n, M, [t], nb) for t in range(1, M + 1) if M % t == 0)
            assert uniform.iteration_time == pytest.approx(best, rel=1e-12)
            assert uniform.tensor_parallel is not None
            for t in (mixed, uniform):  # structure: contiguous cover, all GPUs, no stage across nodes
                assert t.stage_boundaries[0] == 0 and t.stage_boundaries[-1] == L
                assert list(t.stage_boundaries) == sorted(set(t.stage_boundaries))
                assert sum(t.stage_gpus) == n * M
                assert all(local + g <= M for (_, local), g in zip(t.stage_placement(), t.stage_gpus))


def test_uniform_layers_give_balanced_stages_and_the_1f1b_time():
    times = LayerTimes({1: [1.0] * 12}, {1: [2.0] * 12})
    t = plan_templates(times, [4], 1, planning_microbatches=16)[4]
    assert t.stage_boundaries == (0, 3, 6, 9, 12)
    assert t.iteration_time == pytest.approx((16 + 4 - 1) * 9.0)  # (N_b + S - 1)(F + B)


def test_templates_share_the_memo_and_refuse_impossible_sizes():
    times = _random_times(random.Random(3), 6, 2)
    together = plan_templates(times, [1, 2, 3], 2, tensor_parallel="mixed")
    for n in (1, 2, 3):
        assert together[n] == plan_templates(times, [n], 2, tensor_parallel="mixed")[n]
    with pytest.raises(TemplateError, match="no template for 4 nodes x 2 GPUs with 6 layers"):
        plan_templates(times, [4], 2, tensor_parallel=1)


def test_template_plan_resolves_and_schedules():
    times = LayerTimes({1: [1.0] * 6, 2: [0.6] * 6}, {1: [2.0] * 6, 2: [1.2] * 6}, {1: 3.0, 2: 2.0})
    base = Plan([ModuleSpec("vision"), ModuleSpec(LLM)], placement="first_stage")
    for template in plan_templates(times, [1, 2], 2).values():
        plan = template_plan(template, base, 5, {"vision": 3, LLM: 6})
        assert plan.world_size == template.num_nodes * 2 and plan.spec(LLM).data_parallel == 1
        assert plan.spec(LLM).stage_boundaries == list(template.stage_boundaries)
        validate_schedule(build_schedule(plan, {}), plan)
    mixed = plan_templates(times, [1], 2, tensor_parallel="mixed")[1]
    if mixed.tensor_parallel is None:
        with pytest.raises(OobleckError, match="one tensor_parallel degree"):
            template_plan(mixed, base, 5)


def test_best_instantiation_prefers_throughput():
    times = LayerTimes({1: [1.0] * 8}, {1: [2.0] * 8})
    templates = plan_templates(times, node_specification(6, 1, 2).template_sizes, 1)
    best = best_instantiation(templates, 6, 1, 60, 2)
    options = enumerate_instantiations(sorted(templates), 6, 1)
    for x in options:  # no feasible X is faster
        sizes = [n for n, k in zip(sorted(templates), x) for _ in range(k)]
        assert instantiate(templates, sizes, 60, 2).throughput <= best.throughput + 1e-12
    assert sum(best.distribution.samples) == 60 and best.counts in options


# ---- reinstantiation (§3.6, Fig. 2.8) -----------------------------------------------------------
SIZES = (2, 3, 4)  # N = 6, f = 1, n0 = 2


def test_reinstantiation_simple():
    assert reinstantiate([[0, 1], [2, 3, 4, 5]], {5}, SIZES, 1) == [[0, 1], [2, 3, 4]]


def test_reinstantiation_borrows_from_the_largest():
    assert reinstantiate([[0, 1], [2, 3, 4, 5]], {1}, SIZES, 1) == [[0, 5], [2, 3, 4]]


def test_reinstantiation_merges_when_nobody_can_lend():
    assert reinstantiate([[0, 1], [2, 3], [4, 5]], {1}, SIZES, 1) == [[4, 5], [0, 2, 3]]
    # two short pipelines merge with each other first
    assert reinstantiate([[0, 1], [2, 3], [4, 5], [6, 7]], {1, 3}, (2, 3, 4, 5, 6), 1) == [[0, 2], [4, 5], [6, 7]]


def test_reinstantiation_refuses_below_f_plus_one():
    with pytest.raises(OobleckError, match=r"3 nodes remain.*\(f \+ 1\) x n0 = 2 x 2 = 4"):
        reinstantiate([[0, 1], [2, 3, 4, 5]], {0, 1, 2}, SIZES, 1)
    with pytest.raises(OobleckError, match="no template"):
        reinstantiate([[0, 1, 2], [3, 4, 5, 6, 7]], {0}, SIZES, 1)  # the 5-node one


# ---- layer ownership (§3.7) ---------------------------------------------------------------------
def test_layer_holders_and_copies_after_a_failure():
    times = LayerTimes({1: [1.0] * 6}, {1: [1.0] * 6})
    templates = plan_templates(times, [2, 3, 4], 1, planning_microbatches=8)
    before = pipelines_of([[0, 1], [2, 3, 4, 5]], templates)
    held = layer_holders(before, 6)
    assert held[0] == [(0,), (2,)] and held[5] == [(1,), (5,)]
    after = pipelines_of(reinstantiate([[0, 1], [2, 3, 4, 5]], {1}, SIZES, 1), templates)  # [0, 5], [2, 3, 4]
    copies = layer_copies(held, layer_holders(after, 6), lost_ranks={1})
    for c in copies:
        assert 1 not in c.source and c.source in held[c.layer] and c.receivers not in held[c.layer]
    needed = {(c.layer, c.receivers) for c in copies}
    new = layer_holders(after, 6)
    assert needed == {(layer, g) for layer in range(6) for g in new[layer] if g not in held[layer]}
    with pytest.raises(OobleckError, match="layer 0 has no surviving holder"):
        layer_copies(held, new, lost_ranks={0, 2})


def test_pipeline_ranks_with_several_gpus_per_node():
    times = LayerTimes({1: [1.0] * 8, 2: [0.5] * 8}, {1: [1.0] * 8, 2: [0.5] * 8})
    t = plan_templates(times, [2], 2, tensor_parallel=2)[2]
    p = Pipeline(t, (5, 3))
    assert [p.stage_ranks(s) for s in range(t.num_stages)] == [(10, 11), (6, 7)]


def test_multimodal_templates_host_the_encoders_and_run_in_the_simulator():
    from loom.planner.oobleck_costs import layer_times, one_stage_plan, stage_gpu_counts
    from loom.sim.scenario import load_scenario

    scenario = load_scenario("configs/sim/entrain-llava150k-llama32-1b-64xa40.toml",
                             ["cluster.num_gpus=8", "cluster.gpus_per_node=2", "data.global_batch_size=16"])
    assert stage_gpu_counts(scenario) == [1, 2]
    times = layer_times(scenario, 2)
    assert times.num_layers == scenario.arch.layer_counts()[LLM] and times.first_stage[1] > 0
    base = one_stage_plan(scenario, 1)
    for template in plan_templates(times, [1, 2], 2).values():
        plan = template_plan(template, base, 4, scenario.arch.layer_counts())
        assert plan.placement == "first_stage" and plan.spec("vision").tensor_parallel == template.tensor_parallel
        simulated = scenario.run(plan, scenario.microbatch_work(scenario.metas()[:8], 4)).iteration_time
        # the template's own model leaves out sends, the optimizer step and the loss: same order
        assert 0.5 * template.time(4) < simulated < 2 * template.time(4)


def test_uncoverable_node_count_names_the_numbers():
    times = LayerTimes({1: [1.0] * 8}, {1: [2.0] * 8})
    templates = plan_templates(times, [3], 1)
    with pytest.raises(OobleckError, match=r"7 nodes cannot form 2 or more pipelines from templates of \[3\] nodes"):
        best_instantiation(templates, 7, 1, 32, 2)
    with pytest.raises(OobleckError, match=r"no template for pipelines of \[4\] nodes"):
        instantiate(templates, [3, 4], 32, 2)
