"""The planner's search (`loom.planner.search`), its analytic estimate (`loom.planner.estimate`)
and ``loom plan --search``, on a small scenario (Llama-3-8B with a ViT-H/14 on 16 H100s, a
global batch of 64) that searches in a second or two:

- what the search returns fits the GPU's memory in simulation and has a valid schedule;
- its regret against brute force: every plan it priced, simulated, against its winner;
- the estimate against the simulator on equal microbatches, `expected_max` and
  `TokenWindows.heaviest` against their definitions;
- its refusals (nothing fits; a bad ``[search]`` table), the plan file the CLI writes and
  ``loom simulate --plan`` takes, and a custom data mix (``[data.kinds.<name>]``);
- Cornstarch's loosely-coupled layouts (``search.cornstarch``) on the same cluster with an
  encoder heavier than its LLM (``HEAVY_ENCODER``): against brute force over every split of
  the device budget, and switched off.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from loom.cli import main
from loom.plan.plan import LLM, Plan
from loom.planner.estimate import TokenWindows, estimate, expected_max
from loom.planner.partition import loosely_coupled_search, partition
from loom.planner.search import (SearchSpace, _layouts, _loosely_coupled, _microbatches, _Pricer, _strategy_layouts,
                                 search)
from loom.schedule.generators import build_schedule
from loom.schedule.validate import validate_schedule
from loom.sim.bubble_fill import fill_bubbles
from loom.sim.scenario import ScenarioError, load_scenario

GiB = 2**30

SMALL = """\
name = "small"

[model]
llm = "llama3-8b"
encoders = { vision = "vit-h-14" }
projector = "mlp"

[cluster]
gpu = "H100"
num_gpus = 16
gpus_per_node = 8

[data]
mix = "llava"
seed = 0
global_batch_size = 64

# every placement and schedule, TP 2, 2 or 4 samples per microbatch: ~80 plans priced
[search]
tensor_parallel = [2]
microbatch_samples = [2, 4]
simulate_budget = 2000  # plays about a third of the 78 plans it prices: the regret test is not brute force
"""

# Llama-3-70B's weights, gradients and Adam state alone (~16 bytes a parameter, 140 GB over 8
# ranks even under ZeRO-3) exceed an A40's 48 GB
NOTHING_FITS = """\
[model]
llm = "llama3-70b"
encoders = { vision = "vit-h-14" }
projector = "mlp"

[cluster]
gpu = "A40"
num_gpus = 8

[data]
global_batch_size = 16
"""


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("search") / "small.toml"
    path.write_text(SMALL)
    return path


# EVA-CLIP-E (4.4B, trained) before a frozen Llama-3.2-1B, an image and 200 words a sample: the
# encoder's forward + backward about three times the LLM's, so Algorithm 1 gives it several stages
HEAVY_ENCODER = ['model.llm="llama32-1b"', 'model.encoders={vision="eva-clip-e"}', 'model.freeze=["llm"]',
                 'data.mix="custom"', "data.kinds.pic.images=[1, 1]", "data.kinds.pic.image_side=[224, 224]",
                 "data.kinds.pic.text_range=[200, 200]"]


@pytest.fixture(scope="module")
def scenario(small_path):
    return load_scenario(small_path)


@pytest.fixture(scope="module")
def heavy(small_path):
    return load_scenario(small_path, HEAVY_ENCODER)


@pytest.fixture(scope="module")
def narrow(scenario):
    """The search over the scenario file's own ``[search]`` table (default ``simulate_top``)."""
    space = SearchSpace.from_table(scenario.search)
    assert space.tensor_parallel == (2,) and space.microbatch_samples == (2, 4)
    return search(scenario, space)


def _peak(result) -> float:
    return max(result.peak_memory.values())


def _schedule(scenario, plan):
    """The schedule the simulator plays for ``plan`` (as `Scenario.run`, bubble fill included)."""
    schedule = build_schedule(plan, scenario.trainable_stages(plan))
    if plan.bubble_fill == "optimus":
        work = scenario.microbatch_work(scenario.metas(), plan.num_microbatches)
        schedule = fill_bubbles(schedule, plan, scenario.cost_model(plan), work).schedule
    return schedule


