"""``loom simulate``: one simulated iteration of each plan of a scenario (`loom.sim.scenario`),
optionally under balancing policies, as a table or JSON, with timelines and Gantt charts.

With ``--failures TRACE`` (or ``--failure-interval SECONDS``, which generates a trace) it plays
node failures over Oobleck's pipeline templates and over restart-from-checkpoint instead
(`loom.planner.oobleck_failures`, docs/elastic.md) and reports each one's throughput.

Overrides (``dotted.key=value``) apply to the scenario file's tables (``cluster.num_gpus=512``,
``parallel.tensor_parallel=4``, ``data.mix="audio"``) and are checked like the file's own
values by `loom.sim.scenario.load_scenario` (the Python API refuses the same things): an unknown
field or a wrong type is refused with one line naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loom.cli.common import REPO_ROOT, CliError

DEFAULT_SCENARIO = REPO_ROOT / "configs" / "sim" / "llama3-70b-vith-1024xh100.toml"


# ---- flags ------------------------------------------------------------------------------------
def policies_of(args: argparse.Namespace) -> list[str] | None:
    """``--policy`` values (repeatable, comma lists) in order, without repeats; ``None`` if not
    given. Raises `CliError` naming ``--policy`` / ``--order`` / ``--eager-forward`` /
    ``--entrain-eager-max``."""
    from loom.balance.policy import ORDERS, POLICIES

    if args.order not in ORDERS:
        raise CliError(f"--order {args.order!r} is unknown; choose one of {', '.join(ORDERS)}")
    if args.eager_forward < 0:
        raise CliError(f"--eager-forward {args.eager_forward}: use 0 or more microbatches")
    if args.entrain_eager_max < 0:
        raise CliError(f"--entrain-eager-max {args.entrain_eager_max}: use 0 or more microbatches (0: off)")
    if not args.policy:
        return None
    names: list[str] = []
    for name in (n.strip() for value in args.policy for n in value.split(",")):
        if name and name not in POLICIES:
            raise CliError(f"--policy {name!r} is unknown; choose from {', '.join(POLICIES)} "
                           f"(repeat --policy or separate names with commas)")
        if name and name not in names:
            names.append(name)
    if not names:
        raise CliError(f"--policy is empty; choose from {', '.join(POLICIES)}")
    return names


# ---- simulating -------------------------------------------------------------------------------
def plans_of(scenario, compare: bool, files: list[str] = ()) -> dict[str, Any]:
    """The scenario's plans and those of the plan ``files`` (named by their file names); with
    ``compare`` (or when there are none) the built ones too."""
    from loom.plan.plan import Plan
    from loom.planner.baselines import first_stage_plan, frozen_aware_plan, megatron_plan, optimus_plan
    from loom.sim.scenario import ScenarioError

    plans: dict[str, Any] = {}
    if compare:
        if scenario.arch.generator_names:  # generators run on ranks of their own: no first-stage plan
            print("loom: no first-stage plan: the model has generators, which run disaggregated only")
        else:
            plans["first-stage"] = first_stage_plan(scenario)
        plans["megatron-style"] = megatron_plan(scenario)
        try:
            plans["optimus"] = optimus_plan(scenario)
        except ScenarioError as e:  # the colocated runtime runs no LLM CP: say why it is missing
            print(f"loom: no optimus plan: {e}")
        plans["frozen-aware"] = frozen_aware_plan(scenario)[0]
    plans.update(scenario.plans)
    for path in files:
        plans[Path(path).stem] = Plan.read_file(path, field="--plan")
    if not plans:
        plans["frozen-aware"] = frozen_aware_plan(scenario)[0]
    return plans


def runs_of(scenario, plan, policies: list[str] | None, order: str, metas, eager: int,
            entrain_eager_max: int = 2) -> list[tuple]:
    """``(policy label or None, file stem suffix, SimResult, BalancedRun or None)`` per run of
    ``plan``; under policies the first is the ``none`` baseline in the given order."""
    from loom.balance.config import SHARED_SLOTS
    from loom.balance.policy import JOINT, BalanceConfig

    # every run pays the dispatcher (metadata all-gather, decision, payload all-to-all), as `loom train` does
    # as in a run, --eager-forward deepens every layout's encoder warmup (balance.eager_forward), and
    # the cluster's nodes are the node-wise rearrangement's nodes (balance.ranks_per_node in a run)
    per_node = scenario.cluster.gpus_per_node
    base = scenario.run_balanced(plan, BalanceConfig("none", order="given", eager_forward=eager, ranks_per_node=per_node), metas=metas)
    if policies is None:
        return [(None, "", base.result, None)]
    runs = [("none", ".none", base.result, base)]
    if plan.placement == "first_stage" and set(policies) - {"none", *SHARED_SLOTS}:
        # its encoders run the LLM's slots: only a policy that keeps them shared applies
        print(f"loom: plan with placement {plan.placement}: only {', '.join(SHARED_SLOTS)} of the policies applies "
              f"(each encoder microbatch runs with the LLM microbatch of its slot); the others are skipped",
              file=sys.stderr)
        policies = [p for p in policies if p in ("none", *SHARED_SLOTS)]
    for name in policies:
        own_order = "given" if name in JOINT else order  # DistTrain and Entrain bring their own order
        if name == "none" and own_order == "given":
            continue  # the baseline
        label, stem = (name, name) if own_order == "given" else (f"{name} ({own_order} order)",
                                                                  f"{name}.{own_order}-order")
        config = BalanceConfig(name, order=own_order, eager_forward=eager, entrain_eager_max=entrain_eager_max,
                               ranks_per_node=per_node)
        run = scenario.run_balanced(plan, config, metas=metas)
        runs.append((label, f".{stem}", run.result, run))
    return runs


def check_fits(scenario, name: str, label: str | None, result, plan) -> None:
    from loom.sim.scenario import ScenarioError

    worst = max(result.peak_memory, key=result.peak_memory.get)
    peak, capacity = result.peak_memory[worst], scenario.memory_capacity()
    if peak > capacity:
        _, _, d = result.roles[worst]
        hosted = " + ".join(f"{m} stage {st}" for m, st, _ in plan.stages_of_unit(worst))  # all it holds
        what = f"plan {name!r}" + (f" under policy {label!r}" if label else "")
        placement = (f", or place the encoders on ranks of their own (placement = 'disaggregated' instead of "
                     f"{plan.placement!r})" if plan.placement != "disaggregated" else "")
        raise ScenarioError(
            f"{what} does not fit: rank {result.first_rank[worst]} ({hosted}, replica {d}) needs "
            f"{peak / 2**30:.1f} GiB but a {scenario.cluster.spec.name} has {capacity / 2**30:.1f} GiB, over by "
            f"{(peak - capacity) / 2**30:.1f} GiB: add stages, raise tensor_parallel or zero_stage, or set "
            f"parallel.recompute = \"full\"{placement} (or pass --allow-oom)")


def _change(value: float, reference: float) -> float | None:
    return value / reference - 1.0 if reference else None


def row_of(scenario, name: str, plan, label, result, balanced, baseline, files: dict[str, str | None]) -> dict:
    """One output row: the simulator's summary, memory, files and, under a policy, its change
    against the ``none`` baseline."""
    peak = max(result.peak_memory.values())
    row = {
        "plan": name,
        # a stage count per module; under interleaving, pipeline positions and their chunks
        "layout": ", ".join((f"{m.name} in llm.0" if plan.hosted_by_llm(m.name) and plan.placement == "first_stage" else
                             f"{m.name} dp {m.data_parallel}{f' tp {m.tensor_parallel}' if m.tensor_parallel > 1 else ''}"
                             f" on the llm's {'units' if m.tensor_parallel > 1 else 'ranks'}" if plan.hosted_by_llm(m.name) else
                             f"{m.name} {m.pipeline_depth}x{m.data_parallel}x{m.tensor_parallel}x{m.context_parallel}")
                            + (f" ({m.virtual_stages} chunks)" if m.virtual_stages > 1 else "") for m in plan.modules),
        **result.summary(),
        "peak_memory_gib": peak / 2**30,
        "fits_memory": peak <= scenario.memory_capacity(),
        **files,
    }
    if balanced is not None:
        ref, mine = baseline.loads.summary(), balanced.loads.summary()
        row.update(balanced.summary())
        row["policy_label"] = label
        row["vs_none"] = {
            "iteration_time": _change(result.iteration_time, baseline.result.iteration_time),
            "bubble_fraction": result.bubble_fraction - baseline.result.bubble_fraction,
            "load_max_over_mean": {axis: {p: _change(v, ref[axis][p]) for p, v in mine[axis].items()}
                                   for axis in mine},
        }
    return row


def simulate_plan(scenario, name: str, plan, policies, args, metas, out_dir: Path) -> list[dict]:
    plan.resolve(scenario.arch.layer_counts(), generators=scenario.arch.generator_names)
    plan.to_json(out_dir / f"{name}.plan.json")
    runs = runs_of(scenario, plan, policies, args.order, metas, args.eager_forward, args.entrain_eager_max)
    rows = []
    for label, suffix, result, balanced in runs:
        if not args.compare and not args.allow_oom:
            check_fits(scenario, name, label, result, plan)
        trace = out_dir / f"{name}{suffix}.trace.json"
        result.to_chrome_trace(trace)
        title = f"{scenario.name}: {name}" + (f", policy {label}" if label else "") + " (simulated)"
        png = None if args.no_png else result.plot_gantt(out_dir / f"{name}{suffix}.png", title=title)
        files = {"trace": str(trace), "gantt": str(png) if png else None}
        rows.append(row_of(scenario, name, plan, label, result, balanced, runs[0][3], files))
    return rows


# ---- output ---------------------------------------------------------------------------------------
def print_table(scenario, rows: list[dict], policies: list[str] | None, out_dir: Path) -> None:
    print(f"{scenario.name}: {scenario.cluster.num_gpus} x {scenario.cluster.spec.name}, data mix "
          f"{scenario.mix!r}, global batch {scenario.global_batch_size} (simulated)")

    def peak(r: dict) -> str:
        return f"{r['peak_memory_gib']:.1f}" + ("" if r["fits_memory"] else " OOM")

    def common(r: dict) -> tuple[str, ...]:
        return (f"{100 * (r['mfu'] or 0):.1f}%", f"{100 * r['bubble_fraction']:.1f}%", peak(r),
                f"{1000 * r['dispatch_s']:.1f}")

    if policies is None:
        header = ("plan", "layout (stages x DP x TP x CP)", "iter s", "samples/s", "MFU", "bubble", "peak GiB",
                  "dispatch ms")
        table = [header] + [(r["plan"], r["layout"], f"{r['iteration_time_s']:.3f}", f"{r['samples_per_s']:.1f}",
                             *common(r)) for r in rows]
    else:
        phases = list(rows[0]["load_max_over_mean"]["dp"])
        header = (("plan", "policy", "iter s", "vs none", "MFU", "bubble", "peak GiB", "dispatch ms")
                  + tuple(f"{p} DP" for p in phases) + tuple(f"{p} mb" for p in phases))
        table = [header] + [(
            r["plan"], r["policy_label"], f"{r['iteration_time_s']:.3f}",
            "-" if r["vs_none"]["iteration_time"] is None else f"{100 * r['vs_none']['iteration_time']:+.1f}%",
            *common(r),
            *(f"{r['load_max_over_mean'][axis][p]:.3f}" for axis in ("dp", "microbatch") for p in phases),
        ) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if policies is not None:
        print("DP / mb: max / mean of each phase's simulated compute across data-parallel replicas / microbatches "
              "(1 = balanced); vs none: iteration time against the unbalanced layout")
    print("dispatch ms: the dispatcher's metadata all-gather, layout decision and payload all-to-all, "
          "included in iter s")
    print(f"timelines (Chrome trace, open in https://ui.perfetto.dev) and Gantt charts in {out_dir}/")


def add_failure_flags(p: argparse.ArgumentParser) -> None:
    """``loom simulate``'s flags for failure traces (`cmd_failures`)."""
    g = p.add_argument_group("failure traces (Oobleck against restart from a checkpoint, simulated)")
    g.add_argument("--failures", default=None, metavar="TRACE",
                   help="play this failure trace (JSON or CSV time_s,node; docs/elastic.md)")
    g.add_argument("--failure-interval", type=float, default=None, metavar="SECONDS",
                   help="generate a trace instead: one node lost every SECONDS on average until half remain")
    g.add_argument("--failure-seed", type=int, default=0, help="seed of the generated trace")
    g.add_argument("--fault-tolerance", type=int, default=1, metavar="F", help="Oobleck's f (default 1)")
    g.add_argument("--microbatch-size", type=int, default=2, metavar="B", help="samples per microbatch (default 2)")
    g.add_argument("--min-nodes", type=int, default=None, metavar="N0",
                   help="nodes of the smallest template (default: the memory minimum)")
    g.add_argument("--checkpoint-every", type=int, default=10, metavar="STEPS",
                   help="restart baseline: a checkpoint every STEPS iterations (default 10, Varuna's)")
    g.add_argument("--storage-gb-per-s", type=float, default=10.0,
                   help="restart baseline: checkpoint write and read bandwidth in GB/s (default 10)")
    g.add_argument("--restart-init-s", type=float, default=60.0,
                   help="restart baseline: seconds to restart before loading the checkpoint (default 60)")
    g.add_argument("--reconfigure-s", type=float, default=10.0,
                   help="Oobleck: seconds to detect a failure and re-form process groups, besides copying layers "
                        "(default 10)")


