"""Measuring CPU contention: how much more CPU time the layers' work takes while other ranks
compute on the same host, as in a local multi-process run (`loom.sim.sharing`).

Processor sharing (`loom.sim.sharing.CoreSharing`) prices the time slicing of ranks that
outnumber the cores: a rank computing beside ``k - 1`` others gets ``min(1, cores / k)`` of a
core. It takes one CPU second to do one second of solo work, which is not what a shared host
does: co-running processes evict each other's caches at every context switch and share the
last-level cache and memory bandwidth (and, on a VM, physical cores), so the same layer costs
more CPU time. On this project's 2-core machine the profiler's own passes took 7 % more CPU
time (``time.thread_time``) with 3 co-runners than alone, alternating, under others' load;
`benchmarks/sim_fidelity.py` had found every step above its simulation by 10 to 38 %.

`measure_contention` times the profiler's passes over every module (the forward chain and each
layer's backwards, `Profiler.module_pass_cpu`) in CPU time of the measuring thread, alternately
with its co-runners paused (solo) and computing (processes that run the profiler's own passes
on a copy of the model, `loom.profile.profiler.profiler_co_runner`, the closest stand-in for
another rank of the same model); the median over alternations of a shared pass's CPU time over
the solo pass's before it is the CPU slowdown at ``co_runners + 1`` ranks computing at once.
CPU time, not wall time: the time slicing itself is the simulator's to price, so the ratio
holds only the cost of sharing, not the waiting.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from loom.model.multimodal import MultimodalModel
from loom.profile.profiler import DEFAULT_TOKEN_COUNTS, Profiler

CONTENTION_PASSES = 5


def measure_contention(model: MultimodalModel, co_runners: int, passes: int = CONTENTION_PASSES,
                       token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS, device: str = "cpu",
                       threads: int | None = 1, dtype: str = "fp32") -> dict[str, Any]:
    """The CPU slowdown of the profiler's passes over ``model`` with ``co_runners`` processes
    computing alongside (see the module docstring): ``{"busy": co_runners + 1, "cpu_ratio": the
    median over alternations of a shared pass's CPU seconds over the solo pass's just before it,
    "solo_s": [...], "shared_s": [...], "passes": passes}``. One untimed warm-up pass, then
    ``passes`` alternations of a solo and a shared pass: each ratio compares passes seconds
    apart, so the machine's drift over the measurement (10-20 % on this project's 2-core VM)
    stays out of it."""
    if not isinstance(co_runners, int) or isinstance(co_runners, bool) or co_runners < 1:
        raise ValueError(f"co_runners = {co_runners!r}: measuring contention needs 1 or more co-running processes "
                         f"(the other ranks of the host)")
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError(f"passes = {passes!r}: use 1 or more alternations of a solo and a shared pass")
    solo, shared = [], []
    with Profiler(model, token_counts, device, threads, co_runners, seed=0, dtype=dtype) as prof:
        prof.module_pass_cpu()  # warm-up, solo
        for _ in range(passes):
            solo.append(prof.module_pass_cpu())
            prof.runners.resume()
            try:
                time.sleep(0.2)  # the co-runners are computing before the pass starts
                shared.append(prof.module_pass_cpu())
            finally:
                prof.runners.pause()
    return {"busy": co_runners + 1, "cpu_ratio": statistics.median(b / a for a, b in zip(solo, shared)),
            "solo_s": [round(s, 5) for s in solo], "shared_s": [round(s, 5) for s in shared], "passes": passes}
