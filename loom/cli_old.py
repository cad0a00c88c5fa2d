"""The ``loom`` command.

    loom train [--config FILE] [--dry-run] [dotted.key=value ...]   launch a training run
    loom plan  [--config FILE] [--comm] [dotted.key=value ...]      print the plan and its schedule
    loom profile [--config FILE] [--out PATH] [dotted.key=value ...] time every layer on this machine
    loom simulate --config SCENARIO [--compare] [--json] [--policy NAME,...] [--order given|disttrain]
                  [--eager-forward N]
                                                                    simulate plans at cluster scale
    loom profile [--config FILE] [--out PATH] [dotted.key=value ...] measure the model's layers here

``loom train`` checks the configuration and the plan against the model *before* starting any
process, writes ``runs/<name>/config.toml``, then runs, on this machine,

    python -m torch.distributed.run --standalone --nproc-per-node <plan world size> \\
        -m loom.train.main --config runs/<name>/config.toml --run-dir runs/<name>

With ``--dry-run`` it stops after writing the config and prints that command. On several nodes,
copy the config and run the same module with torchrun's rendezvous on every node, e.g.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m loom.train.main --config runs/<name>/config.toml --run-dir runs/<name>

(with ``run.device="cuda"``; the plan's world size must equal nnodes x nproc-per-node).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from loom.plan.plan import PlanError
from loom.train.config import ConfigError, TrainConfig, config_to_toml, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"


def _load(args: argparse.Namespace) -> TrainConfig:
    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    cfg = load_config(path, args.overrides)
    # resolve the plan against the real model now, so a bad plan fails before any process starts
    from loom.train.build import build_data, build_model, profiled_boundaries

    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    if cfg.run.profile:
        profiled_boundaries(cfg, model, dataset)
    cfg.plan.resolve(model.layer_counts())
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    config_path.write_text(config_to_toml(cfg))
    world = cfg.plan.world_size
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "-m", "loom.train.main", "--config", str(config_path), "--run-dir", str(run_dir),
    ]
    print(f"loom: {world} processes, plan " + ", ".join(
        f"{m.name} {m.num_stages} stage(s) x dp {m.data_parallel}" for m in cfg.plan.modules)
        + f", {cfg.plan.num_microbatches} microbatches, {cfg.plan.schedule}; run dir {run_dir}", flush=True)
    if args.dry_run:
        print("would run: " + " ".join(cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def cmd_plan(args: argparse.Namespace) -> int:
    from loom.runtime.stage import trainable_stages
    from loom.schedule.generators import build_schedule
    from loom.schedule.validate import render, validate_schedule
    from loom.train.build import build_data, build_model

    cfg = _load(args)
    model = build_model(cfg.model, build_data(cfg)[0], seed=cfg.run.seed)
    plan = cfg.plan
    schedule = build_schedule(plan, trainable_stages(model, plan))
    validate_schedule(schedule, plan)
    print(plan.to_toml())
    for r in range(plan.world_size):
        print("rank {} = {} stage {} replica {}".format(r, *plan.role_of(r)))
    print()
    print(render(schedule, communication=args.comm))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile the config's model on this machine (`loom.profile`) and write the JSON."""
    from loom.profile import profile_model
    from loom.train.build import build_data, build_model

    cfg = load_config(args.config if args.config else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None),
                      args.overrides)
    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    out = Path(args.out) if args.out else Path(cfg.run.out_dir) / cfg.run.name / "profile.json"
    token_counts = tuple(int(t) for t in args.tokens.split(","))
    print(f"loom: profiling {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters on {args.device} "
          f"with {args.threads} thread(s), token counts {list(token_counts)}, {args.repeats} repeats", flush=True)
    profile = profile_model(model, token_counts=token_counts, repeats=args.repeats, device=args.device,
                            threads=args.threads, measure_comm=not args.no_comm, co_runners=args.co_runners)
    profile.save(out)
    print(profile.table())
    print(f"profiled in {profile.settings['seconds']:.1f} s; wrote {out} (model signature {profile.signature_hash})")
    return 0


def _policies(args: argparse.Namespace) -> list[str] | None:
    """``--policy`` values (repeatable, comma lists) in order, without repeats; ``None`` if not
    given. Raises ValueError naming ``--policy`` / ``--order`` and the valid names."""
    from loom.balance.policy import ORDERS, POLICIES

    if args.order not in ORDERS:
        raise ValueError(f"--order {args.order!r} is unknown; choose one of {', '.join(ORDERS)}")
    if getattr(args, "eager_forward", 0) < 0:
        raise ValueError(f"--eager-forward {args.eager_forward}: use 0 or more microbatches")
    if not args.policy:
        return None
    names: list[str] = []
    for value in args.policy:
        for name in value.split(","):
            name = name.strip()
            if not name:
                continue
            if name not in POLICIES:
                raise ValueError(f"--policy {name!r} is unknown; choose from {', '.join(POLICIES)} "
                                 f"(repeat --policy or separate names with commas)")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"--policy is empty; choose from {', '.join(POLICIES)}")
    return names


