"""Token-budget microbatches (``data.microbatch_tokens``, issue 12): contiguous microbatches of
at most the budget's LLM tokens (a longer sample alone), at least the plan's count, a multiple
of the data-parallel round; the config, the layout and the simulator agree. The runtime's
reference semantics under a budget: ``tests/test_balance_runtime.py`` (pipe2dp2tokens)."""

import numpy as np
import pytest

from loom.balance.config import BalanceError
from loom.balance.policy import BalanceConfig, SampleCosts, make_layout
from loom.plan.overrides import ConfigError
from loom.plan.plan import ModuleSpec, Plan
from loom.schedule.layout import token_budget_sizes
from loom.sim.scenario import load_scenario
from loom.train.config import load_config

SCENARIO = "configs/sim/llama3-70b-vith-1024xh100.toml"


def test_microbatches_stay_within_the_budget_but_for_a_longer_sample():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        lengths = rng.integers(1, 3000, size=n)
        budget = int(rng.integers(50, 4000))
        multiple = int(rng.choice([1, 2, 4]))
        least = int(rng.integers(1, 8))
        need = max(least, sum(1 for _ in _greedy(lengths, budget)))
        if -(-need // multiple) * multiple > n:
            with pytest.raises(ValueError, match="data.microbatch_tokens"):
                token_budget_sizes(lengths, budget, least, multiple)
            continue
        sizes = token_budget_sizes(lengths, budget, least, multiple)
        assert sizes.sum() == n and (sizes >= 1).all()  # every sample once, in order, none empty
        assert len(sizes) >= least and len(sizes) % multiple == 0
        bounds = np.concatenate(([0], np.cumsum(sizes)))
        for k in range(len(sizes)):
            part = lengths[bounds[k]:bounds[k + 1]]
            assert part.sum() <= budget or len(part) == 1, (trial, k, part, budget)
        # as few microbatches as the greedy packing needs, rounded to the multiple
        assert len(sizes) == -(-need // multiple) * multiple


def _greedy(lengths, budget):
    total, parts = 0, []
    for x in lengths:
        if total and total + x > budget:
            yield parts
            parts, total = [], 0
        parts.append(x)
        total += x
    yield parts


def test_make_layout_cuts_by_the_budget_under_none_only():
    lengths = [97, 186, 10, 70, 8, 170, 165, 49]
    costs = SampleCosts(work={"llm": [float(x) for x in lengths]}, llm_lengths=lengths, llm_alpha=1.0, llm_beta=0.0)
    plan = Plan([ModuleSpec("llm", data_parallel=2)], num_microbatches=4).resolve({"llm": 4})
    layout = make_layout(BalanceConfig(), plan, costs, "padded", 180)
    assert layout.num_microbatches == 6
    assert [list(s) for s in layout.slots["llm"]] == [[0], [1], [2, 3, 4], [5], [6], [7]]
    assert make_layout(BalanceConfig(), plan, costs, "padded", 0).num_microbatches == 4
    with pytest.raises(BalanceError, match="data.microbatch_tokens"):
        make_layout(BalanceConfig(default="orchmllm"), plan, costs, "padded", 180)


def test_the_config_checks_the_budget():
    assert load_config(None, ["data.microbatch_tokens=4096"]).data.microbatch_tokens == 4096
    with pytest.raises(ConfigError, match="data.microbatch_tokens = -1"):
        load_config(None, ["data.microbatch_tokens=-1"])
    with pytest.raises(ConfigError, match="data.microbatch_tokens = 64.*'none' policy"):
        load_config(None, ["data.microbatch_tokens=64", 'balance.default="orchmllm"'])


def test_the_simulator_cuts_the_batch_as_the_runtime_does():
    scenario = load_scenario(SCENARIO, ["data.microbatch_tokens=4096", "data.global_batch_size=256",
                                        "cluster.num_gpus=64", "parallel.data_parallel=2"])
    metas = scenario.metas()
    sizes = scenario.token_budget_sizes(metas, 4, 2)
    work = scenario.batch_work(metas, 4, 2)
    assert len(work) == len(sizes) >= 4 and len(sizes) % 2 == 0
    assert all(w["llm"].tokens <= 4096 or s == 1 for w, s in zip(work, sizes))
    assert sum(w["llm"].tokens for w in work) == sum(w["llm"].tokens for w in scenario.microbatch_work(metas, 4))
    with pytest.raises(ValueError, match="data.microbatch_tokens = -5"):
        load_scenario(SCENARIO, ["data.microbatch_tokens=-5"])
