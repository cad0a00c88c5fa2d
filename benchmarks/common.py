"""What every benchmark shares: spawning gloo processes, peak memory, machine information,
the result JSON of DESIGN.md ("Benchmarks") and a plain-text table."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.multiprocessing as mp

from loom.runtime.local import run_local, start_local

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---- processes ---------------------------------------------------------------------------
# Process start-up is loom's own local launcher (`loom.runtime.local`), shared with the tests.
run_gloo = run_local
start_gloo = start_local


def get_from(queue: Any, procs: Sequence[mp.Process], timeout: float = 600.0) -> Any:
    """``queue.get()`` that fails instead of hanging when a worker died or ``timeout`` passed."""
    import queue as queue_module
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"worker process(es) failed: {[(p.name, p.exitcode) for p in dead]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message from the workers within {timeout:.0f} s")


def join_all(procs: Sequence[mp.Process], timeout: float = 120.0) -> None:
    for p in procs:
        p.join(timeout)
    bad = [(p.name, p.exitcode) for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.terminate()
    if bad:
        raise RuntimeError(f"worker process(es) did not exit cleanly: {bad}")


class WorkerGroup:
    """A set of fresh gloo processes driven step by step through queues, so several groups can
    take turns on one machine. The worker ``fn(rank, world_size, name, *args, commands,
    replies, ...)`` convention: it puts ``("ready", rank)`` once built, then for every command
    from ``commands[rank]`` (``None`` ends) one ``("step", rank, ...)`` reply, and at the end
    ``("done", rank, peak_rss_mb)``."""

    def __init__(self, name: str, fn: Any, world_size: int, *args: Any, extra: tuple = ()):
        ctx = mp.get_context("spawn")
        self.name, self.world_size = name, world_size
        self.commands = [ctx.Queue() for _ in range(world_size)]
        self.replies = ctx.Queue()
        self.procs = start_gloo(fn, world_size, name, *args, self.commands, self.replies, *extra)

    def replies_of(self, kind: str) -> list[tuple]:
        """One reply of ``kind`` from every rank, in rank order."""
        got = [get_from(self.replies, self.procs) for _ in range(self.world_size)]
        assert all(r[0] == kind for r in got), f"{self.name}: expected {kind!r} replies, got {got}"
        return sorted(got, key=lambda r: r[1])

    def wait_ready(self) -> None:
        self.replies_of("ready")

    def command(self, value: Any) -> list[tuple]:
        """Send ``value`` to every rank and return their step replies."""
        for q in self.commands:
            q.put(value)
        return self.replies_of("step")

    def close(self) -> list[float]:
        """End the workers; returns each rank's peak RSS in MB."""
        for q in self.commands:
            q.put(None)
        peaks = [r[2] for r in self.replies_of("done")]
        join_all(self.procs)
        return peaks


# ---- measurements ------------------------------------------------------------------------
def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (MiB); Linux reports KiB, macOS bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def machine_info() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "torch": torch.__version__.split("+")[0], "device": "cpu"}


# ---- output ------------------------------------------------------------------------------
def figure(value: float, unit: str, digits: int = 4) -> dict[str, Any]:
    return {"value": round(float(value), digits), "unit": unit}


def write_result(name: str, figures: dict[str, dict[str, Any]], config: dict[str, Any],
                 machine: dict[str, Any] | None = None, results_dir: Path | None = None) -> Path:
    """Write ``<results_dir>/<name>.json`` in DESIGN.md's format; returns its path."""
    out_dir = results_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    data = {"benchmark": name, "figures": figures, "config": config, "machine": machine or machine_info()}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[c if isinstance(c, str) else f"{c:.1f}" if isinstance(c, float) else str(c)
                                           for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
