"""How fast loom's planner decides (issue 12). So far: DistTrain's disaggregated model
orchestration (Algorithm 1, disttrain.md §3.2, `loom.planner.orchestration.orchestrate`) at the
paper's largest scale, MLLM-72B on 1296 GPUs with a global batch of 1920.

    python -m benchmarks.plan_search [--repeats 9]

Figures (median over repeats, spread min-max), on the inputs `scenario_orchestration` passes
(`scenario_inputs`: the per-module costs ``C_m(TP)``, the memory check, the LLM's communication,
node alignment). The cost models behind them are built once, in a warm-up call, and are not part
of the time, as the paper's Table 2 times the orchestration itself:

- ``orchestration_ms_1296``: every module's TP in {1, 2, 4, 8} (target 100 ms);
- ``orchestration_ms_1296_tp1``: encoder and generator at TP 1, as the paper's experiments run
  them (§4.1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_table, median, start_run, write_result
from loom.planner.orchestration import scenario_inputs
from loom.sim.scenario import load_scenario

SCENARIO = Path(__file__).resolve().parent.parent / "configs" / "sim" / "disttrain-mllm72b-sd21-1296xh100.toml"
TARGET_MS = 100.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    start_run()
    scenario = load_scenario(SCENARIO)
    inputs = scenario_inputs(scenario)  # as `loom.planner.orchestration.scenario_orchestration` passes them
    costs = inputs.costs
    cases = {"orchestration_ms_1296": None, "orchestration_ms_1296_tp1": {"vision": (1,), "image": (1,)}}
    figures, rows, chosen = {}, [], {}
    for name, tps in cases.items():
        inputs.orchestrate(tps)  # fills the memory check's and the communication's memos (cost models)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            best = inputs.orchestrate(tps)[0]
            times.append((time.perf_counter() - t0) * 1e3)
        figures[name] = {"value": round(median(times), 3), "unit": "ms", "better": "lower",
                         "spread": [round(min(times), 3), round(max(times), 3)], "spread_is": "min-max",
                         "target": TARGET_MS}
        chosen[name] = {"tp": best.tp, "dp": best.dp, "pp": best.pp, "gpus": best.gpus,
                        "formulation_s": round(best.iteration_time, 4), "candidates": best.candidates}
        rows.append((name, f"{median(times):.1f}", f"{min(times):.1f}", f"{TARGET_MS:.0f}",
                     "yes" if median(times) <= TARGET_MS else "NO", str(best.candidates)))
    print(format_table(("figure", "median ms", "best ms", "target ms", "met", "candidates"), rows))
    for name, c in chosen.items():
        print(f"{name}: {c}")
    write_result("plan_search", figures, {"scenario": SCENARIO.name, "repeats": args.repeats,
                                          "costs_s_per_sequence": {m: {str(t): round(v, 5) for t, v in c.items()}
                                                                   for m, c in costs.items()},
                                          "chosen": chosen})


if __name__ == "__main__":
    main()
