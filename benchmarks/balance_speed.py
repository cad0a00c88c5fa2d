"""How fast loom's balancing algorithms decide, at the sizes the issue names.

    python -m benchmarks.balance_speed [--repeats 30] [--only decide_ms_disttrain,entrain_assign_ms]

Figures (medians over repeats, fresh seeded inputs, one process on this machine):
- ``post_balance_ms``: OrchMLLM LPT post-balancing of 2560 ranks x 60 samples (target 5 ms);
- ``disttrain_reorder_ms``: DistTrain reordering of 64 microbatches at pipeline depth 8 (10 ms);
- ``entrain_assign_ms``: Entrain assignment + deferral, 32 microbatches of 16 samples, on the path
  the ``entrain`` policy runs (`loom.balance.entrain_policy`, here one replica) (20 ms);
- ``nodewise_ms`` and ``nodewise_gap``: OrchMLLM node-wise rearrangement, 128 ranks on 16 nodes,
  with the optimality gap it reached (100 ms): (value - best certified lower bound) / value, the
  bound being HiGHS's dual bound or the per-node Lagrangian (LP-strength) bound.
- ``decide_ms_orchmllm`` / ``decide_ms_disttrain`` / ``decide_ms_entrain``: the decision a rank
  pays per step through the public API, from the gathered metadata table (one padded
  `MetadataArrays.to_flat` row per rank of the plan, as `loom.runtime.metadata` gathers it) to
  the checked layout: the runtime's parse (`MetadataArrays.from_gathered`), costs
  (`sample_costs`) and `make_layout`, on skewed LLaVA-like metadata (the ``caption`` mix,
  high-resolution tail) for Llama-3-8B + ViT-H/14. orchmllm: DP 2560, 60 samples per rank, vision and LLM phases (target
  20 ms); disttrain: 64 groups x 64 microbatches of 4, pipeline depth 8 (20 ms); entrain: 64
  replicas x 32 microbatches of 16 (30 ms). Every rank of the plan, encoder and LLM alike, loads
  a contiguous share of the batch, so the table has one row per rank (orchmllm: 5120 rows of 30
  samples).
Per-algorithm samples' workloads are token counts drawn log-normally, as real MLLM data is
skewed. Figures are
wall-clock, so they depend on what else runs on the machine: the 1-min load average at start and
end goes into the result's config. Writes ``benchmarks/results/balance_speed.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_table, median, summarize, write_result
from loom.balance.costs import sample_costs
from loom.balance.disttrain import reorder_microbatches
from loom.balance.entrain_policy import effective_count, pairwise_deferral, stratified
from loom.balance.lpt import lpt_balance, quantised_lpt
from loom.balance.nodewise import nodewise_rearrangement
from loom.balance.policy import BalanceConfig, make_layout
from loom.cost.model_configs import load_model_arch
from loom.cost.workload import MetadataArrays, gather_capacity, padded_row
from loom.data.synthetic import SyntheticMetadata
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.runtime.dispatch import loader_shards

TARGETS_MS = {"post_balance_ms": 5.0, "disttrain_reorder_ms": 10.0, "entrain_assign_ms": 20.0, "nodewise_ms": 100.0}
DECIDE_TARGETS_MS = {"orchmllm": 20.0, "disttrain": 20.0, "entrain": 30.0}
# (replicas, microbatches per replica, samples per microbatch, LLM stages)
DECIDE_SHAPES = {"orchmllm": (2560, 1, 60, 1), "disttrain": (64, 64, 4, 7), "entrain": (64, 32, 16, 4)}


def decide_inputs(policy: str, arch, pool: list) -> tuple[Plan, np.ndarray]:
    """The plan and the gathered metadata table exactly as the dispatcher's all-gather returns it:
    each rank's loader shard encoded and padded by the runtime's own functions
    (`MetadataArrays.to_flat`, `padded_row` at `gather_capacity`; a second round's width when a
    row outgrows it), one row per rank. The collective itself is not part of the figure."""
    dp, per, size, stages = DECIDE_SHAPES[policy]
    n = dp * per * size
    plan = Plan([ModuleSpec("vision", data_parallel=dp), ModuleSpec(LLM, data_parallel=dp, num_stages=stages)],
                num_microbatches=dp * per)
    plan = plan.resolve({name: arch.module(name).num_layers for name in arch.module_names})
    metas = [pool[i % len(pool)] for i in range(n)]
    rows = [MetadataArrays.from_metas([metas[p] for p in shard]).to_flat()
            for shard in loader_shards(n, plan.world_size)]
    # the first round's capacity, or the second round's width when a row outgrows it
    width = max(gather_capacity(n, plan.world_size), max(r.size for r in rows))
    return plan, np.stack([padded_row(r, width) for r in rows])


def decide(policy: str, plan: Plan, arch, table: np.ndarray):
    """What a rank runs per step from the gathered table to its layout (`Dispatcher.dispatch`):
    the runtime's parse, costs, `make_layout`."""
    gathered = MetadataArrays.from_gathered(table)
    return make_layout(BalanceConfig(default=policy, min_gain=0.0), plan, sample_costs(arch, gathered))