def _policy_rows(scenario, plan, policies: list[str], order: str, metas, eager: int = 0) -> list[tuple[str, str, object]]:
    """Simulate ``plan`` under each policy: ``(row label, file stem suffix, BalancedRun)``. The
    first row is the ``none`` baseline in the given order, the reference of every ``vs none``."""
    from loom.balance.policy import JOINT, BalanceConfig

    runs = [("none", "none", scenario.run_balanced(plan, BalanceConfig("none", order="given"), metas=metas))]
    for name in policies:
        own_order = "given" if name in JOINT else order  # DistTrain and Entrain bring their own order
        if name == "none" and own_order == "given":
            continue  # the baseline
        label, stem = name, name
        if own_order != "given":
            label, stem = f"{name} ({own_order} order)", f"{name}.{own_order}-order"
        config = BalanceConfig(name, order=own_order, eager_forward=eager if name == "entrain" else 0)
        runs.append((label, stem, scenario.run_balanced(plan, config, metas=metas)))
    return runs


def _change(value: float, reference: float) -> float | None:
    return value / reference - 1.0 if reference else None


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate one iteration of each plan of a scenario and print a comparison table; with
    ``--policy``, each plan under each balancing policy, against the unbalanced ``none``."""
    import json

    from loom.planner.baselines import frozen_aware_plan, megatron_plan
    from loom.sim.scenario import ScenarioError, load_scenario

    if args.config is None:
        print("loom: error: simulate needs --config with a scenario (see configs/sim/)", file=sys.stderr)
        return 2
    try:
        policies = _policies(args)
    except ValueError as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.config)
        plans: dict[str, object] = {}
        if args.compare:
            plans["megatron-style"] = megatron_plan(scenario)
            plans["frozen-aware"] = frozen_aware_plan(scenario)[0]
        plans.update(scenario.plans)
        if not plans:
            plans["frozen-aware"] = frozen_aware_plan(scenario)[0]
        metas = scenario.metas()
        out_dir = Path(args.out) / scenario.name
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        capacity = scenario.memory_capacity()
        for name, plan in plans.items():
            plan.resolve(scenario.arch.layer_counts())
            if policies is None:
                runs = [(None, name, scenario.run(plan, scenario.microbatch_work(metas, plan.num_microbatches)), None)]
            else:
                runs = [(label, f"{name}.{stem}", run.result, run)
                        for label, stem, run in _policy_rows(scenario, plan, policies, args.order, metas,
                                                             args.eager_forward)]
            baseline = runs[0][3]
            for label, stem, result, balanced in runs:
                worst = max(result.peak_memory, key=result.peak_memory.get)
                peak = result.peak_memory[worst]
                over = peak - capacity
                if over > 0 and not args.compare and not args.allow_oom:
                    m, st, d = result.roles[worst]
                    what = f"plan {name!r}" + (f" under policy {label!r}" if label else "")
                    raise ScenarioError(
                        f"{what} does not fit: rank {result.first_rank[worst]} ({m} stage {st}, replica {d}) "
                        f"needs {peak / 2**30:.1f} GiB but a {scenario.cluster.spec.name} has {capacity / 2**30:.1f} GiB, "
                        f"over by {over / 2**30:.1f} GiB: add stages, raise tensor_parallel or zero_stage, or turn on recompute"
                    )
                trace = out_dir / f"{stem}.trace.json"
                result.to_chrome_trace(trace)
                png = None
                if not args.no_png:
                    title = f"{scenario.name}: {name}" + (f", policy {label}" if label else "") + " (simulated)"
                    png = result.plot_gantt(out_dir / f"{stem}.png", title=title)
                plan.to_json(out_dir / f"{name}.plan.json")
                row = {
                    "plan": name,
                    "layout": ", ".join(f"{m.name} {m.num_stages}x{m.data_parallel}x{m.tensor_parallel}x{m.context_parallel}"
                                        for m in plan.modules),
                    **result.summary(),
                    "peak_memory_gib": peak / 2**30,
                    "fits_memory": over <= 0,
                    "trace": str(trace),
                    "gantt": str(png) if png else None,
                }
                if balanced is not None:
                    row.update(balanced.summary())
                    row["policy_label"] = label
                    ref = baseline.loads.summary()
                    mine = balanced.loads.summary()
                    row["vs_none"] = {
                        "iteration_time": _change(result.iteration_time, baseline.result.iteration_time),
                        "bubble_fraction": result.bubble_fraction - baseline.result.bubble_fraction,
                        "load_max_over_mean": {axis: {p: _change(v, ref[axis][p]) for p, v in mine[axis].items()}
                                               for axis in mine},
                    }
                rows.append(row)
    except (ScenarioError, PlanError, ValueError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"scenario": scenario.name, "simulated": True, "plans": rows}
        if policies is not None:
            out["policies"] = policies
            out["order"] = args.order
        print(json.dumps(out, indent=2))
        return 0
    print(f"{scenario.name}: {scenario.cluster.num_gpus} x {scenario.cluster.spec.name}, data mix "
          f"{scenario.mix!r}, global batch {scenario.global_batch_size} (simulated)")
    if policies is None:
        header = ("plan", "layout (stages x DP x TP x CP)", "iter s", "samples/s", "MFU", "bubble", "peak GiB")
        table = [header] + [(
            r["plan"], r["layout"], f"{r['iteration_time_s']:.3f}", f"{r['samples_per_s']:.1f}",
            f"{100 * (r['mfu'] or 0):.1f}%", f"{100 * r['bubble_fraction']:.1f}%",
            f"{r['peak_memory_gib']:.1f}" + ("" if r["fits_memory"] else " OOM"),
        ) for r in rows]
    else:
        phases = list(rows[0]["load_max_over_mean"]["dp"])
        header = (("plan", "policy", "iter s", "vs none", "MFU", "bubble", "peak GiB")
                  + tuple(f"{p} DP" for p in phases) + tuple(f"{p} mb" for p in phases))
        table = [header] + [(
            r["plan"], r["policy_label"], f"{r['iteration_time_s']:.3f}",
            "-" if r["vs_none"]["iteration_time"] is None else f"{100 * r['vs_none']['iteration_time']:+.1f}%",
            f"{100 * (r['mfu'] or 0):.1f}%", f"{100 * r['bubble_fraction']:.1f}%",
            f"{r['peak_memory_gib']:.1f}" + ("" if r["fits_memory"] else " OOM"),
            *(f"{r['load_max_over_mean']['dp'][p]:.3f}" for p in phases),
            *(f"{r['load_max_over_mean']['microbatch'][p]:.3f}" for p in phases),
        ) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if policies is not None:
        print("DP / mb: max / mean of each phase's simulated compute across data-parallel replicas / microbatches "
              "(1 = balanced); vs none: iteration time against the unbalanced layout")
    print(f"timelines (Chrome trace, open in https://ui.perfetto.dev) and Gantt charts in {out_dir}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loom", description="train multimodal LLMs across processes")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("train", cmd_train, "launch a training run"),
                            ("plan", cmd_plan, "print the resolved plan and schedule"),
                            ("profile", cmd_profile, "time every layer on this machine and write a profile"),
                            ("simulate", cmd_simulate, "simulate plans of a scenario at cluster scale")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", default=None, help=f"TOML config (default: {DEFAULT_CONFIG.name})")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. run.steps=10")
        if name == "train":
            p.add_argument("--dry-run", action="store_true",
                           help="check and write runs/<name>/config.toml, print the torchrun command, start nothing")
        if name == "plan":
            p.add_argument("--comm", action="store_true", help="also show sends and receives in the schedule")
        if name == "simulate":
            p.add_argument("--compare", action="store_true",
                           help="also build and simulate the Megatron-style and the frozen-aware plans")
            p.add_argument("--json", action="store_true", help="print the results as JSON")
            p.add_argument("--out", default="runs/sim", help="where timelines and plans go")
            p.add_argument("--no-png", action="store_true", help="skip the Gantt charts")
            p.add_argument("--allow-oom", action="store_true", help="report plans that exceed GPU memory instead of failing")
            p.add_argument("--policy", action="append", default=None, metavar="NAME[,NAME...]",
                           help="simulate each plan under these balancing policies (none, orchmllm, disttrain, "
                                "entrain; repeatable or comma-separated), against the unbalanced 'none'")
            p.add_argument("--order", default="given",
                           help="microbatch order for the per-phase policies: given or disttrain (Algorithm 3)")
            p.add_argument("--eager-forward", type=int, default=0, metavar="N",
                           help="with --policy entrain: encoders forward N more microbatches before their first "
                                "backward (Entrain's eager forward)")
        if name == "profile":
            p.add_argument("--out", default=None, help="profile JSON (default: <run.out_dir>/<run.name>/profile.json)")
            p.add_argument("--tokens", default="64,128,256,512,1024", help="token counts to measure, comma-separated")
            p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
            p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (1: as a local rank)")
            p.add_argument("--device", default="cpu", help="cpu or cuda")
            p.add_argument("--no-comm", action="store_true", help="skip the 2-process communication measurements")
            p.add_argument("--co-runners", type=int, default=0,
                           help="processes kept computing while timing (the other ranks sharing this machine)")
        p.set_defaults(fn=fn)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, PlanError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
