"""The ``loom`` command.

    loom train [--config FILE] [--dry-run] [--overwrite | --resume RUN_DIR] [dotted.key=value ...]
                                                                    launch (or continue) a training run
    loom plan  [--config FILE] [--comm] [dotted.key=value ...]      print the plan and its schedule
    loom profile [--config FILE] [--out PATH] [--tokens N,N,...] [dotted.key=value ...]
                                                                    time every layer on this machine
    loom simulate [--config SCENARIO] [--compare] [--json] [--policy NAME,...] [dotted.key=value ...]
                                                                    simulate plans at cluster scale
    loom simulate --failures TRACE | --failure-interval S [--config SCENARIO]
                                                                    Oobleck vs restart under failures
    loom bench [--list | --all | NAME ...]                          run benchmarks, regenerate results
    loom data write-demo --out DIR [--format llava|webdataset|both] [--num-samples N]
                                                                    write the demo set as files
    loom export RUN_DIR --hf OUT_DIR [--step N] [--overwrite]       a run's checkpoint as a Hugging Face model

``loom train`` checks the configuration, the plan against the model and everything else that
depends only on the config *before* starting any process, claims ``runs/<name>/`` (a reused
name is refused unless ``--overwrite``), writes ``runs/<name>/config.toml``, then runs, on this
machine,

    python -m torch.distributed.run --standalone --nproc-per-node <plan world size> \\
        -m loom.train.main --config runs/<name>/config.toml --run-dir runs/<name>

under a supervisor (`loom.train.launch`): Ctrl-C stops every worker within seconds, SIGTERM
after a checkpoint at the next step boundary (``loom train --resume runs/<name>`` continues it),
a failing rank ends the run with one line naming it, and ``runs/<name>/status`` says how the
run ended (`loom.train.status`); per-rank logs are in ``runs/<name>/logs/``. With
``--dry-run`` it stops after the checks, writes ``config.toml`` into a free run directory and
prints that command. On several nodes, copy the config and run the same module with
torchrun's rendezvous on every node, e.g.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m loom.train.main --config runs/<name>/config.toml --run-dir runs/<name>

(with ``run.device="cuda"``; the plan's world size must equal nnodes x nproc-per-node).

Every error from bad input is one line, ``loom: error: <field or flag> = <value>: <why>; <fix>``,
with exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from loom.balance.config import BalanceError
from loom.cli.bench import cmd_bench
from loom.cli.common import DEFAULT_CONFIG, CliError
from loom.cli.data import cmd_data
from loom.cli.export import cmd_export
from loom.cli.plan import cmd_plan
from loom.cli.profile import cmd_profile
from loom.cli.simulate import DEFAULT_SCENARIO, add_failure_flags, cmd_simulate
from loom.cli.train import cmd_train
from loom.plan.plan import PlanError
from loom.profile.profiler import DEFAULT_TOKEN_COUNTS
from loom.sim.scenario import ScenarioError
from loom.train.config import ConfigError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``loom: error: ...; see loom CMD --help``)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"loom: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def _train_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"training config TOML (default: configs/{DEFAULT_CONFIG.name})")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. run.steps=10")
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="take the plan from this plan file (as loom plan --search writes), as plan = \"@FILE\" does")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="loom", description="train multimodal LLMs across processes")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="launch a training run")
    _train_config_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="run every check, write runs/<name>/config.toml into a free run directory, print the "
                        "torchrun command, start nothing")
    p.add_argument("--overwrite", action="store_true",
                   help="delete runs/<name>/ first if it holds an earlier run (else a reused name is refused)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (runs/<name>) from its latest checkpoint, with its config.toml "
                        "(or --config) and the overrides on top; the plan may differ")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("plan", help="print the resolved plan and schedule, or search for the fastest plan")
    _train_config_args(p)
    p.add_argument("--comm", action="store_true", help="also show sends and receives in the schedule")
    p.add_argument("--search", action="store_true",
                   help="search a scenario's plans (--config: a scenario TOML as loom simulate takes, default "
                        f"configs/sim/{DEFAULT_SCENARIO.name}) and write the fastest that fits as a plan file")
    p.add_argument("--out", default=None, help="with --search: the plan file (default: runs/plan/<scenario>.toml)")
    p.add_argument("--cluster", default=None, metavar="local",
                   help="with --search: 'local' searches this machine (--config: a training config, default the "
                        "demo), priced by the profile `loom profile` wrote")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="with --cluster local: the profile (default: <run.out_dir>/<run.name>/profile.json)")
    p.add_argument("--ranks", type=int, default=None,
                   help="with --cluster local: how many local processes to plan for (default: this machine's cores)")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("profile", help="time every layer on this machine and write a profile")
    _train_config_args(p)
    p.add_argument("--out", default=None, help="profile JSON (default: <run.out_dir>/<run.name>/profile.json)")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKEN_COUNTS)),
                   help="token counts to measure, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (1: as a local rank)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--no-comm", action="store_true", help="skip the 2-process communication measurements")
    p.add_argument("--no-dispatch", action="store_true",
                   help="skip timing the dispatcher's host work on the plan's world of local processes")
    p.add_argument("--co-runners", type=int, default=0,
                   help="processes kept computing while timing (the other ranks sharing this machine)")
    p.add_argument("--no-contention", action="store_true",
                   help="skip measuring (on a CPU) how much more CPU the layers take beside the plan's other "
                        "local ranks")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("simulate", help="simulate plans of a scenario at cluster scale")
    p.add_argument("--config", default=None,
                   help=f"scenario TOML (default: configs/sim/{DEFAULT_SCENARIO.name}; see configs/sim/)")
    p.add_argument("overrides", nargs="*",
                   help="dotted.key=value overrides of the scenario's tables, e.g. cluster.num_gpus=512 "
                        "parallel.tensor_parallel=4")
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
    p.add_argument("--plan", action="append", default=None, metavar="FILE",
                   help="also simulate the plan of this plan file (repeatable), named by its file name")
    p.add_argument("--eager-forward", type=int, default=0, metavar="N",
                   help="encoders forward N more microbatches before their first "
                        "backward (Entrain's eager forward; every policy, as balance.eager_forward in a run)")
    p.add_argument("--entrain-eager-max", type=int, default=2, metavar="N",
                   help="the entrain policy deepens that warmup by up to N more microbatches where its "
                        "prediction finds it faster (balance.entrain_eager_max in a run; 0: off)")
    add_failure_flags(p)  # --failures TRACE: Oobleck against restart (docs/elastic.md)
    p.set_defaults(fn=cmd_simulate)

    p = sub.add_parser("bench", help="run benchmarks/ and regenerate benchmarks/results/")
    p.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (none: list them)")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("--all", action="store_true", help="run every benchmark")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("data", help="write the demo set as LLaVA-style JSON + PNG/WAV files and WebDataset shards")
    p.add_argument("action", choices=["write-demo"], help="write-demo: the demo set ([data.demo]) as files")
    p.add_argument("--out", required=True, metavar="DIR", help="where the files go (created if needed)")
    p.add_argument("--format", default="both", help="llava, webdataset or both (default)")
    p.add_argument("--num-samples", type=int, default=None, metavar="N",
                   help="samples to write (default: the config's data.demo.num_samples)")
    p.add_argument("--samples-per-shard", type=int, default=1000, metavar="N", help="samples per WebDataset shard")
    p.add_argument("--config", default=None, help=f"its [data.demo] table (default: configs/{DEFAULT_CONFIG.name})")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. data.demo.seed=1")
    p.set_defaults(fn=cmd_data)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run (runs/<name>) whose checkpoint to export")
    p.add_argument("--hf", required=True, metavar="OUT_DIR",
                   help="where model.safetensors, config.json (and loom_modules.* for encoders) go")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="export checkpoints/step_N (default: the one checkpoints/latest names)")
    p.add_argument("--overwrite", action="store_true", help="delete a non-empty OUT_DIR first")
    p.set_defaults(fn=cmd_export)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    if argv and argv[0] in commands:
        # flags may come after the overrides (loom train run.steps=3 --dry-run)
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
    else:
        args = ap.parse_args(argv)  # help, or the error naming the commands
    try:
        return args.fn(args)
    except (ConfigError, PlanError, BalanceError, ScenarioError, CliError) as e:
        print("loom: error: " + " ".join(str(e).split()), file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:  # Ctrl-C before any process started (a run's own is handled by its supervisor)
        print(f"loom: {argv[0]} interrupted", file=sys.stderr)
        return 130