def entrain_one_replica(enc: np.ndarray, llm: np.ndarray, k: int):
    """K_eff, stratified microbatches and pairwise deferral of one replica, as the policy runs
    them (its lockstep functions with one row)."""
    e, w = enc[None, :], llm[None, :]
    k = effective_count(e, k)
    return pairwise_deferral(stratified(e, w, k), w, k)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--decide-repeats", type=int, default=9)
    ap.add_argument("--only", default="", help="comma-separated figure names to measure (prints them and "
                    "writes no result file, so a partial run never replaces the full one)")
    args = ap.parse_args()
    only = {name for name in args.only.split(",") if name}
    unknown = only - {f"decide_ms_{p}" for p in DECIDE_TARGETS_MS} - set(TARGETS_MS) - {"nodewise_gap"}
    if unknown:
        ap.error(f"--only names unknown figures {sorted(unknown)}; choose from "
                 f"{sorted([f'decide_ms_{p}' for p in DECIDE_TARGETS_MS] + list(TARGETS_MS))}")

    def wanted(name: str) -> bool:
        return not only or name in only or (name == "nodewise_ms" and "nodewise_gap" in only)
    arch = load_model_arch("llama3-8b", {"vision": "vit-h-14"})
    data = SyntheticMetadata("caption", seed=0)
    pool = [data.meta(i) for i in range(4096)]  # drawn once; batches cycle through them
    decide_ms: dict[str, list[float]] = {}
    for policy in [p for p in DECIDE_TARGETS_MS if wanted(f"decide_ms_{p}")]:
        plan, table = decide_inputs(policy, arch, pool)
        decide(policy, plan, arch, table)  # warm caches
        decide_ms[policy] = [timed(lambda: decide(policy, plan, arch, table))[0] for _ in range(args.decide_repeats)]
    runs: dict[str, list[float]] = {k: [] for k in TARGETS_MS if wanted(k)}
    gaps = []
    load_start = os.getloadavg()[0]  # wall-clock medians on a shared 2-core machine: record load
    for r in range(args.repeats):
        rng = np.random.default_rng(r)
        # the float FLOP costs the orchmllm policy passes, through the quantised integer core
        costs = rng.lognormal(6.0, 1.0, 2560 * 60) * 1e9
        if wanted("post_balance_ms"):
            runs["post_balance_ms"].append(timed(lambda: quantised_lpt(costs, 2560))[0])

        enc = rng.lognormal(0.0, 0.8, 64)
        if wanted("disttrain_reorder_ms"):
            runs["disttrain_reorder_ms"].append(timed(lambda: reorder_microbatches(enc, 1.0, 8))[0])

        enc_w = rng.lognormal(5.0, 1.0, 32 * 16)
        llm_w = rng.lognormal(6.0, 0.7, 32 * 16)
        if wanted("entrain_assign_ms"):
            runs["entrain_assign_ms"].append(timed(lambda: entrain_one_replica(enc_w, llm_w, 32))[0])

        if wanted("nodewise_ms") and r < max(3, args.repeats // 5):  # the MILP runs to its time limit: fewer repeats
            n = 128 * 8
            sizes = np.maximum(1, rng.lognormal(6.0, 1.0, n)).astype(np.int64)
            balanced = lpt_balance(sizes, 128)
            source = rng.integers(0, 128, n)
            ms, plan = timed(lambda: nodewise_rearrangement(balanced, source, sizes, ranks_per_node=8))
            runs["nodewise_ms"].append(ms)
            gaps.append(plan.gap)
    figures = {k: summarize(v, "ms", better="lower") for k, v in runs.items()}
    if gaps:
        figures["nodewise_gap"] = summarize(gaps, "fraction", better="lower")
    for policy, v in decide_ms.items():
        figures[f"decide_ms_{policy}"] = summarize(v, "ms", better="lower")
        rows_decide = (f"decide_ms_{policy}", f"{median(v):.2f}", f"{min(v):.2f}", f"{DECIDE_TARGETS_MS[policy]:.0f}",
                       "yes" if median(v) <= DECIDE_TARGETS_MS[policy] else "NO")
        print(format_table(("figure", "median ms", "best ms", "target ms", "met"), [rows_decide]))
    rows = [(k, f"{median(v):.2f}", f"{min(v):.2f}", f"{TARGETS_MS[k]:.0f}",
             "yes" if median(v) <= TARGETS_MS[k] else "NO") for k, v in runs.items()]
    print(format_table(("figure", "median ms", "best ms", "target ms", "met"), rows))
    if gaps:
        print(f"nodewise_gap (median optimality gap reached) = {median(gaps):.3f}")
    load = (round(load_start, 2), round(os.getloadavg()[0], 2))
    print(f"1-min load average at start / end: {load[0]} / {load[1]} ({os.cpu_count()} CPUs)")
    if only:
        return
    write_result("balance_speed", figures, {"repeats": args.repeats, "decide_repeats": args.decide_repeats,
                                            "distribution": "lognormal tokens; decide: caption mix, llama3-8b + vit-h-14",
                                            "decide_shapes": DECIDE_SHAPES, "load_avg_1m_start_end": list(load)})


if __name__ == "__main__":
    main()
