"""What one simulated iteration cost (`SimResult`), in the executor's timeline format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.schedule.timeline import TimelineEvent, write_chrome_trace
from loom.sim.dispatch import DispatchCost


@dataclass
class SimResult:
    """What one simulated iteration cost. Times in seconds, memory in bytes per rank; per-unit
    figures are dicts keyed by pipeline unit.

    - ``compute[u]``: time in ``FORWARD``, ``BACKWARD`` and ``OPTIMIZER_STEP``;
    - ``cpu[u]``: CPU seconds of those actions: ``compute[u]`` without core sharing; with it, the
      core-time they received (solo time times the CPU slowdown they met, `loom.sim.sharing`);
    - ``sync[u]``: time in gradient synchronisation proper (``cost.grad_sync_time`` for each
      ``GRAD_SYNC``; waiting there for slower replicas is idle);
    - ``dispatch``: the batch dispatch before the schedule starts (`loom.sim.dispatch`: metadata
      all-gather, layout decision, one payload all-to-all per phase), the same on every rank
      (each part is a collective over the world or a decision every rank makes); 0 when the
      simulation was not given one. ``dispatch_parts`` holds its parts;
    - ``busy[u] = compute[u] + sync[u] + dispatch``; ``idle[u] = iteration_time - busy[u]``: the bubbles,
      including time blocked on receives (transfers are overlapped with compute or waited for,
      so waiting for one is idle) and time after the unit's last action;
    - ``bubble_fraction``: idle GPU-time over total GPU-time, each unit weighted by its ranks
      (``Σ_u ranks[u] idle[u] / (iteration_time * world_size)``);
    - ``mfu``: ``Σ_mb cost.model_flops / (iteration_time * world_size * peak_flops_per_rank)``,
      ``None`` when the denominator is 0;
    - ``peak_memory[u]``: ``cost.static_memory`` plus the most activation memory the unit held
      at once (a microbatch's ``activation_memory`` is held from its forward to its backward,
      and only during the forward on a stage without backward);
    - ``timeline``: one `TimelineEvent` per action, ``rank`` = the unit's first rank; sends are
      instantaneous, a receive spans its wait, a grad sync spans the wait plus the collective
      (as the executor records them); with a dispatch, its parts come first on every unit as
      ``dispatch`` events (microbatch -1).
    """

    schedule_kind: str
    num_microbatches: int
    world_size: int
    iteration_time: float
    roles: dict[int, tuple[str, int, int]]  # unit -> (module, stage, replica)
    first_rank: dict[int, int]
    ranks: dict[int, int]  # unit -> ranks per unit (TP x CP)
    finish: dict[int, float]
    compute: dict[int, float]
    sync: dict[int, float]
    busy: dict[int, float]
    idle: dict[int, float]
    bubble_fraction: float
    model_flops: float
    mfu: float | None
    samples_per_s: float | None
    peak_memory: dict[int, float]
    timeline: list[TimelineEvent]
    dispatch: float = 0.0
    dispatch_parts: DispatchCost | None = None
    cpu: dict[int, float] | None = None

    def role_names(self) -> dict[int, str]:
        """First rank -> a readable role, ``"vision.1 dp0 (unit 3, 4 ranks)"``, for traces."""
        names = {}
        for u, (m, s, d) in self.roles.items():
            n = self.ranks[u]
            names[self.first_rank[u]] = f"{m}.{s} dp{d} (unit {u}" + (f", {n} ranks)" if n > 1 else ")")
        return names

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write the timeline as Chrome trace JSON, the executor's format (open in Perfetto)."""
        write_chrome_trace(self.timeline, path, self.role_names())
        return Path(path)

    def plot_gantt(self, path: str | Path, title: str | None = None, span_s: float | None = None) -> Path:
        """Write a PNG Gantt chart of the timeline (needs matplotlib); ``span_s`` fixes the time axis."""
        from loom.sim.gantt import plot_gantt

        if title is None:
            title = (f"simulated {self.schedule_kind}: {self.num_microbatches} microbatches, "
                     f"{self.world_size} ranks, {self.iteration_time:.4g} s, "
                     f"bubbles {self.bubble_fraction:.1%}")
        return plot_gantt(self.timeline, path, title=title, role_names=self.role_names(), span_s=span_s)

    def summary(self, per_unit: bool = False) -> dict[str, Any]:
        """The headline figures as a JSON-ready dict (``per_unit`` adds one row per unit)."""
        out: dict[str, Any] = {
            "simulated": True,  # docs/architecture.md principle 6: a simulator figure is labelled as simulated
            "schedule": self.schedule_kind,
            "num_microbatches": self.num_microbatches,
            "world_size": self.world_size,
            "num_units": len(self.roles),
            "iteration_time_s": self.iteration_time,
            "bubble_fraction": self.bubble_fraction,
            "mfu": self.mfu,
            "samples_per_s": self.samples_per_s,
            "model_flops": self.model_flops,
            "max_peak_memory_bytes": max(self.peak_memory.values(), default=0.0),
            "dispatch_s": self.dispatch,
        }
        if self.dispatch_parts is not None:
            out["dispatch"] = self.dispatch_parts.summary()
        if per_unit:
            out["units"] = {
                str(u): {"role": f"{m}.{s} dp{d}", "first_rank": self.first_rank[u], "ranks": self.ranks[u],
                         "busy_s": self.busy[u], "idle_s": self.idle[u], "finish_s": self.finish[u],
                         "peak_memory_bytes": self.peak_memory[u]}
                for u, (m, s, d) in self.roles.items()
            }
        return out
