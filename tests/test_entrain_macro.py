"""Entrain's macro planning (`loom.planner.entrain_macro`, entrain.md §3.2-3.3):

- eq. C.5's trial counts; the rounding rule (largest remainder, at least one unit) against brute
  force over every integer vector, and the paper's 1:0.98 / 1:1.12 example;
- Algorithm 2 (``b_min``) on synthetic i.i.d. workloads with known statistics: a mean far from
  an allocation breakpoint passes at ``n0``, ``b_min`` is ``n0`` times a power of two, more
  variance never needs a smaller ``b_min``, the CLT bound ``(6 sigma / d)^2`` holds, the
  reference batch is drawn apart from the ``k`` validations, the cap's error;
- eq. 4.1 against brute-force contiguous partitions, eq. 4.2 on hand examples, Algorithm 3
  against brute-force enumeration of the same objective;
- `entrain_layouts` on a small scenario: plans the search can take, filling the cluster.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from loom.plan.plan import LLM
from loom.planner.entrain_macro import (
    Component,
    Configuration,
    ScenarioPricing,
    allocations,
    configuration_search,
    entrain_layouts,
    estimate_proportions,
    intra_module_balance,
    iteration_time,
    mean_microbatch,
    minimum_profiling_batch,
    pool_work,
    proportional_allocation,
    scenario_macro_plan,
    validation_trials,
)
from loom.planner.search import SearchSpace, _Pricer
from loom.sim.scenario import load_scenario
from tests.test_search import SMALL as SEARCH_SMALL


# ---- eq. C.5 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha, p_error, k", [(0.05, 0.05, 59), (0.05, 0.01, 299), (0.01, 0.05, 90),
                                               (0.01, 0.01, 459), (0.1, 0.1, 22)])
def test_validation_trials(alpha, p_error, k):
    assert validation_trials(alpha, p_error) == k
    # the defining inequality: k trials suffice, k - 1 do not
    assert (1 - p_error) ** k <= alpha < (1 - p_error) ** (k - 1)


@pytest.mark.parametrize("alpha, p_error", [(0, 0.05), (1, 0.05), (0.05, 0), (0.05, 1.5)])
def test_validation_trials_refuses_probabilities_outside_0_1(alpha, p_error):
    with pytest.raises(ValueError, match="alpha|p_error"):
        validation_trials(alpha, p_error)


# ---- proportional allocation (gap 7.3) -------------------------------------------------------
def _admissible(units: int, n: int):
    """Every vector of ``n`` whole numbers >= 1 summing to ``units``."""
    for v in itertools.product(range(1, units + 1), repeat=n):
        if sum(v) == units:
            yield v


def test_proportional_allocation_minimises_the_deviation_from_the_quotas():
    rng = np.random.default_rng(1)
    cases = 0
    for g in (1, 2):
        for n in (2, 3):
            for units in range(n, 9):
                for _ in range(12):
                    p = rng.random(n) ** 3  # some quotas below one unit
                    got = proportional_allocation(units * g, p, g)
                    assert sum(got) == units * g and all(x % g == 0 and x >= g for x in got)
                    a = np.array(got) / g
                    q = units * p / p.sum()
                    l1 = min(np.abs(np.array(v) - q).sum() for v in _admissible(units, n))
                    l2 = min(((np.array(v) - q) ** 2).sum() for v in _admissible(units, n))
                    assert np.abs(a - q).sum() <= l1 + 1e-9
                    assert ((a - q) ** 2).sum() <= l2 + 1e-9
                    if np.all(q >= 1):  # Hamilton's method: floor or ceil, the leftovers to the largest remainders
                        assert np.all(np.floor(q) <= a) and np.all(a <= np.ceil(q))
                        up = a > np.floor(q)
                        rem = q - np.floor(q)
                        if up.any() and (~up).any():
                            assert rem[up].min() >= rem[~up].max() - 1e-12
                    cases += 1
    assert cases > 100


def test_proportional_allocation_the_papers_example_and_ties():
    # entrain.md §3.2: "1:0.98 and 1:1.12 both round to 1:1 when only 2 GPUs are available"
    assert proportional_allocation(2, [1, 0.98]) == (1, 1)
    assert proportional_allocation(2, [1, 1.12]) == (1, 1)
    assert proportional_allocation(16, [1.27, 1]) == (9, 7)
    assert proportional_allocation(16, [1.27, 1], 2) == (8, 8)  # TP 2: units of 2 GPUs
    assert proportional_allocation(3, [1, 1]) == (2, 1)  # a tie goes to the earlier component
    assert proportional_allocation(4, [1, 0, 0]) == (2, 1, 1)  # every component at least one unit
    assert proportional_allocation(8, [3, 1], [2, 1]) == (6, 2)  # a granularity per component
    # quotas 1.5 and 3 units: the one-GPU units fill what a two-GPU unit no longer fits
    assert proportional_allocation(6, [1, 1], [2, 1]) == (2, 4)


def test_proportional_allocation_refusals():
    with pytest.raises(ValueError, match="budget_per_replica"):
        proportional_allocation(3, [1, 1], 2)  # not even a unit each
    with pytest.raises(ValueError, match="granularity"):
        proportional_allocation(7, [1, 1], [2, 4])  # odd GPUs in even units
    with pytest.raises(ValueError, match="proportions"):
        proportional_allocation(4, [0, 0])
    with pytest.raises(ValueError, match="granularity"):
        proportional_allocation(4, [1, 1], [1, 1, 1])


def test_estimate_proportions_is_the_ratio_of_sums():
    w = np.array([[1.0, 1.0], [3.0, 1.0]])
    assert estimate_proportions(w) == pytest.approx([4 / 6, 2 / 6])  # not the mean ratio 0.625
    assert estimate_proportions(w, np.array([1])) == pytest.approx([0.75, 0.25])
    with pytest.raises(ValueError, match="sum to zero"):
        estimate_proportions(np.zeros((2, 2)))


# ---- Algorithm 2 on synthetic workloads with known statistics ----------------------------------
# Two components, encoder share r_i per sample and w_enc + w_llm = 1, so a batch's proportion is
# the mean of r (ratio of sums = mean of ratios). 16 GPUs at granularity 1: the allocation is
# (8, 8) for a share in (7.5/16, 8.5/16), so a mean of 0.5 sits d = 1/32 from either breakpoint.
BUDGET, D = 16, 1 / 32


def _pool(sigma: float, size: int = 60_000, seed: int = 7) -> np.ndarray:
    z = np.random.default_rng(seed).uniform(-1, 1, size) * math.sqrt(3)  # mean 0, std 1
    r = 0.5 + sigma * z
    return np.column_stack([r, 1 - r])


def _doubling(n0: int, n: float) -> int:
    """The first n0 2^j at least n."""
    return n0 * 2 ** max(0, math.ceil(math.log2(n / n0)))


def test_b_min_far_from_a_breakpoint_passes_at_n0():
    # every sample's share lies within 0.017 of the mean, inside the (8, 8) region
    result = minimum_profiling_batch(_pool(0.01), BUDGET, max_n=4096, n0=2)
    assert result.b_min == 2 and result.allocation == (8, 8) and result.trials == 59
    assert len(result.rounds) == 1 and result.rounds[0].validations == 59 and result.rounds[0].stable
    assert result.batches == 60  # the reference batch is drawn apart from the 59 validations


@pytest.mark.parametrize("n0", [1, 3])
def test_b_min_grows_with_the_variance_and_meets_the_clt_bound(n0):
    found = []
    for sigma in (0.03, 0.08, 0.2):
        result = minimum_profiling_batch(_pool(sigma), BUDGET, max_n=8192, n0=n0, seed=3)
        b = result.b_min
        j = round(math.log2(b / n0))
        assert b == n0 * 2**j  # n0 times a power of two
        # every round before the last failed, the last passed all k validations
        assert [r.batch_size for r in result.rounds] == [n0 * 2**i for i in range(j + 1)]
        assert all(not r.stable and 1 <= r.validations <= result.trials for r in result.rounds[:-1])
        assert result.rounds[-1].stable and result.rounds[-1].validations == result.trials
        assert result.batches == sum(1 + r.validations for r in result.rounds)
        # C.1: by (6 sigma / d)^2 a batch mis-allocates with probability ~2e-9, so the doubling
        # reaching it passes; in practice far earlier
        bound = (6 * sigma / D) ** 2
        assert b <= _doubling(n0, bound)
        assert b <= bound
        found.append(b)
    assert found == sorted(found) and found[-1] > found[0]


def test_b_min_is_deterministic_and_capped():
    pool = _pool(0.2)
    a = minimum_profiling_batch(pool, BUDGET, max_n=8192, seed=11)
    b = minimum_profiling_batch(pool, BUDGET, max_n=8192, seed=11)
    assert a == b
    with pytest.raises(ValueError, match="max_n = 64"):
        minimum_profiling_batch(pool, BUDGET, max_n=64, seed=11)
    with pytest.raises(ValueError, match="max_n"):
        minimum_profiling_batch(pool[:10], BUDGET, max_n=64)  # larger than the pool


def test_b_min_depends_on_the_budget_per_replica():
    # the same data at 4 GPUs a replica: (2, 2) for a share in (0.375, 0.625), d = 1/8
    pool = _pool(0.08)
    small = minimum_profiling_batch(pool, 4, max_n=8192, seed=5).b_min
    large = minimum_profiling_batch(pool, 16, max_n=8192, seed=5).b_min
    assert small < large


# ---- eqs. 4.1 and 4.2 --------------------------------------------------------------------------
def _partitions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [0, *cuts, n]


def test_intra_module_balance_against_brute_force():
    rng = np.random.default_rng(2)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        costs = rng.random(n).round(3).tolist()
        for k in range(1, n + 1):
            bounds, taus = intra_module_balance(costs, k)
            assert len(taus) == k and bounds[0] == 0 and bounds[-1] == n
            assert taus == pytest.approx([sum(costs[bounds[s]:bounds[s + 1]]) for s in range(k)])
            best = min(max(sum(costs[b[s]:b[s + 1]]) for s in range(k)) for b in _partitions(n, k))
            assert max(taus) == pytest.approx(best, abs=1e-12)


def test_iteration_time_eq_4_2_by_hand():
    # one encoder, eq. 4.2 as written: sum of every stage + (K - 1) beta_max
    assert iteration_time([[1, 2]], [2, 1, 1], 3) == 7 + 2 * 2
    # two encoders in parallel: the longer (3) leads the chain; beta_max 3 from the second
    assert iteration_time([[1, 2], [3]], [2, 2, 1], 4, reshard=0.5) == pytest.approx(3 + 5 + 3 * 3 + 0.5)
    assert iteration_time([], [4], 1) == 4  # the LLM alone, one microbatch
    with pytest.raises(ValueError, match="num_microbatches"):
        iteration_time([[1]], [1], 0)


# ---- Algorithm 3 against brute force -------------------------------------------------------------
LAYERS = {"vision": 6, "llm": 5}


def _instance(seed: int = 4):
    rng = np.random.default_rng(seed)
    base = {name: rng.uniform(0.5, 1.5, n) for name, n in LAYERS.items()}
    base["vision"][-1] *= 0.3  # a light merger
    base["llm"][-1] *= 2.0  # a heavy head

    def costs(name):
        # TP 2 halves compute and adds a little communication per layer; CP 2 likewise
        return lambda tp, cp: list(base[name] / (tp * cp) * (1 + 0.07 * (tp - 1) + 0.11 * (cp - 1)))

    components = [Component("vision", ((1, 1), (2, 1)), costs("vision")),
                  Component("llm", ((1, 1), (2, 1), (1, 2)), costs("llm"))]
    return components, base


def _reshard(encoder, src, dst, k):
    return 0.013 * k * max(src[0] * src[1], dst[0] * dst[1])


def _fits(config: Configuration) -> bool:
    # a toy memory rule: an LLM stage holds at most 3 layers
    llm = config.component("llm")
    return max(b - a for a, b in zip(llm.boundaries, llm.boundaries[1:])) <= 3


def _brute_force(components, proportions, gpus, batch, mu, spread):
    """Every DP, allocation, factorisation and contiguous partition, priced by eq. 4.2 written
    out; per structural configuration the fastest partition."""
    best = {}
    for dp in range(1, gpus + 1):
        if gpus % dp or batch % (dp * mu):
            continue
        k = batch // (dp * mu)
        budget = gpus // dp
        if spread:
            allocs = [v for v in itertools.product(range(1, budget + 1), repeat=2) if sum(v) == budget]
        else:
            try:
                allocs = [proportional_allocation(budget, proportions, [c.granularity for c in components])]
            except ValueError:
                continue
        for m in allocs:
            per = []
            for c, mi in zip(components, m):
                opts = []
                for tp, cp in c.parallel:
                    if mi % (tp * cp) or not 1 <= mi // (tp * cp) <= LAYERS[c.name]:
                        continue
                    pp = mi // (tp * cp)
                    costs = c.costs(tp, cp)
                    for b in _partitions(len(costs), pp):
                        opts.append((tp, cp, pp, tuple(b), [sum(costs[b[s]:b[s + 1]]) for s in range(pp)]))
                per.append(opts)
            for (vt, vc, vp, vb, vtau), (lt, lc, lp, lb, ltau) in itertools.product(*per):
                if max(b - a for a, b in zip(lb, lb[1:])) > 3:  # `_fits`
                    continue
                extra = _reshard("vision", (vt, vc), (lt, lc), k) if (vt, vc) != (lt, lc) else 0.0
                t = sum(vtau) + sum(ltau) + (k - 1) * max(vtau + ltau) + extra
                key = (dp, (vt, vc, vp), (lt, lc, lp))
                best[key] = min(best.get(key, math.inf), t)
    return best


@pytest.mark.parametrize("spread", [0, 16])
def test_configuration_search_against_brute_force(spread):
    components, _ = _instance()
    proportions = [0.55, 0.45]
    gpus, batch, mu = 8, 16, 2
    got = configuration_search(components, proportions, gpus, batch, mu, fits=_fits, reshard=_reshard, keep=5,
                               spread=spread)
    brute = _brute_force(components, proportions, gpus, batch, mu, spread)
    ranked = sorted(brute.items(), key=lambda kv: kv[1])
    assert len(got) == min(5, len(ranked))
    assert [c.iteration_time for c in got] == pytest.approx([t for _, t in ranked[:len(got)]], rel=1e-12)
    best = got[0]
    key = (best.data_parallel, *((c.tensor_parallel, c.context_parallel, c.stages) for c in best.components))
    assert key == ranked[0][0]
    for c in got:
        assert sum(x.gpus for x in c.components) * c.data_parallel == gpus
        assert c.num_microbatches * c.data_parallel * mu == batch
        assert _fits(c)
        assert c.throughput == pytest.approx(c.data_parallel * c.num_microbatches / c.iteration_time)
        for x in c.components:
            assert x.gpus == x.tensor_parallel * x.context_parallel * x.stages


def test_configuration_search_keeps_to_the_proportional_allocation():
    components, _ = _instance()
    for c in configuration_search(components, [0.55, 0.45], 8, 16, 2, keep=50):
        m = tuple(x.gpus for x in c.components)
        assert m == proportional_allocation(8 // c.data_parallel, [0.55, 0.45], [1, 1])
    assert allocations(8, [0.55, 0.45], [1, 1])[0] == (4, 4)
    assert sorted(allocations(8, [0.55, 0.45], [1, 1], spread=1)) == [(3, 5), (4, 4), (5, 3)]


def test_configuration_search_refuses_when_nothing_is_valid():
    components, _ = _instance()
    with pytest.raises(ValueError, match="no configuration"):
        configuration_search(components, [0.5, 0.5], 8, 3, 2)  # no DP divides 3 samples in pairs
    with pytest.raises(ValueError, match="no configuration"):
        configuration_search(components, [0.5, 0.5], 8, 16, 2, fits=lambda c: False)


# ---- on a scenario ---------------------------------------------------------------------------
SMALL = SEARCH_SMALL.split("\n[search]")[0]  # tests/test_search.py's scenario without its narrowed space

SPACE = SearchSpace(tensor_parallel=(1, 2, 4), microbatch_samples=(2, 4))


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    path = tmp_path_factory.mktemp("entrain") / "small.toml"
    path.write_text(SMALL)
    return load_scenario(path)


@pytest.fixture(scope="module")
def macro(scenario):
    return scenario_macro_plan(scenario, SPACE, keep=4, samples=512)


def test_macro_plan_on_a_scenario(scenario, macro):
    assert macro.components == ["vision", LLM]
    assert sum(macro.proportions.values()) == pytest.approx(1.0)
    assert 0 < macro.proportions["vision"] < 1
    assert macro.b_min and all(b is None or (b & (b - 1) == 0 and b <= 64) for b in macro.b_min.values())
    times = [c.iteration_time for c in macro.configurations]
    assert 1 <= len(times) <= 4 and times == sorted(times)
    for c in macro.configurations:
        assert 64 % (c.data_parallel * c.microbatch) == 0
        m = tuple(x.gpus for x in c.components)
        assert m == proportional_allocation(16 // c.data_parallel, list(macro.proportions.values()),
                                            [1, 1])  # TP 1 is allowed: granularity 1


def test_entrain_layouts_are_plans_the_search_takes(scenario, macro):
    plans = list(entrain_layouts(scenario, SPACE, 3))
    assert 1 <= len(plans) <= 3
    layers = scenario.arch.layer_counts()
    pricer = _Pricer(scenario)
    for plan, config in zip(plans, macro.configurations):
        assert plan.placement == "disaggregated" and plan.module_names == ["vision", LLM]
        plan.resolve(layers, scenario.cluster.num_gpus, generators=scenario.arch.generator_names)
        assert plan.world_size == scenario.cluster.num_gpus
        for spec, layout in zip(plan.modules, config.components):
            assert (spec.data_parallel, spec.tensor_parallel, spec.context_parallel, spec.num_stages) == (
                config.data_parallel, layout.tensor_parallel, layout.context_parallel, layout.stages)
        # the search fills in the rest and prices it
        filled = pricer.plan(plan, plan.num_microbatches, "1f1b", 1, 1, "none")
        assert math.isfinite(pricer.estimate(filled).iteration_time)


def test_entrain_layouts_yield_nothing_where_entrain_does_not_apply(scenario):
    assert list(entrain_layouts(scenario, SearchSpace(placements=("first_stage",)), 3)) == []
    assert list(entrain_layouts(scenario, SPACE, 0)) == []
    generators = load_scenario("configs/sim/disttrain-mllm9b-sd21-96xh100.toml")
    assert generators.arch.generator_names
    assert list(entrain_layouts(generators, SPACE, 3)) == []


def test_scenario_pricing_reshard_and_memory(scenario):
    pricing = ScenarioPricing(scenario, mean_microbatch(pool_work(scenario, 64), 4))
    inside = pricing.reshard("vision", (1, 1), (2, 1), 8)
    assert inside > 0 and pricing.reshard("vision", (1, 1), (2, 1), 16) == pytest.approx(2 * inside)
    # a 16-rank group spans two nodes: the slower link
    assert pricing.reshard("vision", (1, 1), (8, 2), 8) > pricing.reshard("vision", (1, 1), (8, 1), 8)
    # Llama-3-8B whole on one H100 with Adam (16 bytes a parameter, ~128 GB) does not fit; on 8 stages it does
    components = [Component(n, ((1, 1),), lambda tp, cp, n=n: pricing.costs(n, tp, cp)) for n in ("vision", LLM)]
    for llm_gpus, fits in ((1, False), (8, True)):
        configs = configuration_search(components, [1, llm_gpus], 1 + llm_gpus, 64, 4, keep=1,
                                       data_parallel=[1])
        assert configs[0].component(LLM).stages == llm_gpus
        assert pricing.fits(configs[0]) is fits