def cmd_failures(args: argparse.Namespace, scenario) -> int:
    """Play a failure trace over Oobleck and over restart from a checkpoint; print both."""
    from loom.planner.oobleck import OobleckError, TemplateError
    from loom.planner.oobleck_failures import FailureSettings, simulate_failures
    from loom.sim.failures import TraceError, generate_trace, read_trace

    for flag, value, least in (("--fault-tolerance", args.fault_tolerance, 0), ("--microbatch-size", args.microbatch_size, 1),
                               ("--checkpoint-every", args.checkpoint_every, 1)):
        if value < least:
            raise CliError(f"{flag} {value}: must be at least {least}")
    positive = [("--storage-gb-per-s", args.storage_gb_per_s)]
    if args.failure_interval is not None:
        positive.append(("--failure-interval", args.failure_interval))
    for flag, value in positive:
        if not value > 0:
            raise CliError(f"{flag} {value}: must be positive")
    for flag, value in (("--restart-init-s", args.restart_init_s), ("--reconfigure-s", args.reconfigure_s)):
        if not value >= 0:
            raise CliError(f"{flag} {value}: a time, must not be negative")
    nodes = scenario.cluster.num_nodes
    out_dir = Path(args.out) / scenario.name
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.failures:
            trace = read_trace(args.failures, num_nodes=nodes)
        else:
            trace = generate_trace(nodes, args.failure_interval, seed=args.failure_seed)
            trace.to_json(out_dir / "failures.trace.json")
    except TraceError as e:
        raise CliError(str(e)) from e
    settings = FailureSettings(args.fault_tolerance, args.microbatch_size, args.min_nodes, args.checkpoint_every,
                               args.storage_gb_per_s * 1e9, args.restart_init_s, args.reconfigure_s)
    try:
        report = simulate_failures(scenario, trace, settings)
    except (OobleckError, TemplateError) as e:  # the numbers and the fix, on one line
        raise CliError(str(e)) from e
    if args.json:
        print(json.dumps(report.summary(), indent=2))
        return 0
    hours = trace.duration_s / 3600
    print(f"{scenario.name}: {nodes} nodes x {scenario.cluster.gpus_per_node} {scenario.cluster.spec.name}, "
          f"{len(trace.events)} failures over {hours:.1f} h, global batch {scenario.global_batch_size} (simulated)")
    print(f"Oobleck: f = {settings.fault_tolerance}, templates of {report.template_sizes[0]}.."
          f"{report.template_sizes[-1]} nodes, {settings.reconfigure_s:.0f} s reconfiguration + layer copies; restart: "
          f"checkpoint every {settings.checkpoint_every} steps ({report.checkpoint_s:.1f} s), restart "
          f"{report.restart_s:.1f} s")
    rows = [("system", "samples/s", "of failure-free", "failure-free samples/s", "steps", "lost steps")]
    for run in (report.oobleck, report.restart):
        rows.append((run.system, f"{run.samples_per_s:.2f}", f"{100 * run.fraction_of_failure_free:.1f}%",
                     f"{run.failure_free_samples_per_s:.2f}", str(run.steps), str(run.lost_steps)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"oobleck / restart: {report.ratio:.3f} (simulated)")
    if report.stopped:
        print(f"Oobleck stopped {report.stopped}")
    return 0


def refuse_elastic(config: str | None) -> None:
    """A training config with ``[elastic]`` is no scenario: its pipelines change with failures,
    which only ``--failures`` prices (on a scenario's cluster). Refused in one line."""
    from loom.sim.scenario import read_scenario_tables

    if config is not None and Path(config).is_file() and "elastic" in read_scenario_tables(Path(config)):
        raise CliError(f"{config} has an [elastic] section: loom simulate prices one plan, an elastic run's pipelines "
                       f"change as nodes fail; price Oobleck under failures with loom simulate --config SCENARIO "
                       f"--failures TRACE (or --failure-interval SECONDS; a scenario such as "
                       f"configs/sim/oobleck-gpt3-6.7b-30xa40.toml), and see the run's first layout with loom plan "
                       f"--config {config}")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate one iteration of each plan of a scenario and print a comparison table; with
    ``--policy``, each plan under each balancing policy, against the unbalanced ``none``; with
    ``--failures`` / ``--failure-interval``, a failure trace (`cmd_failures`)."""
    refuse_elastic(args.config)
    if getattr(args, "failures", None) or getattr(args, "failure_interval", None) is not None:
        from loom.sim.scenario import load_scenario

        return cmd_failures(args, load_scenario(Path(args.config) if args.config else DEFAULT_SCENARIO,
                                                args.overrides))
    policies = policies_of(args)
    from loom.sim.scenario import load_scenario

    # the same checks as the Python API: every value of the file and the overrides
    scenario = load_scenario(Path(args.config) if args.config else DEFAULT_SCENARIO, args.overrides)
    plans = plans_of(scenario, args.compare, args.plan or [])
    metas = scenario.metas()
    out_dir = Path(args.out) / scenario.name
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [row for name, plan in plans.items()
            for row in simulate_plan(scenario, name, plan, policies, args, metas, out_dir)]
    if args.json:
        extra = {} if policies is None else {"policies": policies, "order": args.order}
        print(json.dumps({"scenario": scenario.name, "simulated": True, "plans": rows, **extra}, indent=2))
    else:
        print_table(scenario, rows, policies, out_dir)
    return 0
