"""The planner's search (`loom.planner.search`), its analytic estimate (`loom.planner.estimate`)
and ``loom plan --search``, on a small scenario (Llama-3-8B with a ViT-H/14 on 16 H100s, a
global batch of 64) that searches in a second or two:

- what the search returns fits the GPU's memory in simulation and has a valid schedule;
- its regret against brute force: every plan it priced, simulated, against its winner;
- the estimate against the simulator on equal microbatches, `expected_max` and
  `TokenWindows.heaviest` against their definitions;
- its refusals (nothing fits; a bad ``[search]`` table), the plan file the CLI writes and
  ``loom simulate --plan`` takes, and a custom data mix (``[data.kinds.<name>]``).
"""

from __future__ import annotations

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
from loom.planner.search import SearchSpace, _layouts, _microbatches, _Pricer, search
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


@pytest.fixture(scope="module")
def scenario(small_path):
    return load_scenario(small_path)


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
def test_every_plan_the_search_returns_fits_memory_and_has_a_valid_schedule(scenario):
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
