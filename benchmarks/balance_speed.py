"""How fast loom's balancing algorithms decide, at the sizes the issue names.

    python -m benchmarks.balance_speed [--repeats 30]

Figures (medians over repeats, fresh seeded inputs, one process on this machine):
- ``post_balance_ms``: OrchMLLM LPT post-balancing of 2560 ranks x 60 samples (target 5 ms);
- ``disttrain_reorder_ms``: DistTrain reordering of 64 microbatches at pipeline depth 8 (10 ms);
- ``entrain_assign_ms``: Entrain assignment + deferral, 32 microbatches of 16 samples (20 ms);
- ``nodewise_ms`` and ``nodewise_gap``: OrchMLLM node-wise rearrangement, 128 ranks on 16 nodes,
  with the optimality gap it reached (100 ms): (value - best certified lower bound) / value, the
  bound being HiGHS's dual bound or the per-node Lagrangian (LP-strength) bound.
Samples' workloads are token counts drawn log-normally, as real MLLM data is skewed. Figures are
wall-clock, so they depend on what else runs on the machine: the 1-min load average at start and
end goes into the result's config. Writes ``benchmarks/results/balance_speed.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import figure, format_table, median, write_result
from loom.balance.disttrain import reorder_microbatches
from loom.balance.entrain import entrain_plan
from loom.balance.orchmllm import lpt_balance, nodewise_rearrangement

TARGETS_MS = {"post_balance_ms": 5.0, "disttrain_reorder_ms": 10.0, "entrain_assign_ms": 20.0, "nodewise_ms": 100.0}


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {k: [] for k in TARGETS_MS}
    gaps = []
    load_start = os.getloadavg()[0]  # wall-clock medians on a shared 2-core machine: record load
    for r in range(args.repeats):
        rng = np.random.default_rng(r)
        tokens = np.maximum(1, rng.lognormal(6.0, 1.0, 2560 * 60)).astype(np.int64)
        runs["post_balance_ms"].append(timed(lambda: lpt_balance(tokens, 2560))[0])

        enc = rng.lognormal(0.0, 0.8, 64)
        runs["disttrain_reorder_ms"].append(timed(lambda: reorder_microbatches(enc, 1.0, 8))[0])

        enc_w = rng.lognormal(5.0, 1.0, 32 * 16)
        llm_w = rng.lognormal(6.0, 0.7, 32 * 16)
        runs["entrain_assign_ms"].append(timed(lambda: entrain_plan(enc_w, llm_w, 32))[0])

        if r < max(3, args.repeats // 5):  # the MILP runs to its time limit: fewer repeats
            n = 128 * 8
            sizes = np.maximum(1, rng.lognormal(6.0, 1.0, n)).astype(np.int64)
            balanced = lpt_balance(sizes, 128)
            source = rng.integers(0, 128, n)
            ms, plan = timed(lambda: nodewise_rearrangement(balanced, source, sizes, ranks_per_node=8))
            runs["nodewise_ms"].append(ms)
            gaps.append(plan.gap)
    figures = {k: figure(median(v), "ms") for k, v in runs.items()}
    figures["nodewise_gap"] = figure(median(gaps), "fraction")
    rows = [(k, f"{median(v):.2f}", f"{min(v):.2f}", f"{TARGETS_MS[k]:.0f}",
             "yes" if median(v) <= TARGETS_MS[k] else "NO") for k, v in runs.items()]
    print(format_table(("figure", "median ms", "best ms", "target ms", "met"), rows))
    print(f"nodewise_gap (median optimality gap reached) = {median(gaps):.3f}")
    load = (round(load_start, 2), round(os.getloadavg()[0], 2))
    print(f"1-min load average at start / end: {load[0]} / {load[1]} ({os.cpu_count()} CPUs)")
    write_result("balance_speed", figures, {"repeats": args.repeats, "distribution": "lognormal tokens",
                                            "load_avg_1m_start_end": list(load)})


if __name__ == "__main__":
    main()
