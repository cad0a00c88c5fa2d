"""The ``loom`` command.

    loom train [--config FILE] [--dry-run] [dotted.key=value ...]   launch a training run
    loom plan  [--config FILE] [--comm] [dotted.key=value ...]      print the plan and its schedule

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
    from loom.train.build import build_data, build_model

    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
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

    cfg = load_config(args.config if args.config else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None),
                      args.overrides)
    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    plan = cfg.plan.resolve(model.layer_counts())
    schedule = build_schedule(plan, trainable_stages(model, plan))
    validate_schedule(schedule, plan)
    print(plan.to_toml())
    for r in range(plan.world_size):
        print("rank {} = {} stage {} replica {}".format(r, *plan.role_of(r)))
    print()
    print(render(schedule, communication=args.comm))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loom", description="train multimodal LLMs across processes")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("train", cmd_train, "launch a training run"),
                            ("plan", cmd_plan, "print the resolved plan and schedule")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", default=None, help=f"TOML config (default: {DEFAULT_CONFIG.name})")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. run.steps=10")
        if name == "train":
            p.add_argument("--dry-run", action="store_true",
                           help="check and write runs/<name>/config.toml, print the torchrun command, start nothing")
        if name == "plan":
            p.add_argument("--comm", action="store_true", help="also show sends and receives in the schedule")
        p.set_defaults(fn=fn)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, PlanError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
