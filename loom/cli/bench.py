"""``loom bench [NAME...]``: run benchmarks of the repository's ``benchmarks/`` (each as
``python -m benchmarks.<name>`` from the repository root), which regenerate
``benchmarks/results/<name>.json`` (docs/architecture.md, "Benchmarks"). Without a name, or with
``--list``, it lists them; ``--all`` runs every one.

Benchmarks live in the repository, not in the installed package, so the command finds the
checkout from the current directory upwards.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from loom.cli.common import CliError


def find_checkout(start: Path) -> Path | None:
    """The nearest directory at or above ``start`` holding ``benchmarks/`` and ``loom/``."""
    for d in (start, *start.parents):
        if (d / "benchmarks" / "__init__.py").is_file() and (d / "loom").is_dir():
            return d
    return None


def benchmark_names(root: Path) -> list[str]:
    """Modules of ``benchmarks/`` that run as a script (shared helpers such as ``common`` do not)."""
    return sorted(p.stem for p in (root / "benchmarks").glob("*.py")
                  if not p.stem.startswith("_") and "__main__" in p.read_text())


def cmd_bench(args: argparse.Namespace) -> int:
    root = find_checkout(Path.cwd().resolve())
    if root is None:
        raise CliError(f"no loom checkout at or above {Path.cwd()}: the benchmarks live in the repository, "
                       f"not the installed package; cd into a clone of loom")
    names = benchmark_names(root)
    if args.list or (not args.names and not args.all):
        print(f"benchmarks in {root / 'benchmarks'} (run with: loom bench NAME... or loom bench --all):")
        for n in names:
            print(f"  {n}")
        return 0
    chosen = names if args.all else list(dict.fromkeys(args.names))
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise CliError(f"unknown benchmark(s) {unknown}; choose from {', '.join(names)}")
    failed = []
    for n in chosen:
        print(f"loom: bench {n} (python -m benchmarks.{n})", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.call([sys.executable, "-m", f"benchmarks.{n}"], cwd=root)
        except KeyboardInterrupt:
            print(f"loom: bench interrupted during {n}", file=sys.stderr)
            return 130
        took = time.perf_counter() - t0
        result = root / "benchmarks" / "results" / f"{n}.json"
        if rc == 0:
            print(f"loom: bench {n} done in {took:.0f} s; result {result}", flush=True)
        else:
            failed.append(n)
            print(f"loom: bench {n} failed with status {rc} after {took:.0f} s", file=sys.stderr, flush=True)
    if failed:
        print(f"loom: {len(failed)} of {len(chosen)} benchmark(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