# ---- 1. what the search returns fits and runs ------------------------------------------------
@pytest.mark.parametrize("which", ["scenario", "heavy"])
def test_every_plan_the_search_returns_fits_memory_and_has_a_valid_schedule(which, request):
    """On the small scenario and on its heavy-encoder variant, whose winner is Cornstarch's:
    an encoder pipeline of its own (several stages), played and validated like every other."""
    scenario = request.getfixturevalue(which)
    capacity = scenario.memory_capacity()
    result = search(scenario, SearchSpace(simulate_budget=2000))  # the whole default space, a third played
    best = result.best
    assert best.verdict == "best" and best.simulated is not None
    assert result.priced >= len(result.candidates) > 0 and result.pruned_memory > 0
    assert best.plan.world_size == scenario.cluster.num_gpus

    # the winner, simulated again on its own: the same time, within the GPU's memory
    again = scenario.run_balanced(best.plan, best.policy).result
    assert again.iteration_time == pytest.approx(best.iteration_time, rel=1e-9)
    assert _peak(again) <= capacity, f"{best.layout}: {_peak(again) / GiB:.1f} GiB"

    played = [c for c in result.candidates if c.simulated is not None]
    assert best in played and len(played) >= 2
    for c in result.candidates:  # every priced plan fits by its estimate
        assert c.estimate.peak_memory <= capacity, c.layout
        assert c.plan.world_size <= scenario.cluster.num_gpus
    for c in played:  # every played plan not pruned fits in simulation; a pruned one does not
        fits = _peak(c.simulated) <= capacity
        assert fits != c.verdict.startswith("pruned"), (c.layout, c.verdict, _peak(c.simulated) / GiB)
        if fits:
            assert best.iteration_time <= c.iteration_time
        validate_schedule(_schedule(scenario, c.plan), c.plan)  # raises on a malformed schedule
    # the played come first, fastest first among the fitting
    times = [c.iteration_time for c in played if not c.verdict.startswith("pruned")]
    assert times == sorted(times) and result.candidates[0] is best
    assert result.techniques and result.techniques[0]
    if which == "heavy":
        assert best.plan.spec("vision").num_stages > 1, best.layout
        assert result.techniques[0] == ("Cornstarch's loosely-coupled modality parallelism (each encoder its own "
                                        "pipeline depth)")


# ---- 2. regret against brute force ------------------------------------------------------------
def test_search_regret_against_every_priced_plan_simulated(scenario, narrow):
    """Every plan the search priced, simulated: the search's winner (its default simulate_top)
    within 2 % of the fastest that fits the GPU's memory."""
    capacity = scenario.memory_capacity()
    assert len(narrow.candidates) >= 40  # a space worth searching
    assert sum(c.simulated is not None for c in narrow.candidates) < len(narrow.candidates) / 2  # not brute force
    exhaustive = []
    for c in narrow.candidates:
        r = scenario.run_balanced(c.plan, "none").result
        if _peak(r) <= capacity:
            exhaustive.append((r.iteration_time, c.layout))
    fastest, layout = min(exhaustive)
    assert narrow.best.iteration_time >= fastest * (1 - 1e-9)  # nothing beats brute force
    assert narrow.best.iteration_time <= 1.02 * fastest, (
        f"search picked {narrow.best.layout} at {narrow.best.iteration_time:.4f} s; brute force found "
        f"{layout} at {fastest:.4f} s ({narrow.best.iteration_time / fastest - 1:.1%} regret)")


# ---- 3. the estimate against the simulator -----------------------------------------------------
def test_estimate_matches_the_simulator_on_equal_microbatches(scenario):
    """1F1B plans of pipeline depth 1 to 8 (boundaries by cost, as the search builds them), every
    microbatch the mean one: the estimate within 10 % of the simulated iteration."""
    pricer = _Pricer(scenario)
    space = SearchSpace(placements=("first_stage", "disaggregated"), tensor_parallel=(2,), orchestrations=0)
    depths, errors = set(), []
    for layout in _layouts(scenario, space):
        n = _microbatches(scenario, layout, 2, pricer)
        if n is None:
            continue
        plan = pricer.plan(layout, n, "1f1b", 1, 0, "none")
        mean = pricer.mean(plan.num_microbatches)
        est = estimate(plan, scenario.cost_model(plan), mean)  # no sizes: equal microbatches
        sim = scenario.run(plan, [dict(mean) for _ in range(plan.num_microbatches)])
        depth = plan.spec(LLM).pipeline_depth
        depths.add((plan.placement, depth))
        errors.append((abs(est.iteration_time / sim.iteration_time - 1), plan.placement, depth,
                       est.iteration_time, sim.iteration_time))
    assert {d for p, d in depths if p == "first_stage"} >= {1, 2, 4, 8}
    assert any(p == "disaggregated" for p, _ in depths)
    worst = max(errors)
    assert worst[0] <= 0.10, f"{worst[1]} depth {worst[2]}: estimate {worst[3]:.4f} s, simulated {worst[4]:.4f} s"


