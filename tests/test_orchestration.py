"""DistTrain's disaggregated model orchestration (issue 12; disttrain.md §3.1-3.2, Algorithm 1):
the closed form with its rounding against exhaustive enumeration of the same objective, the
memory check honoured, and the scenario path that lets the simulator decide among the best."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from loom.planner.orchestration import iteration_time, orchestrate, scenario_orchestration
from loom.schedule.generators import build_schedule
from loom.schedule.validate import validate_schedule
from loom.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def exhaustive(costs, batch_size: int, num_gpus: int, layers: int) -> float:
    """The objective's minimum over every integer layout: LLM TP x DP x PP, every other module
    TP x DP, at most ``num_gpus`` GPUs in all."""
    best = math.inf
    others = [m for m in costs if m != "llm"]
    for dp_lm in _divisors(batch_size):
        for tp_lm in costs["llm"]:
            for pp in range(1, layers + 1):
                y = dp_lm * tp_lm * pp
                if y > num_gpus:
                    break
                rest = num_gpus - y
                for tps in itertools.product(*[list(costs[m]) for m in others]):
                    for dps in itertools.product(*[range(1, rest // t + 1) for t in tps]):
                        if sum(d * t for d, t in zip(dps, tps)) <= rest:
                            best = min(best, iteration_time(costs, batch_size, {"llm": tp_lm, **dict(zip(others, tps))},
                                                            {"llm": dp_lm, **dict(zip(others, dps))}, pp))
    return best


def random_costs(rng: random.Random) -> dict[str, dict[int, float]]:
    costs = {"vision": {1: rng.uniform(0.05, 0.5)}, "llm": {1: rng.uniform(1.0, 4.0)}, "image": {1: rng.uniform(0.05, 0.5)}}
    for c in costs.values():
        c[2] = c[1] * rng.uniform(0.5, 0.8)  # TP 2 is faster, less than twice
    return costs


def test_the_closed_form_with_its_rounding_is_within_a_percent_of_exhaustive_search():
    rng = random.Random(0)
    for _ in range(30):
        costs = random_costs(rng)
        batch, gpus = rng.choice([8, 12, 16]), rng.choice([12, 16, 24])
        got = orchestrate(costs, batch, gpus, 8)
        assert got[0].iteration_time <= exhaustive(costs, batch, gpus, 8) * 1.01
        layout = got[0]
        assert sum(layout.gpus.values()) <= gpus
        assert layout.gpus["llm"] == layout.tp["llm"] * layout.dp["llm"] * layout.pp["llm"]
        assert batch % layout.dp["llm"] == 0


def test_the_memory_check_and_alignment_are_honoured():
    costs = {"vision": {1: 0.2, 2: 0.12}, "llm": {1: 2.0, 2: 1.1, 4: 0.6}, "image": {1: 0.3, 2: 0.2}}
    free = orchestrate(costs, 16, 32, 16, keep=5)
    assert [o.iteration_time for o in free] == sorted(o.iteration_time for o in free)
    # a memory check that lets the LLM run only at TP 1: the fastest layout otherwise is TP 4
    assert free[0].tp["llm"] == 4
    tp1 = orchestrate(costs, 16, 32, 16, fits=lambda m, tp, dp, pp: m != "llm" or tp == 1)
    assert tp1[0].tp["llm"] == 1
    # the LLM at TP > 1 behind the encoder: the encoder takes whole nodes of 8, which it did not unaligned
    assert free[0].gpus["vision"] % 8 != 0
    aligned = orchestrate(costs, 16, 32, 16, encoders=["vision"], align=8)[0]
    assert aligned.tp["llm"] > 1 and aligned.gpus["vision"] % 8 == 0
    with pytest.raises(ValueError, match="no layout .* fits 32 GPUs"):
        orchestrate(costs, 16, 32, 16, fits=lambda m, tp, dp, pp: False)
    with pytest.raises(ValueError, match="costs has no 'llm'"):
        orchestrate({"vision": {1: 1.0}}, 16, 32, 16)


def test_on_a_scenario_the_simulator_decides_among_the_best_layouts():
    """DistTrain's MLLM-9B scenario: the formulation's best layouts (encoder and generator at TP
    1, as the paper's experiments run them) are played by the simulator; the one returned is
    the fastest played, and its plan is a valid, schedulable disaggregated plan."""
    scenario = load_scenario(ROOT / "configs/sim/disttrain-mllm9b-sd21-96xh100.toml")
    best, plan, played = scenario_orchestration(scenario, {"vision": (1,), "image": (1,)}, simulate_top=3)
    assert len(played) == 3 and min(t for _, t in played) == scenario.run(plan).iteration_time
    assert plan.world_size <= scenario.cluster.num_gpus
    assert [m.name for m in plan.modules] == ["vision", "llm", "image"]
    assert (plan.spec("vision").tensor_parallel, plan.spec("image").tensor_parallel) == (1, 1)
    validate_schedule(build_schedule(plan), plan)
    assert best.gpus == {m.name: m.data_parallel * m.num_stages * m.tensor_parallel for m in plan.modules}
