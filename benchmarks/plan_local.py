"""The planner on this machine: ``loom profile``, ``loom plan --search --cluster local``, then
``loom train`` of the searched plan beside the default plan (issue 12's local acceptance).

    python -m benchmarks.plan_local [--repeats 3 --steps 24 --warmup 4 --profile PATH --ranks N]

What runs, each as the user runs it (the ``loom`` command of this checkout, in subprocesses):

1. ``loom profile`` of the demo config (configs/demo.toml), written to a file before anything
   else (``--profile PATH`` takes a stored one instead);
2. ``loom plan --search --cluster local --profile ...``: the planner's search over this
   machine's ranks (as many as cores unless ``--ranks``), priced by that profile
   (`loom.sim.local.LocalScenario`); the winner is written as a plan file;
3. ``loom train`` of the default config and ``loom train --plan <searched>`` of the same config,
   alternating (default, searched, searched, default, ...), ``--repeats`` runs each of
   ``--steps`` steps. A run's step time is the median of its steps after ``--warmup``, from its
   ``metrics.jsonl`` (``step_time_s``: rank 0's whole iteration, sampler to loss all-reduce);
   both runs train the same global batches from the same initial weights, so their first
   losses must agree (reference semantics), or the script fails.

The prediction: for each timed step's global batch the planner's model of that step
(`LocalScenario.step_seconds`: the simulated iteration of the plan under the profile, the
dispatch, the ranks sharing the cores, the loss all-reduce); its median over the timed steps.

Figures:

- ``searched_vs_default_ratio`` (higher is better; target at least 1.0): per repeat, the default
  plan's step time over the searched plan's (neighbouring runs), median over repeats, spread;
- ``searched_step_ms`` / ``default_step_ms`` (lower): measured, median over repeats, spread;
- ``searched_predicted_step_ms`` / ``default_predicted_step_ms`` (lower): the prediction;
- ``searched_predicted_abs_rel_error`` (lower; target at most 0.15): ``|predicted - measured| /
  measured`` of the searched plan, per repeat, median and spread;
  ``default_predicted_abs_rel_error`` likewise for the default plan (for comparison);
- ``local_search_s`` (lower): the wall time of ``loom plan --search --cluster local``.

Writes ``benchmarks/results/plan_local.json`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO_ROOT, figure, format_table, median, start_run, summarize, write_result

CONFIG = REPO_ROOT / "configs" / "demo.toml"


def loom(*args: str, cwd: Path) -> str:
    """``loom ARGS`` of this checkout (`python -m loom.cli`); its stdout, or the script fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    print("  $ loom " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=cwd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"loom {args[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def train(out: Path, name: str, steps: int, plan: Path | None) -> list[dict]:
    """One ``loom train`` of the demo config for ``steps`` steps; its ``metrics.jsonl`` rows."""
    args = ["train", "--config", str(CONFIG), f"run.steps={steps}", f"run.name={name}", f"run.out_dir={out}",
            "--overwrite"] + (["--plan", str(plan)] if plan else [])
    loom(*args, cwd=out)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    if len(rows) != steps:
        raise SystemExit(f"{out / name}: {len(rows)} steps in metrics.jsonl, expected {steps}")
    return rows


def predictions(plan_path: Path | None, profile: Path, ranks: int, steps: range) -> list[float]:
    """The planner's model of each of ``steps`` of ``loom train`` with the plan of ``plan_path``
    (None: the config's own) on ``ranks`` local ranks (`LocalScenario.step_seconds`)."""
    from loom.cli import build_parser
    from loom.cli.common import plan_overrides
    from loom.cli.search import local_scenario
    from loom.train.config import load_config

    argv = ["plan", "--search", "--cluster", "local", "--config", str(CONFIG), "--profile", str(profile),
            "--ranks", str(ranks)] + (["--plan", str(plan_path)] if plan_path else [])
    args = build_parser().parse_args(argv)
    scenario = local_scenario(args)
    plan = load_config(CONFIG, plan_overrides(args)).plan
    plan.resolve(scenario.arch.layer_counts(), ranks)
    return [scenario.step_seconds(plan, step=s) for s in steps]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="loom train runs per side")
    ap.add_argument("--steps", type=int, default=24, help="steps per run")
    ap.add_argument("--warmup", type=int, default=4, help="untimed first steps of each run")
    ap.add_argument("--profile", default=None, help="a stored profile of configs/demo.toml (default: profile now)")
    ap.add_argument("--ranks", type=int, default=None, help="local ranks to plan for (default: the cores)")
    ap.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be below --steps {args.steps}")
    start_run()
    work = Path(args.out or tempfile.mkdtemp(prefix="plan_local_"))
    work.mkdir(parents=True, exist_ok=True)
    from loom.runtime.local import host_cores

    ranks = args.ranks or host_cores()

    print("1. the profile", flush=True)
    profile = Path(args.profile) if args.profile else work / "profile.json"
    if not args.profile:
        loom("profile", "--config", str(CONFIG), "--out", str(profile), cwd=work)

    print(f"2. the search on {ranks} local ranks", flush=True)
    searched = work / "searched.toml"
    t0 = time.perf_counter()
    table = loom("plan", "--search", "--cluster", "local", "--config", str(CONFIG), "--profile", str(profile),
                 "--ranks", str(ranks), "--out", str(searched), cwd=work)
    search_s = time.perf_counter() - t0
    print(table, flush=True)
    label = re.search(r"^# loom plan --search on scenario '.*?': (.*)$", searched.read_text(), re.M).group(1)

    timed = range(args.warmup, args.steps)
    print("3. the planner's model of the timed steps", flush=True)
    predicted = {"searched": median(predictions(searched, profile, ranks, timed)),
                 "default": median(predictions(None, profile, max(ranks, _world(None)), timed))}

    print(f"4. loom train, {args.repeats} runs per side, alternating", flush=True)
    measured: dict[str, list[float]] = {"default": [], "searched": []}
    first_loss: dict[str, float] = {}
    for r in range(args.repeats):
        order = ["default", "searched"] if r % 2 == 0 else ["searched", "default"]
        for side in order:
            rows = train(work, f"{side}{r}", args.steps, searched if side == "searched" else None)
            first_loss.setdefault(side, rows[0]["loss"])
            measured[side].append(median([row["step_time_s"] for row in rows[args.warmup:]]))
            print(f"  {side} run {r}: {measured[side][-1] * 1e3:.1f} ms/step (loss {rows[0]['loss']:.4f} -> "
                  f"{rows[-1]['loss']:.4f})", flush=True)
    if abs(first_loss["default"] - first_loss["searched"]) > 1e-4 * abs(first_loss["default"]):
        raise SystemExit(f"the first losses differ: default {first_loss['default']}, searched {first_loss['searched']}"
                         f": the plans do not train the same model on the same batch")

    ratios = [d / s for d, s in zip(measured["default"], measured["searched"])]
    errors = {side: [abs(predicted[side] - m) / m for m in measured[side]] for side in measured}
    figures = {
        "searched_vs_default_ratio": summarize(ratios, "ratio", "higher"),
        "searched_step_ms": summarize([m * 1e3 for m in measured["searched"]], "ms", "lower"),
        "default_step_ms": summarize([m * 1e3 for m in measured["default"]], "ms", "lower"),
        "searched_predicted_step_ms": figure(predicted["searched"] * 1e3, "ms (simulated)", "lower"),
        "default_predicted_step_ms": figure(predicted["default"] * 1e3, "ms (simulated)", "lower"),
        "searched_predicted_abs_rel_error": summarize(errors["searched"], "fraction", "lower"),
        "default_predicted_abs_rel_error": summarize(errors["default"], "fraction", "lower"),
        "local_search_s": figure(search_s, "s", "lower"),
    }
    figures["searched_vs_default_ratio"]["target"] = 1.0
    figures["searched_predicted_abs_rel_error"]["target"] = 0.15
    print(format_table(("plan", "measured ms", "predicted ms", "|error|"), [
        (side + (f" ({label})" if side == "searched" else " (configs/demo.toml)"), median(measured[side]) * 1e3,
         predicted[side] * 1e3, f"{median(errors[side]):.3f}") for side in ("default", "searched")]))
    print(f"searched_vs_default_ratio {figures['searched_vs_default_ratio']['value']} "
          f"(spread {figures['searched_vs_default_ratio']['spread']}; target >= 1.0), "
          f"searched_predicted_abs_rel_error {figures['searched_predicted_abs_rel_error']['value']} (target <= 0.15)")
    path = write_result("plan_local", figures, {
        "config": "configs/demo.toml", "ranks": ranks, "searched_plan": label,
        "searched_plan_file": searched.read_text(), "repeats": args.repeats, "steps": args.steps,
        "warmup": args.warmup, "profile": str(profile) if args.profile else "loom profile --config configs/demo.toml",
        "timing": "metrics.jsonl step_time_s (rank 0: sampler to loss all-reduce), median over the steps after "
                  "the warmup per run; runs alternate default/searched",
        "prediction": "LocalScenario.step_seconds per timed step's batch (the planner's model: ProfiledCostModel, "
                      "dispatch, core sharing, loss all-reduce), median over the timed steps"})
    print(f"wrote {path}")


def _world(plan_path: Path | None) -> int:
    """The world size of the demo config's plan (or of ``plan_path``'s)."""
    from loom.train.config import load_config
    from loom.train.build import build_data, build_model

    cfg = load_config(CONFIG, [f'plan="@{plan_path}"'] if plan_path else [])
    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed, device="meta")
    return cfg.plan.resolve(model.layer_counts()).world_size


if __name__ == "__main__":
    main()