# ---- 4. expected_max and TokenWindows against their definitions --------------------------------
def test_expected_max_against_enumeration():
    rng = np.random.default_rng(0)
    for sizes in ([3.0, 1.0, 2.0, 2.0], list(rng.uniform(0.2, 3.0, size=5)), [0.5, 4.0]):
        for k in (1, 2, 3, 4):
            brute = np.mean([max(t) for t in itertools.product(sizes, repeat=k)])  # all n**k draws
            assert expected_max(sizes, k) == pytest.approx(brute, rel=1e-12), (sizes, k)
        assert expected_max(sizes, 1) == pytest.approx(np.mean(sizes))
        # more draws: a larger expected maximum, approaching the largest
        values = [expected_max(sizes, k) for k in range(1, 40)]
        assert all(a <= b + 1e-12 for a, b in zip(values, values[1:])) and values[-1] <= max(sizes) + 1e-12
    for k in (1, 2, 7):
        assert expected_max([1.7] * 6, k) == pytest.approx(1.7)
    assert expected_max([], 3) == 0.0


def _heaviest_brute(tokens, replicas, n):
    """Microbatch j runs on replica j % replicas; the most tokens any ``k = ceil(n)`` consecutive
    microbatches of one replica hold, over ``k`` mean microbatches."""
    mean = sum(tokens) / len(tokens)
    replicas = max(1, min(replicas, len(tokens)))
    best = 0.0
    for r in range(replicas):
        mine = tokens[r::replicas]
        k = max(1, min(math.ceil(n), len(mine)))
        for start in range(len(mine) - k + 1):
            best = max(best, sum(mine[start:start + k]) / (k * mean))
    return best


def test_token_windows_heaviest_against_a_loop():
    rng = np.random.default_rng(1)
    tokens = [float(x) for x in rng.integers(100, 5000, size=24)]
    windows = TokenWindows(tokens)
    for replicas in (1, 2, 3, 4, 6, 8, 24, 48):
        for n in (1, 1.5, 2, 3, 5, 12, 100):
            got = windows.heaviest(replicas, n)
            assert got == pytest.approx(_heaviest_brute(tokens, replicas, n), rel=1e-12), (replicas, n)
            assert windows.heaviest(replicas, n) == got  # kept answers are the same answers
    # one window over everything is the mean; equal microbatches weigh 1
    assert windows.heaviest(1, len(tokens)) == pytest.approx(1.0)
    assert TokenWindows([7.0] * 12).heaviest(3, 2) == pytest.approx(1.0)
    assert TokenWindows().heaviest(4, 2) == 1.0 and TokenWindows([0.0, 0.0]).heaviest(1, 1) == 1.0


# ---- 5. nothing fits -------------------------------------------------------------------------------
def test_nothing_fits_names_the_least_memory_needed(tmp_path, capsys):
    path = tmp_path / "nofit.toml"
    path.write_text(NOTHING_FITS)
    scenario = load_scenario(path)
    capacity = scenario.memory_capacity() / GiB
    with pytest.raises(ScenarioError, match="least memory") as e:
        search(scenario, SearchSpace(schedules=("1f1b",), microbatch_samples=(1,)))
    needed = re.search(r"needs is ([0-9.]+) GiB", str(e.value))
    assert needed, str(e.value)
    assert float(needed.group(1)) > capacity  # what it needs is more than the GPU has
    assert "A40" in str(e.value)

    assert main(["plan", "--search", "--config", str(path), '--out', str(tmp_path / "p.toml"),
                 'search.schedules=["1f1b"]', "search.microbatch_samples=[1]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom: error:") and "least memory" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "p.toml").exists()


