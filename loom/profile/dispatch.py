"""Measuring the dispatcher's host work: the CPU a rank spends per step in `Dispatcher.dispatch`
outside the layout decision (reading and checking its loader shard's samples, tokenising, the
metadata codec, packing and unpacking the payload exchange, collating its microbatches).

The run's own `Dispatcher` runs on its plan's world of local gloo processes, without a balancing
policy (the decision is priced on its own, `loom.sim.dispatch`), over global batches of several
sizes. Each dispatch is timed in CPU time (``time.process_time``, every thread of the rank), so
the figure does not depend on how many ranks share the machine's cores; the simulator adds that
contention (`loom.sim.sharing`). Each rank's time is fitted as ``fixed_s + per_sample_s * batch``
(least squares over the sizes' medians), valid at the profiled world size: a step's dispatch ends
in collectives every rank joins, so the slowest rank paces it, while on shared cores every
rank's work competes (the simulator needs them all).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch.distributed as dist

from loom.runtime.local import run_local

BATCH_SIZES = (8, 16, 32)


def _dispatch_worker(rank: int, world_size: int, make: Callable[..., Any], args: tuple, sizes: list[int],
                     repeats: int, out: str) -> None:
    dispatcher = make(*args)
    size = len(dispatcher.dataset)
    rows = []
    for r in range(repeats + 1):  # the first round warms caches (token counts, shapes)
        for b in sizes:  # sizes interleaved, so a drift in the machine's speed hits each alike
            start = (b * 7919 * (r + 1)) % size
            indices = [(start + i) % size for i in range(b)]
            dist.barrier()
            t0 = time.process_time()
            dispatcher.dispatch(indices)
            seconds = time.process_time() - t0
            if r > 0:
                rows.append([b, seconds])
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def _line(xs: list[float], medians: list[float]) -> tuple[float, float]:
    """``(fixed, per_sample)``, both clipped at 0, of the least-squares line through the medians."""
    if len(xs) == 1:
        return 0.0, max(medians[0] / xs[0], 0.0)
    per_sample, fixed = np.polyfit(xs, medians, 1)
    return max(float(fixed), 0.0), max(float(per_sample), 0.0)


def fit_dispatch(per_rank: Sequence[Sequence[Sequence[float]]], world_size: int) -> dict[str, Any]:
    """Per rank, ``fixed_s`` and ``per_sample_s`` of its dispatch CPU time (lists in rank
    order), from every rank's ``[batch, seconds]`` rows (the same batches, in the same order,
    on every rank); ``median_s[rank][size]`` are the medians fitted."""
    sizes = np.array([b for b, _ in per_rank[0]], dtype=np.float64)
    xs = sorted(set(sizes.tolist()))
    fixed, per_sample, medians = [], [], []
    for rows in per_rank:
        seconds = np.array([s for _, s in rows], dtype=np.float64)
        med = [statistics.median(seconds[sizes == x].tolist()) for x in xs]
        a, c = _line(xs, med)
        fixed.append(a)
        per_sample.append(c)
        medians.append(med)
    return {"fixed_s": fixed, "per_sample_s": per_sample, "world_size": float(world_size),
            "batch_sizes": [float(x) for x in xs], "median_s": medians}


def measure_dispatch(make: Callable[..., Any], args: tuple, world_size: int,
                     sizes: Sequence[int] = BATCH_SIZES, repeats: int = 7) -> dict[str, Any]:
    """The dispatcher's host-work fit (module docstring) on ``world_size`` local gloo processes,
    each building its `Dispatcher` as ``make(*args)`` (a module-level function: the processes
    are spawned). Batches of ``sizes`` samples, ``repeats`` timed dispatches of each."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dispatch.json")
        run_local(_dispatch_worker, world_size, make, args, list(sizes), repeats, out, threads=1)
        per_rank = json.loads(Path(out).read_text())
    return fit_dispatch(per_rank, world_size)
