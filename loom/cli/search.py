"""``loom plan --search``: the planner's search (`loom.planner.search`) on a scenario TOML (the
format of ``loom simulate``, with an optional ``[search]`` table narrowing the space): a ranked
table of the plans it played and the best it only estimated, why each lost or was pruned, and
the winner written as a plan file that ``loom simulate --plan`` and ``loom train --plan`` take."""

from __future__ import annotations

import argparse
from pathlib import Path

from loom.cli.common import CliError

SHOWN_ESTIMATES = 8  # estimated-only rows printed below the played ones


def cmd_search(args: argparse.Namespace) -> int:
    from loom.cli.simulate import DEFAULT_SCENARIO
    from loom.planner.search import SearchSpace, search
    from loom.sim.scenario import load_scenario

    scenario = load_scenario(Path(args.config) if args.config else DEFAULT_SCENARIO, args.overrides)
    space = SearchSpace.from_table(scenario.search)
    result = search(scenario, space)
    out = Path(args.out) if args.out else Path("runs") / "plan" / f"{scenario.name}.toml"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(plan_file_text(scenario.name, result))
    except OSError as e:
        raise CliError(f"--out {str(out)!r}: cannot write the plan file ({e.strerror}); choose a writable path") from e
    print_search(scenario, result, out)
    return 0


def plan_file_text(scenario: str, result) -> str:
    best = result.best
    head = [f"# loom plan --search on scenario {scenario!r}: {best.layout}",
            f"# simulated iteration {best.iteration_time:.4f} s"
            + (f" under the {best.policy!r} balancing policy (set balance.default = {best.policy!r} in the run's config)"
               if best.policy != "none" else ""),
            f"# techniques: {', '.join(result.techniques)}", ""]
    return "\n".join(head) + best.plan.to_toml()


def print_search(scenario, result, out: Path) -> None:
    world, peak = scenario.cluster.num_gpus, scenario.cluster.spec.peak_bf16_flops
    print(f"{scenario.name}: {world} x {scenario.cluster.spec.name}, data mix {scenario.mix!r}, global batch "
          f"{scenario.global_batch_size}: searched {result.priced} plans in {result.seconds:.1f} s "
          f"({result.pruned_memory} over {scenario.memory_capacity() / 2**30:.0f} GiB per GPU, pruned)")
    header = ("#", "layout", "iter s", "samples/s", "MFU", "bubble", "peak GiB", "how", "verdict")
    rows = []
    played = [c for c in result.candidates if c.simulated is not None or c.verdict.startswith("pruned")]
    estimated = [c for c in result.candidates if c not in played][:SHOWN_ESTIMATES]
    for i, c in enumerate(played + estimated, 1):
        sim = c.simulated
        t = c.iteration_time
        mfu = sim.mfu if sim is not None else c.batch_flops / (t * world * peak) if c.batch_flops else None
        peak_mem = max(sim.peak_memory.values()) if sim is not None else c.estimate.peak_memory
        rows.append((str(i), c.layout + (f" [{c.policy}]" if c.policy != "none" else ""), f"{t:.3f}",
                     f"{scenario.global_batch_size / t:.1f}", f"{mfu:.1%}" if mfu else "-",
                     f"{sim.bubble_fraction:.1%}" if sim is not None else "-", f"{peak_mem / 2**30:.1f}",
                     "simulated" if sim is not None else "estimated", c.verdict))
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for j, row in enumerate([header, *rows]):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print(f"techniques of the winner: {', '.join(result.techniques)}")
    print(f"plan written to {out} (loom simulate --plan {out}; loom train --plan {out})")
