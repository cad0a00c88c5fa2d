"""Teardown stress: many short `loom train` runs back to back; every one must exit 0.

Issue 8, point 16: about 2 in 27 short runs exited with status 1 after every step had
completed, one rank aborting at process-group destruction ("terminate called without an
active exception"). The runtime now waits for every send in flight and meets the other ranks
at a barrier (`ParallelEngine.close`) before the training loop destroys the group. This script
runs the demo plan (vision and audio encoders in parallel, a 2-stage LLM: 4 processes, the
pipeline sends that teardown has to drain) for ``run.steps=2`` on a small global batch,
``--runs`` times, each run in its own run directory under a temporary directory, exactly as a
user types it:

    loom train --config configs/demo.toml --overwrite run.steps=2 run.name=teardown_<i> \\
        run.out_dir=<tmp> data.global_batch_size=8

    python benchmarks/teardown_stress.py [--runs 50] [--jobs 1]

Figure ``teardown_failures``: the number of runs that exited non-zero (target 0, lower is
better); the failures' stderr tails (and the tails of their per-rank logs) are printed and
kept in the result's config. Writes ``benchmarks/results/teardown_stress.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO_ROOT, figure, median, start_run, write_result

NAME = "teardown_stress"
TARGET = 0
TAIL_LINES = 12
OVERRIDES = ["run.steps=2", "data.global_batch_size=8"]


@dataclass
class RunOutcome:
    index: int
    returncode: int
    seconds: float
    stderr_tail: str
    rank_log_tails: dict[str, str]


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_once(index: int, out_dir: Path, config: Path, timeout: float) -> RunOutcome:
    """One `loom train` run of 2 steps in its own run directory."""
    cmd = [sys.executable, "-m", "loom.cli", "train", "--config", str(config), "--overwrite",
           f"run.name=teardown_{index}", f"run.out_dir={out_dir}", *OVERRIDES]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        code, stderr = proc.returncode, proc.stderr + proc.stdout[-2000:]
    except subprocess.TimeoutExpired as e:  # a hang at teardown is a failure too
        code, stderr = -9, f"timed out after {timeout:.0f} s\n{e.stderr or ''}"
    seconds = time.perf_counter() - t0
    logs = {}
    if code != 0:
        for log in sorted((out_dir / f"teardown_{index}" / "logs").glob("*.log")):
            text = log.read_text(errors="replace")
            if text.strip():
                logs[log.name] = _tail(text)
    return RunOutcome(index, code, seconds, _tail(stderr), logs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", type=int, default=50, help="short runs to make")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (1: strictly back to back)")
    ap.add_argument("--config", type=Path, default=REPO_ROOT / "configs" / "demo.toml", help="training config")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    ap.add_argument("--out", type=Path, default=None, help="results directory; default benchmarks/results")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: make at least 1 run")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: use at least 1")
    if not args.config.is_file():
        ap.error(f"--config {args.config}: no such file")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start_run()
    print(f"{NAME}: {args.runs} runs of `loom train --config {args.config.name} {' '.join(OVERRIDES)}`, "
          f"{args.jobs} at a time")
    t0 = time.perf_counter()
    outcomes: list[RunOutcome] = []
    with tempfile.TemporaryDirectory(prefix="loom_teardown_") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_once, i, Path(tmp), args.config.resolve(), args.timeout) for i in range(args.runs)]
        for f in futures:
            o = f.result()
            outcomes.append(o)
            print(f"  run {o.index + 1:3d}/{args.runs}: exit {o.returncode} in {o.seconds:.1f} s", flush=True)
    failures = [o for o in outcomes if o.returncode != 0]
    for o in failures:
        print(f"\nrun {o.index} exited {o.returncode}; stderr tail:\n{o.stderr_tail}")
        for name, tail in o.rank_log_tails.items():
            print(f"  {name} tail:\n{tail}")
    seconds = [o.seconds for o in outcomes]
    verdict = "meets" if len(failures) <= TARGET else "MISSES"
    print(f"\nteardown_failures = {len(failures)} of {args.runs} runs ({verdict} the target {TARGET}); "
          f"median run {median(seconds):.1f} s, total {time.perf_counter() - t0:.0f} s")
    figures = {"teardown_failures": figure(len(failures), "runs", better="lower")}
    config = {
        "runs": args.runs, "jobs": args.jobs, "config": str(args.config.relative_to(REPO_ROOT))
        if args.config.resolve().is_relative_to(REPO_ROOT) else str(args.config),
        "overrides": OVERRIDES, "command": "loom train --config <config> --overwrite run.name=teardown_<i> "
                                           "run.out_dir=<tmp> " + " ".join(OVERRIDES),
        "median_run_s": round(median(seconds), 2),
        "failures": [{"run": o.index, "exit": o.returncode, "stderr_tail": o.stderr_tail,
                      "rank_log_tails": o.rank_log_tails} for o in failures],
    }
    path = write_result(NAME, figures, config, results_dir=args.out)
    print(f"wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