# ---- 6. a bad [search] table ---------------------------------------------------------------------
@pytest.mark.parametrize("table, field", [
    ({"placements": ["nowhere"]}, "search.placements"),
    ({"schedules": ["1f1b", "zigzag"]}, "search.schedules"),
    ({"policies": ["magic"]}, "search.policies"),
    ({"recompute": ["most"]}, "search.recompute"),
    ({"zero_stages": [4]}, "search.zero_stages"),
    ({"tensor_parallel": []}, "search.tensor_parallel"),
    ({"placements": []}, "search.placements"),
])
def test_bad_search_values_name_the_field(table, field):
    with pytest.raises(ScenarioError, match=re.escape(field)):
        SearchSpace.from_table(table)


def test_bad_search_values_from_the_cli(small_path, tmp_path, capsys):
    for override, field in [('search.placements=["nowhere"]', "search.placements"),
                            ("search.schedules=[]", "search.schedules"),
                            ('search.policies=["magic"]', "search.policies"),
                            ("search.simulate_top=0", "search.simulate_top"),
                            ("search.unknown=1", "in [search]")]:
        out = tmp_path / "p.toml"
        assert main(["plan", "--search", "--config", str(small_path), "--out", str(out), override]) == 2, override
        err = capsys.readouterr().err.strip()
        assert err.startswith("loom: error:") and field in err and len(err.splitlines()) == 1, err
        assert not out.exists()


