"""The papers' published setups against loom's searched plans (issue 12, item 4).

    python -m benchmarks.paper_setups [--only NAME[,NAME...]] [--no-docs]

For every scenario in ``configs/sim/`` with a ``[plans.baseline]`` (the layout its paper
compares against, from the paper's own text: see each file's header), the baseline and the
plan ``loom plan --search`` finds (`loom.planner.search.search` over the scenario's
``[search]`` table, default space otherwise) are simulated under the same cost model
(`Scenario.run_balanced` with the dispatcher's cost). Figures, one per setup:

- ``searched_over_baseline_<setup>``: the baseline's simulated iteration time over the searched
  plan's (above 1: the search's plan is faster), with both MFUs, the winner's layout and the
  techniques it uses in the result's details.

Writes ``docs/reproduction.md`` from the result (``--no-docs``: not). A search is
deterministic, so a setup is searched once; its time is reported, not repeated.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_table, git_state, start_run, write_result
from loom.planner.search import SearchSpace, search
from loom.sim.scenario import load_scenario, read_scenario_tables

ROOT = Path(__file__).resolve().parent.parent
SIM = ROOT / "configs" / "sim"
DOC = ROOT / "docs" / "reproduction.md"
GiB = 2**30


def setups() -> list[Path]:
    return sorted(p for p in SIM.glob("*.toml") if "baseline" in read_scenario_tables(p).get("plans", {}))


def measure(path: Path) -> tuple[dict, dict]:
    scenario = load_scenario(path)
    base = scenario.run_balanced(scenario.plans["baseline"], "none").result
    t0 = time.perf_counter()
    found = search(scenario, SearchSpace.from_table(scenario.search))
    seconds = time.perf_counter() - t0
    best = found.best.simulated
    # MFU over the cluster's GPUs: a disaggregated plan may leave some idle (`SimResult.mfu` is
    # over the plan's own ranks)
    on_cluster = lambda result, plan: (result.mfu or 0.0) * plan.world_size / scenario.cluster.num_gpus
    ratio = base.iteration_time / best.iteration_time
    name = path.stem
    figure = {"value": round(ratio, 4), "unit": "ratio", "better": "higher", "target": "reported", "spread": [round(ratio, 4)] * 2, "spread_is": "deterministic (one run)"}
    detail = {
        "scenario": path.name, "gpus": scenario.cluster.num_gpus, "gpu": scenario.cluster.spec.name,
        "baseline_s": round(base.iteration_time, 4),
        "baseline_mfu": round(on_cluster(base, scenario.plans["baseline"]), 4),
        "baseline_peak_gib": round(max(base.peak_memory.values()) / GiB, 1),
        "searched_s": round(best.iteration_time, 4), "searched_mfu": round(on_cluster(best, found.best.plan), 4),
        "searched_gpus_used": found.best.plan.world_size,
        "searched_peak_gib": round(max(best.peak_memory.values()) / GiB, 1),
        "searched_layout": found.best.layout, "techniques": found.techniques,
        "search_s": round(seconds, 1), "priced": found.priced,
    }
    return {f"searched_over_baseline_{name}": figure}, detail


def write_doc(details: dict[str, dict], state: dict) -> None:
    lines = [
        "# The papers' setups, reproduced in loom's simulator",
        "",
        "Written by `python -m benchmarks.paper_setups` (do not edit by hand) from commit "
        f"`{(state.get('commit') or 'unknown')[:7]}`{' (with uncommitted changes)' if state.get('dirty') else ''}.",
        "Each row is a scenario of `configs/sim/` with the baseline layout its paper compares against",
        "(`[plans.baseline]`; each file's header says where the setup and the baseline come from and",
        "what the paper leaves unstated) and the plan `loom plan --search` finds for it, both simulated",
        "under the same cost model: the analytic model with GEMMs priced by shape",
        "([cost-model.md](cost-model.md)), the dispatcher's cost included. *Simulated* figures, not",
        "measurements: they say what loom's model predicts, and where the searched plan differs from",
        "the paper's own system (which this table does not run), the comparison is with the baseline only.",
        "",
        "MFU is over the cluster's GPUs; a searched disaggregated plan may leave some idle (its GPUs",
        "used are in the \"GPUs used\" column).",
        "",
        "| setup | GPUs | baseline s | baseline MFU | searched s | searched MFU | GPUs used | baseline / searched | searched plan | techniques | search s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in details.items():
        lines.append(f"| `{name}` | {d['gpus']} x {d['gpu']} | {d['baseline_s']:.3f} | {d['baseline_mfu']:.1%} | "
                     f"{d['searched_s']:.3f} | {d['searched_mfu']:.1%} | {d['searched_gpus_used']} | "
                     f"{d['baseline_s'] / d['searched_s']:.2f} | "
                     f"{d['searched_layout']} | {'; '.join(d['techniques'])} | {d['search_s']} |")
    lines += ["", "Peak memory per GPU (GiB, simulated): " + "; ".join(
        f"`{n}` baseline {d['baseline_peak_gib']}, searched {d['searched_peak_gib']}" for n, d in details.items()) + ".",
        ""]
    DOC.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated setup names (file stems)")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/reproduction.md")
    args = ap.parse_args()
    start_run()
    wanted = set(filter(None, args.only.split(",")))
    figures, details, rows = {}, {}, []
    for path in setups():
        if wanted and path.stem not in wanted:
            continue
        f, d = measure(path)
        figures.update(f)
        details[path.stem] = d
        rows.append((path.stem, f"{d['baseline_s']:.3f}", f"{d['searched_s']:.3f}", f"{d['baseline_s'] / d['searched_s']:.2f}",
                     f"{d['baseline_mfu']:.1%}", f"{d['searched_mfu']:.1%}", f"{d['search_s']}"))
        print(f"{path.stem}: {d['searched_layout']} ({', '.join(d['techniques'])})", flush=True)
    print(format_table(("setup", "baseline s", "searched s", "ratio", "base MFU", "searched MFU", "search s"), rows))
    write_result("paper_setups", figures, {"setups": details})
    if not args.no_docs and not wanted:
        write_doc(details, git_state())


if __name__ == "__main__":
    main()
