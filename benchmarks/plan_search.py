"""How fast and how well loom's planner decides (issue 12).

    python -m benchmarks.plan_search [--repeats 9] [--search-repeats 3] [--skip-regret]

Figures (median over repeats, spread min-max):

- ``orchestration_ms_1296``: DistTrain's disaggregated model orchestration (Algorithm 1,
  disttrain.md §3.2, `loom.planner.orchestration`) for MLLM-72B on 1296 GPUs, global batch
  1920, every module's TP in {1, 2, 4, 8}, on the inputs `scenario_orchestration` passes; the
  cost models behind them are built in a warm-up call, as the paper's Table 2 times the
  orchestration itself (target 100 ms); ``orchestration_ms_1296_tp1``: encoder and generator
  at TP 1, as the paper's experiments run them (§4.1);
- ``search_s_1024``: the whole search `loom plan --search` runs (`loom.planner.search.search`,
  default space: three placements, TP, PP, DP, microbatches, three schedules, ZeRO and
  recompute; the fastest estimates simulated) for Llama-3-70B + ViT-H/14 on 1024 H100
  (target 60 s);
- ``search_regret``: on a space small enough to simulate every plan (Llama-3-8B + ViT-H/14 on
  16 H100, `all_plans`), the search's best simulated iteration time over the best of every
  memory-fitting plan, minus 1 (target at most 0.02);
- ``llama70b_megatron_mfu``: text-only Llama-3-70B, sequences of 4096, 1024 H100, the
  Megatron-LM layout the search picks (``configs/sim/llama3-70b-text-1024xh100.toml``: the
  LLM's pipeline on every rank, Megatron-LM's schedules); its simulated MFU (target between
  0.35 and 0.50, what public Megatron-LM runs report).

Every figure goes through what ``loom plan --search`` runs: the scenario files, the search,
the simulator's ``run_balanced`` with the dispatcher's cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median, run_parts, start_run, write_result
from loom.planner.orchestration import scenario_inputs
from loom.planner.search import SearchSpace, all_plans, search
from loom.sim.scenario import load_scenario

SIM = Path(__file__).resolve().parent.parent / "configs" / "sim"
ORCHESTRATION = SIM / "disttrain-mllm72b-sd21-1296xh100.toml"
SEARCH = SIM / "llama3-70b-vith-1024xh100.toml"
TEXT = SIM / "llama3-70b-text-1024xh100.toml"
# the regret's small space: every plan of it is simulated
REGRET_OVERRIDES = ['model.llm="llama3-8b"', "cluster.num_gpus=16", "data.global_batch_size=64"]
REGRET_SPACE = SearchSpace(tensor_parallel=(1, 2, 4), microbatch_samples=(1, 2, 4, 8))
GiB = 2**30


def figure(values: list[float], unit: str, better: str, target, digits: int = 3) -> dict:
    return {"value": round(median(values), digits), "unit": unit, "better": better,
            "spread": [round(min(values), digits), round(max(values), digits)], "spread_is": "min-max",
            "target": target}


def once(value: float, unit: str, better: str, target, digits: int) -> dict:
    """A figure of one deterministic run (the search and the simulator draw nothing at random)."""
    v = round(value, digits)
    return {"value": v, "unit": unit, "better": better, "spread": [v, v], "spread_is": "deterministic (one run)",
            "target": target}


def orchestration(repeats: int) -> tuple[dict, dict]:
    inputs = scenario_inputs(load_scenario(ORCHESTRATION))
    cases = {"orchestration_ms_1296": None, "orchestration_ms_1296_tp1": {"vision": (1,), "image": (1,)}}
    figures, chosen = {}, {}
    for name, tps in cases.items():
        inputs.orchestrate(tps)  # fills the memory check's and the communication's memos (cost models)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            best = inputs.orchestrate(tps)[0]
            times.append((time.perf_counter() - t0) * 1e3)
        figures[name] = figure(times, "ms", "lower", 100.0)
        chosen[name] = {"tp": best.tp, "dp": best.dp, "pp": best.pp, "gpus": best.gpus,
                        "formulation_s": round(best.iteration_time, 4), "candidates": best.candidates}
    return figures, chosen


def whole_search(repeats: int) -> tuple[dict, dict]:
    scenario = load_scenario(SEARCH)
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = search(scenario, SearchSpace.from_table(scenario.search))
        times.append(time.perf_counter() - t0)
    best = result.best
    return ({"search_s_1024": figure(times, "s", "lower", 60.0, 2)},
            {"winner": best.layout, "iteration_s": round(best.iteration_time, 4), "mfu": round(best.simulated.mfu, 4),
             "priced": result.priced, "pruned_memory": result.pruned_memory, "techniques": result.techniques})


def regret() -> tuple[dict, dict]:
    scenario = load_scenario(SEARCH, REGRET_OVERRIDES)
    capacity = scenario.memory_capacity()
    t0 = time.perf_counter()
    found = search(scenario, REGRET_SPACE)
    search_s = time.perf_counter() - t0
    best_t, count, fitting = float("inf"), 0, 0
    for plan in all_plans(scenario, REGRET_SPACE):
        count += 1
        result = scenario.run_balanced(plan, "none").result
        if max(result.peak_memory.values()) > capacity:
            continue
        fitting += 1
        if result.iteration_time < best_t:
            best_t = result.iteration_time
    value = found.best.iteration_time / best_t - 1
    return ({"search_regret": once(value, "fraction", "lower", 0.02, 5)},
            {"plans_simulated": count, "plans_fitting": fitting, "exhaustive_best_s": round(best_t, 5),
             "search_best_s": round(found.best.iteration_time, 5), "search_s": round(search_s, 2),
             "search_winner": found.best.layout})


def megatron_mfu() -> tuple[dict, dict]:
    scenario = load_scenario(TEXT)
    result = search(scenario, SearchSpace.from_table(scenario.search))
    mfu = result.best.simulated.mfu
    return ({"llama70b_megatron_mfu": once(mfu, "fraction", "higher", [0.35, 0.50], 4)},
            {"winner": result.best.layout, "iteration_s": round(result.best.iteration_time, 4),
             "peak_memory_gib": round(max(result.best.simulated.peak_memory.values()) / GiB, 1)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9, help="repeats of the orchestration timing")
    ap.add_argument("--search-repeats", type=int, default=3, help="repeats of the whole search's timing")
    ap.add_argument("--skip-regret", action="store_true", help="skip simulating every plan of the small space")
    args = ap.parse_args()
    start_run()
    parts = [("orchestration", lambda: orchestration(args.repeats)), ("search", lambda: whole_search(args.search_repeats)),
             ("megatron_mfu", megatron_mfu)]
    if not args.skip_regret:
        parts.append(("regret", regret))
    figures, details = run_parts(parts)
    write_result("plan_search", figures, {"scenarios": {"orchestration": ORCHESTRATION.name, "search": SEARCH.name,
                                                        "text": TEXT.name, "regret": [SEARCH.name, *REGRET_OVERRIDES]},
                                          "repeats": args.repeats, "search_repeats": args.search_repeats, **details})


if __name__ == "__main__":
    main()