# ---- 7. the plan file ------------------------------------------------------------------------------
def test_cli_writes_the_winner_as_a_plan_file_that_simulate_takes(small_path, narrow, tmp_path, capsys):
    out = tmp_path / "plans" / "best.toml"
    assert main(["plan", "--search", "--config", str(small_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and narrow.best.layout in printed
    plan = Plan.read_file(out)
    assert plan.to_toml() == narrow.best.plan.to_toml()  # the CLI's search on the file's [search] table

    # loom simulate --plan plays the same plan to the same time
    sim_out = tmp_path / "sim"
    assert main(["simulate", "--config", str(small_path), "--plan", str(out), "--no-png", "--json",
                 "--out", str(sim_out)]) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    row = next(r for r in rows if r["plan"] == "best")
    assert row["iteration_time_s"] == pytest.approx(narrow.best.iteration_time, rel=1e-9)
    assert row["fits_memory"] is True

    # a missing plan file: exit 2, one line naming the path
    missing = tmp_path / "no" / "such.toml"
    assert main(["simulate", "--config", str(small_path), "--plan", str(missing), "--no-png",
                 "--out", str(sim_out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom: error:") and str(missing) in err and len(err.splitlines()) == 1


# ---- 8. a custom data mix ----------------------------------------------------------------------------
def test_custom_data_kinds(small_path):
    text = ['data.mix="custom"', "data.kinds.text.text_range=[1000, 1000]"]
    scenario = load_scenario(small_path, text)
    assert scenario.mix == "custom"
    metas = scenario.metas()
    assert len(metas) == 64
    assert {m.text_tokens for m in metas} == {1002}  # the text and BOS/EOS
    assert all(not m.images and not m.audios for m in metas)

    both = load_scenario(small_path, [*text, "data.kinds.pic.images=[1, 1]", "data.kinds.pic.weight=3.0"])
    metas = both.metas()
    plain = [m for m in metas if not m.images]
    assert plain and len(plain) < len(metas) and all(len(m.images) == 1 for m in metas if m.images)
    assert {m.text_tokens for m in plain} == {1002}

    for override, field in [("data.kinds.text.text_range=[5, 1]", "data.kinds.text.text_range"),
                            ("data.kinds.text.text_range=[5]", "data.kinds.text.text_range"),
                            ("data.kinds.text.text_median=-1", "data.kinds.text.text_median"),
                            ("data.kinds.text.weight=0", "data.kinds.text.weight"),
                            ('data.kinds.text.images="one"', "data.kinds.text.images"),
                            ("data.kinds.text.bogus=1", "data.kinds.text")]:
        with pytest.raises(ScenarioError, match=re.escape(field)):
            load_scenario(small_path, ['data.mix="custom"', override])
    with pytest.raises(ScenarioError, match="data.mix"):  # the kinds are the mix
        load_scenario(small_path, ["data.kinds.text.text_range=[1000, 1000]"])


# ---- 9. bad model files and GPUs, through loom plan --search -----------------------------------
def test_plan_search_refuses_an_inconsistent_model_file_and_an_unknown_gpu(tmp_path, capsys):
    model = (Path("configs/models/llama3-8b.toml").read_text()
             .replace("heads = 32                     #", "heads = 30                     #"))
    bad = tmp_path / "bad-llm.toml"
    bad.write_text(model)
    scenario = tmp_path / "s.toml"
    scenario.write_text(f'[model]\nllm = "{bad}"\n\n[cluster]\ngpu = "H100"\nnum_gpus = 8\n')
    assert main(["plan", "--search", "--config", str(scenario), "--out", str(tmp_path / "p.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "hidden = 4096 is not divisible by heads = 30" in err
    assert main(["plan", "--search", "--config", str(scenario), 'model.llm="llama3-8b"', 'cluster.gpu="B300"',
                 "--out", str(tmp_path / "p.toml")]) == 2
    assert "cluster.gpu = 'B300'" in capsys.readouterr().err
    assert not (tmp_path / "p.toml").exists()


# ---- 10. Cornstarch's loosely-coupled layouts ----------------------------------------------------
@pytest.mark.parametrize("gpus", [16, 32])
def test_cornstarch_layouts_against_brute_force_over_every_split(small_path, gpus):
    """Algorithm 1 (cornstarch.md §2.6) at TP 2 and DP 1 and 2, against every (encoder stages,
    LLM stages) split of the same budget of ``gpus / (TP x DP)`` stage replicas.

    Algorithm 1 is a heuristic: at each LLM depth ``i`` it gives the encoder the fewest stages
    whose bottleneck meets the LLM's ``t_i``, and drops the depth when those overshoot the
    budget, so on 32 GPUs at DP 1 it misses (encoder 11, LLM 4), 18 % faster than its best.
    What is proven, and asserted: with ``fill_budget`` (such a depth's encoder takes the stages
    left) its candidates hold a split of the least bottleneck (the largest stage cost of any
    module) of all splits of the budget (`loosely_coupled_search`'s docstring). Ranking by the
    estimate is not ranking by bottleneck (bubbles, the spread of microbatch sizes,
    synchronisation), so that Algorithm 1's choice is the fastest split by the estimate too is
    asserted for this scenario only: it holds here. The ranking's lower bound is exact (the
    pruned ranking's best are the full ranking's), and the estimate prices the encoder's
    pipeline as the simulator plays it."""
    scenario = load_scenario(small_path, [*HEAVY_ENCODER, f"cluster.num_gpus={gpus}"])
    space = SearchSpace.from_table(scenario.search)
    assert space.tensor_parallel == (2,)
    pricer = _Pricer(scenario)
    layers = scenario.arch.layer_counts()
    for dp in (1, 2):
        template, price, ranked = _loosely_coupled(scenario, space, pricer, 2, 1, dp, keep=10**6)
        seconds, choice = ranked[0]
        assert choice.stage_counts["vision"] > 1  # the encoder's own pipeline
        budget = gpus // (2 * dp)
        splits = [(k, i) for k in range(1, layers["vision"] + 1) for i in range(1, layers[LLM] + 1) if k + i <= budget]

        # the least bottleneck, by Algorithm 1's candidates and by every split
        one = template({"vision": 1, LLM: 1})
        one.num_microbatches = _microbatches(scenario, one, space.microbatch_samples[0], pricer)
        costs = {m: pricer.layer_costs(one, m) for m in ("vision", LLM)}
        least = {m: [partition(costs[m], k)[1] for k in range(1, len(costs[m]) + 1)] for m in costs}
        ranks = {"vision": 2 * dp, LLM: 2 * dp}
        filled = loosely_coupled_search(costs[LLM], {"vision": costs["vision"]}, gpus, lambda c: 0.0,
                                        ranks_per_stage=ranks, fill_budget=True)
        brute = min(max(least["vision"][k - 1], least[LLM][i - 1]) for k, i in splits)
        assert min(max(c.stage_times.values()) for c in filled.candidates if c.within_budget) == pytest.approx(brute)

        # the estimate: no split beats Algorithm 1's choice on this scenario
        fastest, split = min((price({"vision": k, LLM: i}), (k, i)) for k, i in splits)
        assert seconds <= fastest * (1 + 1e-12), (dp, choice.stage_counts, split, seconds, fastest)
        paper = loosely_coupled_search(costs[LLM], {"vision": costs["vision"]}, gpus, price, ranks_per_stage=ranks)
        if (gpus, dp) == (32, 1):  # Algorithm 1 alone: the depth it drops held the best split
            assert paper.iteration_time > 1.15 * seconds, (paper.stage_counts, choice.stage_counts)
        else:
            assert paper.iteration_time == pytest.approx(seconds, rel=1e-12)

        # the ranking's bound prunes nothing it should not
        _, _, pruned = _loosely_coupled(scenario, space, pricer, 2, 1, dp, keep=2)
        assert [(t, c.stage_counts) for t, c in pruned[:2]] == [(t, c.stage_counts) for t, c in ranked[:2]]

        # the estimate of the encoder's pipeline against the simulator, on equal microbatches
        plan = pricer.plan(template(choice.stage_counts), one.num_microbatches, "1f1b", 1, 0, "none")
        mean = pricer.mean(plan.num_microbatches)
        est = estimate(plan, scenario.cost_model(plan), mean)
        sim = scenario.run(plan, [dict(mean) for _ in range(plan.num_microbatches)])
        assert est.iteration_time == pytest.approx(sim.iteration_time, rel=0.05)
        assert est.peak_memory == pytest.approx(_peak(sim), rel=0.05)


def test_cornstarch_layouts_are_priced_by_the_search_and_switched_off_by_the_search_table(small_path, heavy):
    space = SearchSpace.from_table(heavy.search)
    result = search(heavy, dataclasses.replace(space, simulate_top=1, simulate_budget=0))
    deep = [c for c in result.candidates if c.plan.spec("vision").num_stages > 1]
    assert deep and all(c.plan.placement == "disaggregated" for c in deep)
    assert {(c.plan.spec("vision").num_stages, c.plan.spec(LLM).pipeline_depth, c.plan.spec(LLM).data_parallel)
            for c in deep} >= {(6, 2, 1), (3, 1, 2)}  # Algorithm 1's choices at DP 1 and 2 (the test above)

    off = load_scenario(small_path, [*HEAVY_ENCODER, "search.cornstarch=0"])
    assert SearchSpace().cornstarch > 0 and SearchSpace.from_table(off.search).cornstarch == 0
    on = [strategy for strategy, _ in _strategy_layouts(heavy, space)]
    without = [strategy for strategy, _ in _strategy_layouts(off, SearchSpace.from_table(off.search))]
    assert "cornstarch" in on and "cornstarch" not in without and len(without) < len(on)
    assert {c.strategy for c in deep} >= {"cornstarch"}
    with pytest.raises(ScenarioError, match=re.escape("search.cornstarch")):
        load_scenario(small_path, ["search.cornstarch=-1"])


def test_fill_budget_holds_a_split_of_least_bottleneck_with_two_encoders():
    """`loosely_coupled_search(fill_budget=True)`, which the search runs, against every split of
    random layer costs into (encoder A, encoder B, LLM) stages within each budget, a B stage
    twice A's devices: some candidate has the least bottleneck of them all (Algorithm 1 alone
    misses it in 66 of these 160 cases, and has no candidate at all in 3)."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        costs = {m: list(rng.uniform(0.1, 3.0, size=n)) for m, n in (("a", 6), ("b", 5), (LLM, 8))}
        least = {m: [partition(c, k)[1] for k in range(1, len(c) + 1)] for m, c in costs.items()}
        ranks = {"a": 1, "b": 2, LLM: 1}
        for budget in range(4, 26, 3):
            result = loosely_coupled_search(costs[LLM], {"a": costs["a"], "b": costs["b"]}, budget, lambda c: 0.0,
                                            ranks_per_stage=ranks, fill_budget=True)
            best = min(max(c.stage_times.values()) for c in result.candidates if c.within_budget)
            brute = min(max(least["a"][a - 1], least["b"][b - 1], least[LLM][i - 1])
                        for a in range(1, 7) for b in range(1, 6) for i in range(1, 9) if a + 2 * b + i <= budget)
            assert best == pytest.approx(brute, rel=1e-9), (budget, best, brute)
